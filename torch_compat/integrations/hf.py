"""Hugging Face ``transformers.Trainer`` with guarded optimizer checkpoints.

`GuardedTrainer` overrides the two hooks the Trainer calls for the optimizer state,
``_save_optimizer_and_scheduler(output_dir)`` and ``_load_optimizer_and_scheduler(checkpoint)``
(transformers 4.46 through 5.x): ``checkpoint-N/`` holds ``optimizer.jg`` (a jaxguard
container, certified against the live parameters, i.e. the weights saved beside it)
instead of ``optimizer.pt``; ``scheduler.pt``, the model, RNG and trainer state are
written by the Trainer as usual, into a hidden staging directory beside ``checkpoint-N/``
(one per save)
that is published by rename when the whole checkpoint is written (the Trainer itself
writes into ``checkpoint-N/`` in place: a save killed half way leaves a directory that
``resume_from_checkpoint=True`` picks, and whose missing optimizer file the Trainer skips
without a word). A save interrupted anywhere leaves the previous ``checkpoint-N/``, if
any, as it was (`jaxguard.format.storage.commit_directory`); the next save or
``train()`` undoes what it left (`jaxguard.format.storage.recover_directory`). With
``push_to_hub`` the Trainer uploads from the checkpoint directory while it trains on, so those saves are written in place as the
Trainer writes them. ``trainer.train(resume_from_checkpoint=...)`` loads
``optimizer.jg`` when present and falls back to the Trainer's own loader for a plain
checkpoint (one that holds ``optimizer.pt``). A checkpoint taken where a param group's lr
is 0 (the last step of a schedule that decays to 0, the Trainer's default ``linear``)
keeps the uncompressed ``optimizer.pt``, with a logged warning: the guarantee is relative
to ``lr`` and there is nothing to certify against.

Guarantee: for every coordinate, the first update after resuming differs from the update
the uncompressed state would give by at most ``tau * lr`` for every gradient ``|g| <= clip``
(``max_grad_norm <= clip`` makes every coordinate of the clipped gradient obey it).
``lr`` is the param group's learning rate at save time, which the Trainer's scheduler has
already set for the next step.

Non-blocking saves: ``GuardedTrainer(..., jaxguard_async=True)`` copies the optimizer state
and the weights it is certified against on the host at the save (the Trainer's own files are
written as usual) and encodes, writes and publishes ``checkpoint-N/`` on a background thread
while training goes on; the published file is the one a blocking save writes. The next
save, the end of ``train()`` and `jaxguard_wait` wait for it, and an error in the
background is raised there; the Trainer's end of training (best model, rotation) and the
save at the last step wait too. Until it is published, ``checkpoint-N/`` does not exist, so
a resume picks the previous checkpoint.

Supported: single process or DDP (rank 0 writes, every rank reads). Adam/AdamW state of
float32 parameters (``adamw_torch``, ``adamw_torch_fused``, a torch Adam/AdamW built by the
caller) is compressed; whatever the guard cannot certify (bfloat16/float16 parameters or
moments, amsgrad, another optimizer) is stored exactly in ``optimizer.jg``, with one
warning line (`jaxguard.uncovered`; docs/coverage.md). DeepSpeed, FSDP, XLA and SageMaker MP
keep their own optimizer files: refused with a one-line error at the first save.
"""
from __future__ import annotations

__all__ = ["GuardedTrainer", "SCHEDULER_NAME"]

import logging
import os
import shutil

import torch
from transformers import Trainer

from jaxguard.errors import CheckpointError, UnsupportedOptimizerError
from jaxguard.format.storage import commit_directory, new_token, recover_directories, recover_directory, staging_path
from torch_compat.integrations._common import (OPTIMIZER_FILE, copy_for_later, model_names, save_optimizer, unwrap,
                                               zero_lr_groups)

SCHEDULER_NAME = "scheduler.pt"
log = logging.getLogger("jaxguard.integrations.hf")   # the name users configure (the import path they use)


