"""accelerate ``Accelerator.save_state``/``load_state`` with guarded optimizer files.

``save_state(accelerator, output_dir)`` writes what ``accelerator.save_state`` writes
(weights, schedulers, RNG, dataloader samplers, custom objects, via the accelerator
itself, so hooks registered with ``register_save_state_pre_hook`` still run) except that
each prepared optimizer is stored as ``optimizer.jg`` (``optimizer_<i>.jg`` for the
i-th) instead of ``optimizer.bin``; ``load_state(accelerator, input_dir)`` is the
inverse, and falls back to ``accelerator.load_state`` for a directory holding
``optimizer.bin``. Where a param group's lr is 0 (the end of a schedule that decays to 0)
``save_state`` keeps the uncompressed ``optimizer.bin``: the guarantee is relative to lr.

A save to a named ``output_dir`` is written into a hidden staging directory beside it and
published by rename once everything (accelerate's files and the optimizer files) is
written: a save interrupted anywhere leaves the previous ``output_dir``, if any, as it was
(accelerate itself writes into ``output_dir`` in place, so a kill half way mixes the new
weights with the previous optimizer state). The next `save_state` or `load_state` of that
directory undoes what an interrupted one left (`jaxguard.format.storage.recover_directory`).
With ``automatic_checkpoint_naming`` accelerate picks a fresh ``checkpoint_<i>`` directory itself (and refuses an existing one),
and those saves are written there as accelerate writes them.

Why wrappers rather than a pre-hook alone: accelerate calls the save/load pre-hooks with
``(models, weights, dir)`` / ``(models, dir)`` only, and writes/reads ``optimizer.bin``
after them unconditionally; a hook can add files but cannot stop the uncompressed
optimizer file. The wrappers hold the prepared optimizers out of the accelerator's list
(``accelerator._optimizers``, in place, restored in a ``finally``) for the duration of the
call.

Guarantee: for every coordinate, the first update after loading differs from the update
the uncompressed state would give by at most ``tau * lr`` for every gradient ``|g| <= clip``
(``accelerator.clip_grad_norm_(params, clip)`` makes every coordinate obey it). What the
guard cannot certify (bfloat16/float16 parameters or moments, amsgrad, an optimizer that is
not Adam) is stored exactly in the optimizer's ``.jg`` file, with one warning line
(`jaxguard.uncovered`; docs/coverage.md).
Supported: single process and DDP (the main process writes; every process reads); FSDP,
DeepSpeed and Megatron-LM keep their own optimizer files and are refused.
"""
from __future__ import annotations

__all__ = ["save_state", "load_state", "optimizer_file"]

import contextlib
import logging
import os
import shutil

from jaxguard.errors import ConfigError, UnsupportedOptimizerError
from jaxguard.format.storage import commit_directory, new_token, recover_directory, staging_path
from torch_compat.integrations._common import model_names, save_optimizer, unwrap, zero_lr_groups

log = logging.getLogger("jaxguard.integrations.accelerate")   # the name users configure (the import path they use)


def optimizer_file(i: int) -> str:
    """The guarded optimizer file of the i-th prepared optimizer (accelerate's naming).

    Args:
      i: the optimizer's index in ``accelerator._optimizers``.

    Returns:
      ``"optimizer.jg"`` for 0, else ``"optimizer_{i}.jg"``.
    """
    return "optimizer.jg" if i == 0 else f"optimizer_{i}.jg"


def _check_backend(accelerator):
    kind = str(getattr(accelerator, "distributed_type", "")).rsplit(".", 1)[-1]
    if kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"):
        raise UnsupportedOptimizerError(f"jaxguard accelerate integration: distributed_type {kind} keeps its own "
                                        "optimizer files; use accelerator.save_state there")


@contextlib.contextmanager
def _optimizers_held_out(accelerator):
    held = list(accelerator._optimizers)
    accelerator._optimizers.clear()
    try:
        yield held
    finally:
        accelerator._optimizers[:] = held