class GuardedTrainer(Trainer):
    """A ``transformers.Trainer`` whose checkpoints store the Adam state guarded.

    Args:
      *args, **kwargs: as for ``transformers.Trainer``.
      jaxguard_tau: the first-update tolerance, a fraction of ``lr`` (default 0.01).
      jaxguard_clip: the gradient bound ``C`` the guarantee covers (default 0.2).
      jaxguard_codec: the moment codec (default ``jaxguard.DEFAULT_CODEC``).
      jaxguard_spec: the guard settings, a `jaxguard.GuardSpec` (default ``GuardSpec()``);
        the three arguments above override its fields.
      jaxguard_async: encode and publish each checkpoint on a background thread (a host
        copy of the optimizer state is taken at the save; see the module docstring).

    What the guard cannot certify (bfloat16 or float16 parameters or moments, amsgrad, an
    optimizer that is not Adam) is stored exactly in ``optimizer.jg``, with one warning line
    naming it (`jaxguard.uncovered`): every checkpoint is written and resumes.
    ``optim="adamw_torch_fused"`` (the default with torch >= 2.8) is certified against the
    fused CPU op model.

    Raises:
      UnsupportedOptimizerError: at the first save, for DeepSpeed/FSDP/XLA/SageMaker MP
        (they write their own optimizer files).
    """

    def __init__(self, *args, jaxguard_tau: float | None = None, jaxguard_clip: float | None = None,
                 jaxguard_codec: str | None = None, jaxguard_spec=None, jaxguard_async: bool = False, **kwargs):
        from jaxguard.core.config import save_spec
        spec = save_spec(jaxguard_spec, tau=jaxguard_tau, clip=jaxguard_clip, codec=jaxguard_codec)   # fails early
        super().__init__(*args, **kwargs)
        self.jaxguard_spec = spec
        self.jaxguard_tau, self.jaxguard_clip, self.jaxguard_codec = spec.tau, spec.clip, spec.codec
        self.jaxguard_last_summary: dict | None = None
        self._jaxguard_stage_root: str | None = None
        self.jaxguard_async = bool(jaxguard_async)
        self._jaxguard_job = None          # the optimizer write of the save in progress (async)
        self._jaxguard_thread = None       # the background save still running (its join raises its error)

    def jaxguard_wait(self) -> None:
        """Wait for the background save (``jaxguard_async``), if one is running.

        Raises:
          The background save's exception (a refusal, a full disk), once: that checkpoint
          was not published.
        """
        th, self._jaxguard_thread = self._jaxguard_thread, None
        if th is not None:
            th.join()

    def train(self, *args, **kwargs):
        """``Trainer.train``, after undoing what an interrupted save left in ``output_dir``.

        A save stopped between the two renames that publish it leaves the previous
        ``checkpoint-N/`` aside under a hidden name: it is moved back here, before the Trainer
        looks for the checkpoint to resume from. Unfinished staging directories are named in
        a warning, and removed once an hour old (`jaxguard.format.storage.recover_directory`).

        Args:
          *args, **kwargs: as for ``transformers.Trainer.train``.

        Returns:
          What ``Trainer.train`` returns.
        """
        if self.args.should_save:
            for what in recover_directories(self.args.output_dir):
                log.warning("GuardedTrainer: %s", what)
        self.accelerator.wait_for_everyone()
        try:
            out = super().train(*args, **kwargs)
        except BaseException:
            th, self._jaxguard_thread = self._jaxguard_thread, None
            if th is not None:
                try:
                    th.join()
                except BaseException:   # noqa: BLE001 - the training error is the one to report
                    pass
            raise
        self.jaxguard_wait()
        return out

    def _finalize_training(self, *args, **kwargs):
        # the Trainer's end of training (transformers 5) sorts, loads and deletes checkpoints:
        # every background save must be published first
        self.jaxguard_wait()
        return super()._finalize_training(*args, **kwargs)

    def _load_best_model(self, *args, **kwargs):
        self.jaxguard_wait()
        return super()._load_best_model(*args, **kwargs)

    def _get_output_dir(self, trial):
        return self._jaxguard_stage_root or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial):
        if self.args.push_to_hub:      # the upload reads the checkpoint directory after this returns
            return super()._save_checkpoint(model, trial)
        self.jaxguard_wait()      # a loop waits for the previous save first, as orbax does
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        run_dir = super()._get_output_dir(trial)
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        final = os.path.join(run_dir, name)
        from accelerate.utils import broadcast_object_list
        token = broadcast_object_list([new_token()])[0]   # every rank writes into the same stage
        stage_root = staging_path(final, token)
        if self.args.should_save:
            for what in recover_directory(final):
                log.warning("GuardedTrainer: %s", what)
            os.makedirs(stage_root)
        self.accelerator.wait_for_everyone()
        self._jaxguard_stage_root = stage_root
        try:
            super()._save_checkpoint(model, trial)   # writes stage_root/checkpoint-N; its rotation sees one
        except BaseException:
            self._jaxguard_stage_root = None
            self._jaxguard_job = None
            if self.args.should_save:
                shutil.rmtree(stage_root, ignore_errors=True)
            raise
        self._jaxguard_stage_root = None
        staged = os.path.join(stage_root, name)
        if self.state.best_model_checkpoint == staged:   # the Trainer found the best one in the stage
            self.state.best_model_checkpoint = final
            if self.args.should_save:
                from transformers.trainer import TRAINER_STATE_NAME
                self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        self.accelerator.wait_for_everyone()   # every rank wrote its RNG state into the stage
        job, self._jaxguard_job = self._jaxguard_job, None
        if self.args.should_save:
            def publish():
                if job is not None:
                    job()
                commit_directory(staged, final, token)
                os.rmdir(stage_root)
                self._rotate_guarded_checkpoints(run_dir)

            def publish_in_background():
                try:
                    publish()
                except BaseException as exc:    # raised by jaxguard_wait; the stage stays for recovery
                    if hasattr(exc, "add_note"):
                        exc.add_note(f"jaxguard: the background save of {final} failed; it was not published "
                                     "(the previous checkpoint, if any, is as it was)")
                    raise
            if job is None:
                publish()
            else:
                from jaxguard.format.container import InThread
                self._jaxguard_thread = InThread(publish_in_background, "jaxguard-hf-save")
        self.accelerator.wait_for_everyone()

    def _rotate_guarded_checkpoints(self, run_dir):
        try:
            from transformers.trainer_utils import rotate_checkpoints
        except ImportError:                      # transformers < 5: a Trainer method
            return self._rotate_checkpoints(use_mtime=True, output_dir=run_dir)
        rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                           best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)

    def _refuse_other_backends(self):
        for flag, what in (("is_deepspeed_enabled", "DeepSpeed"), ("is_fsdp_enabled", "FSDP"),
                           ("is_fsdp_xla_v1_enabled", "FSDP on XLA")):
            if getattr(self, flag, False):
                raise UnsupportedOptimizerError(f"GuardedTrainer: {what} writes its own optimizer files; use "
                                                "transformers.Trainer there (jaxguard guards single-process and DDP)")
        from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available
        if is_torch_xla_available() or is_sagemaker_mp_enabled():
            raise UnsupportedOptimizerError("GuardedTrainer: XLA / SageMaker MP optimizer saving is not supported; "
                                            "use transformers.Trainer there")

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        self._refuse_other_backends()
        zero = zero_lr_groups(self.optimizer)
        if zero:  # e.g. the final checkpoint of a schedule that decays to 0
            log.warning("GuardedTrainer: lr is 0 in param group(s) %s at step %s; nothing to certify against, "
                        "so this checkpoint keeps the uncompressed optimizer.pt", zero, self.state.global_step)
            self.jaxguard_last_summary = None
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            path = os.path.join(output_dir, OPTIMIZER_FILE)
            where = f"GuardedTrainer: checkpoint-{self.state.global_step}"
            names = model_names(self.optimizer, [self.model])
            if (self.jaxguard_async and not self.args.push_to_hub and self._jaxguard_stage_root is not None
                    and self.state.global_step < self.state.max_steps):   # the last save: training ends, no gain
                taken = copy_for_later(self.optimizer)   # the loop goes on meanwhile

                def job():
                    self.jaxguard_last_summary = save_optimizer(path, None, spec=self.jaxguard_spec, where=where,
                                                                snapshot=taken, names=names)
                self._jaxguard_job = job     # run by _save_checkpoint's background publish
            else:
                self.jaxguard_last_summary = save_optimizer(path, self.optimizer, spec=self.jaxguard_spec, where=where,
                                                            names=names)
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, OPTIMIZER_FILE)
        if not os.path.isfile(path):  # a plain Trainer checkpoint: the Trainer's own loader
            if not self.args.save_only_model and not any(
                    os.path.isfile(os.path.join(checkpoint, f)) for f in ("optimizer.pt", "optimizer.bin")):
                raise CheckpointError(f"{checkpoint} holds no optimizer state ({OPTIMIZER_FILE} or optimizer.pt): a "
                                      "save that did not finish, or one with save_only_model; resuming would "
                                      "restart Adam from zero; resume from an earlier checkpoint")
            return super()._load_optimizer_and_scheduler(checkpoint)
        self._refuse_other_backends()
        import torch_compat
        torch_compat.load(path, unwrap(self.optimizer), check_weights="raise")   # the Trainer loaded the model first
        sched = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(sched):
            self.lr_scheduler.load_state_dict(torch.load(sched, weights_only=True))