def save_state(accelerator, output_dir: str | None = None, *, tau: float | None = None, clip: float | None = None,
               codec: str | None = None, spec=None, **kwargs) -> str:
    """``accelerator.save_state`` with each optimizer stored guarded (module docstring).

    Args:
      accelerator: an ``accelerate.Accelerator`` whose optimizers were prepared.
      output_dir: as for ``Accelerator.save_state`` (None: its automatic naming).
      tau, clip, codec: the guard's tolerance (fraction of lr), gradient bound and codec
        (default: the spec's).
      spec: the guard settings, a `jaxguard.GuardSpec` (default ``GuardSpec()``).
      **kwargs: passed to ``Accelerator.save_state``.

    Returns:
      The directory written: `output_dir`, or the one accelerate's automatic naming chose.

    Raises:
      UnsupportedOptimizerError: FSDP/DeepSpeed/Megatron (they keep their own optimizer files).

    Warns:
      JaxguardWarning: one line naming what the guard could not certify and stored exactly
        (bfloat16/float16 parameters or moments, amsgrad, an optimizer that is not Adam:
        `jaxguard.uncovered`).
    """
    _check_backend(accelerator)
    zero_lr = any(zero_lr_groups(opt) for opt in accelerator._optimizers)
    if output_dir is None or accelerator.project_configuration.automatic_checkpoint_naming:
        if zero_lr:   # lr 0: nothing to certify against (the guarantee is relative to lr); keep optimizer.bin
            return accelerator.save_state(output_dir, **kwargs)
        with _optimizers_held_out(accelerator) as opts:
            location = accelerator.save_state(output_dir, **kwargs)
        _write_optimizers(accelerator, opts, location, spec=spec, tau=tau, clip=clip, codec=codec, named=location)
        accelerator.wait_for_everyone()
        return location
    from accelerate.utils import broadcast_object_list
    final = os.path.normpath(os.fspath(output_dir))
    token = broadcast_object_list([new_token()])[0]   # one stage for every process
    stage = staging_path(final, token)
    if accelerator.is_main_process:
        _log_recovered(final)
        os.makedirs(stage)
    accelerator.wait_for_everyone()
    try:
        if zero_lr:
            accelerator.save_state(stage, **kwargs)
        else:
            with _optimizers_held_out(accelerator) as opts:
                accelerator.save_state(stage, **kwargs)
            _write_optimizers(accelerator, opts, stage, spec=spec, tau=tau, clip=clip, codec=codec, named=final)
        accelerator.wait_for_everyone()   # every process wrote its RNG state into the stage
        if accelerator.is_main_process:
            commit_directory(stage, final, token)
    except BaseException:
        if accelerator.is_main_process:
            shutil.rmtree(stage, ignore_errors=True)
        raise
    accelerator.wait_for_everyone()
    return final


def _log_recovered(final):
    for what in recover_directory(final):
        log.warning("jaxguard accelerate integration: %s", what)


def _write_optimizers(accelerator, opts, location, *, spec, tau, clip, codec, named):
    """Write each optimizer's file into `location`; messages name it as in `named` (the
    directory the user asked for, not the hidden stage it is published from)."""
    from jaxguard.core.config import save_spec
    if accelerator.is_main_process:
        spec = save_spec(spec, tau=tau, clip=clip, codec=codec)
        for i, opt in enumerate(opts):
            save_optimizer(os.path.join(location, optimizer_file(i)), opt, spec=spec,
                           where=f"jaxguard accelerate integration: {os.path.basename(named)}/{optimizer_file(i)}",
                           names=model_names(opt, [accelerator.unwrap_model(m) for m in accelerator._models]))


def load_state(accelerator, input_dir: str, **kwargs) -> None:
    """``accelerator.load_state`` reading the guarded optimizer files `save_state` wrote.

    Args:
      accelerator: the ``accelerate.Accelerator`` with the same prepared objects as at save.
      input_dir: the directory `save_state` returned.
      **kwargs: passed to ``Accelerator.load_state``.

    Raises:
      ConfigError: `input_dir` is None (pass the directory explicitly).
      CheckpointError / ContainerError: the optimizer file does not match or is corrupt, or
        its moments were certified against other weights than the loaded model's
        (a directory mixing two saves: `torch_compat.state.check_certified_weights`).
    """
    import torch_compat
    if input_dir is None:
        raise ConfigError("load_state: input_dir is None; pass the directory save_state returned")
    if accelerator.is_main_process:
        _log_recovered(input_dir)   # a save stopped while publishing: the previous directory comes back
    accelerator.wait_for_everyone()
    if not os.path.isfile(os.path.join(input_dir, optimizer_file(0))):
        return accelerator.load_state(input_dir, **kwargs)  # a plain accelerate checkpoint
    _check_backend(accelerator)
    with _optimizers_held_out(accelerator) as opts:
        accelerator.load_state(input_dir, **kwargs)
    for i, opt in enumerate(opts):
        torch_compat.load(os.path.join(input_dir, optimizer_file(i)), unwrap(opt), check_weights="raise")
