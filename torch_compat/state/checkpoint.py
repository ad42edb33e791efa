"""torch checkpoints in and out of containers: `save`/`load` of a live optimizer,
`compress_checkpoint` of a CKPT dict, `restore_tree` back to a torch tree."""
from __future__ import annotations

__all__ = ['compress_checkpoint', 'compress_checkpoint_to', 'restore_tree', 'save', 'snapshot', 'save_snapshot',
           'load']

import os
from typing import TYPE_CHECKING

from jaxguard.format import container
from jaxguard.errors import CheckpointError, ConfigError, UnsupportedOptimizerError
from jaxguard.uncovered import policy as uncovered_policy
from torch_compat.state.tensors import torch, torch_version, writer
from torch_compat.state.skeleton import from_skeleton, to_skeleton
from torch_compat.state.records import lazy_save_spec, state_records, torch_update_request
from torch_compat.state.first_update import (certified_by_group, check_certified_weights, check_layout,
                                             check_next_update, warn_other_kernel, watch_first_step)

if TYPE_CHECKING:
    from jaxguard.core.config import GuardSpec


def _checkpoint_records(ckpt, *, spec, op_model=None, param_order=None, lr=None, uncertifiable="refuse"):
    """(records, meta, extra header) of a CKPT dict; the header's guard fields come from
    the first moments entry (`jaxguard.writer`).  The records of the keys other than
    ``optimizer`` (the model's tensors, stored exactly) come first, the optimizer's after."""
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"the checkpoint is a {type(ckpt).__name__}; expected a dict with 'model' and 'optimizer' keys")
    for key in ("model", "optimizer"):
        if key not in ckpt:
            raise CheckpointError(f"the checkpoint has no {key!r} key (keys: {', '.join(map(str, ckpt))}); save "
                                  "{'model': model.state_dict(), 'optimizer': optimizer.state_dict()}")
    notes: dict = {}
    update = torch_update_request(lr=lr, op_model=op_model, uncertifiable=uncertifiable)
    opt_sk, records = state_records(ckpt["optimizer"], ckpt["model"], spec=spec, update=update,
                                    param_order=param_order, notes=notes)
    top = []
    raws: list = []     # the model's parameters and the other keys, stored exactly
    tied: dict = {}     # one table for the whole checkpoint: a tie may cross top-level keys
    for k, v in ckpt.items():
        top.append([k, opt_sk if k == "optimizer" else to_skeleton(v, str(k), raws, tied)])
    meta = {"framework": "torch", "tree": {"__dict__": top}, "torch_version": torch_version(), **notes}
    extra = {"tau": spec.tau, "clip": spec.clip, "codec": spec.codec, "bound": spec.bound, "partition": spec.partition}
    # the raws lead the file: written while the moments after them are encoded (GPT-2: 498 MB
    # of parameters, which took 1.3 s after the last moments with one core idle)
    return raws + records, meta, extra


def _variant_of(variant):
    return variant() if callable(variant) else variant


def compress_checkpoint(ckpt, *, spec=None, tau=None, clip=None, codec=None, progress=False, variant=None, op_model=None,
                        device_encode=None, param_order=None, lr=None):
    """Compress a torch checkpoint dict in memory.

    Args:
      ckpt: ``{"model": state_dict, "optimizer": state_dict, ...}`` (other keys stored exactly).
      spec: the guard settings, a `jaxguard.GuardSpec` (default ``GuardSpec()``: tau 0.01,
        clip 0.2, log8-rel, shared bound, mixed partition; the ablation switches ``bound``
        and ``partition`` are set only there).
      tau, clip, codec: override the spec's field when given.
      progress: show a tqdm bar.
      variant: the replay variant report stored in the header (``jaxguard compress``;
        informational: the guard covers every variant); a callable is called only after
        the checkpoint has been validated, so bad input fails before the slow detection.
      op_model: the kernel the run resumes on (`state_records`).
      device_encode: where moments that reached the encoder as jax arrays are encoded
        (`jaxguard.writer.device_encode_setting`: None reads ``JAXGUARD_DEVICE_ENCODE``,
        else on the device when that is not the CPU; True also for CPU tensors; False
        always on the host).
      param_order: an asserted parameter order for an optimizer without (or with stale)
        ``param_names`` (`infer_param_names`: ``"model"`` or a list of names).
      lr: the next step's learning rate instead of the param groups' (`state_records`).

    Returns:
      ``(container bytes, summary dict)`` (the `compress --json` fields).

    Raises:
      CheckpointError, UnsupportedOptimizerError: as `state_records`.
    """
    spec = lazy_save_spec(spec, tau=tau, clip=clip, codec=codec)
    records, meta, extra = _checkpoint_records(ckpt, spec=spec, op_model=op_model, param_order=param_order, lr=lr)
    extra["variant"] = variant = _variant_of(variant)
    data, summary = writer.to_bytes(records, meta, extra_header=extra, progress=progress, device_encode=device_encode)
    return data, _with_variant(summary, variant)


def compress_checkpoint_to(path, ckpt, *, spec=None, tau=None, clip=None, codec=None, progress=False, variant=None,
                           release=None, op_model=None, device_encode=None, param_order=None, lr=None,
                           uncertifiable="refuse"):
    """`compress_checkpoint` written straight to `path` (atomically), streaming: moments
    are encoded in slabs and each entry is written as soon as it is ready, so memory holds
    the checkpoint plus one slab of work, never the container.

    Args:
      path: the output file or URL.
      ckpt, spec, tau, clip, codec, progress, variant, op_model, device_encode, param_order, lr:
        as `compress_checkpoint`.
      uncertifiable: ``"refuse"`` or ``"exact"`` (`state_records`; ``jaxguard compress
        --uncertifiable``).
      release: called with source arrays the writer is done with (``jaxguard compress``
        passes `MappedSource.release` of its memory-mapped checkpoint: the peak memory
        then holds one slab of the source, not all of it).

    Returns:
      The summary dict.

    Raises:
      CheckpointError, UnsupportedOptimizerError: as `state_records`.
    """
    spec = lazy_save_spec(spec, tau=tau, clip=clip, codec=codec)
    records, meta, extra = _checkpoint_records(ckpt, spec=spec, op_model=op_model, param_order=param_order, lr=lr,
                                               uncertifiable=uncertifiable)
    extra["variant"] = variant = _variant_of(variant)
    rel = None if release is None else (lambda sources: release([t for s in sources for t in
                                                                 (s if isinstance(s, tuple) else (s,))]))
    summary = writer.to_file(path, records, meta, extra_header=extra, progress=progress, release=rel,
                             device_encode=device_encode)
    summary["stored_exactly"] = meta.get("stored_exactly") or []     # what --uncertifiable exact kept raw
    return _with_variant(summary, variant)


def _with_variant(summary, variant=None):
    if isinstance(variant, dict):
        summary.update(replay_matched=variant.get("matched"), replay_detail=variant.get("detail", ""))
    return summary


def restore_tree(path):
    """Read a torch container back into the checkpoint it was written from.

    Args:
      path: a file or URL written by `compress_checkpoint(_to)` or `save`.

    Returns:
      ``(checkpoint dict, header)``; moments are the decoded ``m~``, ``v~``.

    Raises:
      CheckpointError: the container holds another framework's checkpoint, or is inconsistent.
      ContainerError, ReaderError: the file is damaged.
    """
    header, payload, tables = container.read(path, verify_decoded=False)
    arrays = container.entries_by_name(header, payload, tables, verify_decoded=True)
    dtypes = {e["name"]: e.get("dtype") for e in header["entries"]}
    meta = header.get("meta", {})
    if meta.get("framework") != "torch":
        raise CheckpointError(f"{path} holds a {meta.get('framework')!r} checkpoint; use jaxguard.load for optax state "
                              "or `jaxguard migrate` to convert it")
    return from_skeleton(meta["tree"], arrays, dtypes), header


# ---------------------------------------------------------------- optimizer-level API
def save(path: str | os.PathLike, optimizer: torch.optim.Optimizer, *, spec: GuardSpec | None = None,
         tau: float | None = None, clip: float | None = None, codec: str | None = None, progress: bool = False,
         op_model: str | None = None, device_encode: bool | None = None,
         lr: float | tuple | list | None = None, uncertifiable: str = "refuse") -> dict:
    """Write `optimizer`'s Adam/AdamW state to `path` (certified against its live params).

    Each param group is certified for its next step as the group holds it (call it after
    ``scheduler.step()``: torch keeps the next step's lr in the group), or for `lr`; a
    group whose next lr is 0 keeps its moments exactly.

    CUDA state is encoded on the GPU when JAX has a GPU backend (its tensors reach JAX
    through DLPack, `encoder_view`): only codes, block parameters and escapes cross to the
    host (docs/gpu.md).

    Args:
      path: the output file.
      optimizer: a `torch.optim.Adam` or `AdamW` (unnamed params get ``group{g}.param{i}`` names).
      spec: the guard settings, a `jaxguard.GuardSpec` (default ``GuardSpec()``: tau 0.01,
        clip 0.2, log8-rel, shared bound, mixed partition; the ablation switches ``bound``
        and ``partition`` are set only there).
      tau, clip, codec: override the spec's field when given.
      progress: show a tqdm bar.
      op_model: the kernel the run resumes on (`state_records`; the header records the
        op model that certified the state).
      device_encode: as `compress_checkpoint` (True encodes CPU tensors on the device
        route too: how it is tested without a GPU).
      lr: the next step's learning rate instead of the groups' (`state_records`).
      uncertifiable: ``"refuse"`` (default: state the guarantee does not cover raises) or
        ``"exact"`` (stored exactly, any torch optimizer: `jaxguard.uncovered`; the trainer
        integrations' policy).

    Returns:
      The summary dict; ``stored_exactly`` lists what was stored exactly and why.

    Raises:
      UnsupportedOptimizerError: not Adam/AdamW, or state the guarantee does not cover
        (``uncertifiable="refuse"``).
      CheckpointError: as `state_records`.
    """
    sd, params = snapshot(optimizer, any_optimizer=uncovered_policy(uncertifiable) == "exact")
    return save_snapshot(path, sd, params, spec=spec, tau=tau, clip=clip, codec=codec, progress=progress,
                         op_model=op_model, device_encode=device_encode, lr=lr, uncertifiable=uncertifiable)


def snapshot(optimizer: torch.optim.Optimizer, *, copy: bool = False, any_optimizer: bool = False) -> tuple:
    """`optimizer`'s state_dict and its live parameters by name, as `save` certifies them.

    Args:
      optimizer: a `torch.optim.Adam` or `AdamW` (any torch optimizer with `any_optimizer`).
      copy: clone every tensor (state and parameters), so that the training loop may go on
        while `save_snapshot` encodes them on another thread (a background save).
      any_optimizer: take any optimizer (``uncertifiable="exact"`` stores what is not Adam).

    Returns:
      ``(state_dict, {param name: tensor})`` with ``param_names`` filled in (unnamed params
      get ``group{g}.param{i}``).

    Raises:
      UnsupportedOptimizerError: not Adam/AdamW.
    """
    if not any_optimizer and not isinstance(optimizer, torch.optim.Adam):
        raise UnsupportedOptimizerError(f"optimizer is {type(optimizer).__name__}; torch_compat.save supports "
                                        "torch.optim.Adam and AdamW")
    sd = optimizer.state_dict()
    if copy:
        sd = {"state": {k: {n: t.detach().clone() if torch.is_tensor(t) else t for n, t in st.items()}
                        if isinstance(st, dict) else st for k, st in sd["state"].items()},
              "param_groups": [dict(g) for g in sd["param_groups"]]}
    params = {}
    for gi, (g, live) in enumerate(zip(sd["param_groups"], optimizer.param_groups)):
        names = g.get("param_names") or [f"group{gi}.param{i}" for i in range(len(g["params"]))]
        g["param_names"] = names
        for name, p in zip(names, live["params"]):
            params[name] = p.detach().clone() if copy else p.detach()
    return sd, params


def save_snapshot(path: str | os.PathLike, sd: dict, params: dict, *, spec: GuardSpec | None = None,
                  tau: float | None = None, clip: float | None = None, codec: str | None = None,
                  progress: bool = False, op_model: str | None = None, device_encode: bool | None = None,
                  lr: float | tuple | list | None = None, uncertifiable: str = "refuse") -> dict:
    """`save` of a `snapshot` (the same file `save` writes of that state).

    Args:
      path: the output file.
      sd, params: what `snapshot` returned.
      spec, tau, clip, codec, progress, op_model, device_encode, lr, uncertifiable: as `save`.

    Returns:
      The summary dict (``stored_exactly``: as `save`).

    Raises:
      UnsupportedOptimizerError, CheckpointError: as `save`.
    """
    spec = lazy_save_spec(spec, tau=tau, clip=clip, codec=codec)
    notes: dict = {}
    update = torch_update_request(lr=lr, op_model=op_model, uncertifiable=uncertifiable)
    opt_sk, records = state_records(sd, params, spec=spec, update=update, notes=notes, param_map="live")
    meta = {"framework": "torch", "tree": {"__dict__": [["optimizer", opt_sk]]}, "torch_version": torch.__version__,
            **notes}
    data, summary = writer.to_bytes(records, meta, extra_header={"tau": spec.tau, "clip": spec.clip,
                                                                 "codec": spec.codec}, progress=progress,
                                    device_encode=device_encode)
    container.atomic_write(path, data)
    summary["stored_exactly"] = notes.get("stored_exactly", [])
    summary["parameters"] = sum(len(g["params"]) for g in sd["param_groups"])
    return summary


def load(path: str | os.PathLike, optimizer: torch.optim.Optimizer, *,
         check_weights: str = "warn", strict: bool = False, match: str = "names") -> torch.optim.Optimizer:
    """Load a container written by `save` (or `jaxguard compress`) into `optimizer`.

    The target layout is checked before anything is written into `optimizer`: the same
    number of param groups and of parameters in each, the same ``param_names`` where both
    sides have them (``match="names"``), and for every saved state a live parameter of its
    moments' shape and dtype (float32).  The restored tensors land on each parameter's
    device (torch's ``load_state_dict`` moves them; ``step`` stays on the CPU unless
    capturable or fused).

    What the optimizer will step with is compared with what each moment pair was
    certified for (`check_next_update`): the loaded param groups now, and again at the
    optimizer's first step if its groups changed meanwhile (a learning rate set after
    loading, a scheduler).

    Args:
      path: the container.
      optimizer: an optimizer over the same parameter layout.
      check_weights: what a parameter whose values differ from the weights its moments
        were certified against does (`check_certified_weights`): ``"warn"`` (default), ``"raise"``
        (the trainer integrations, which load the model first) or ``"off"``.
      strict: a next step other than the certified one raises instead of warning.
      match: ``"names"`` (default): saved and live ``param_names`` must agree;
        ``"position"``: the user asserts that the i-th parameter of each group is the same
        one under another name (a module renamed since the save); groups, counts, shapes
        and dtypes are still checked, and the certified weights' digests where recorded.

    Returns:
      `optimizer`, its state loaded.

    Raises:
      CheckpointError: another parameter layout (one line naming the first difference),
        or not a torch container, or (``check_weights="raise"``) other weights, or
        (``strict``) another next step than the certified one; `optimizer` is then left as
        it was.
      ConfigError: a bad `match`.

    Warns:
      JaxguardWarning: a param group resumes on another device or foreach/fused setting
        than the op model that certified it (`warn_other_kernel`), or (not ``strict``) will
        step with other hyperparameters than certified (`check_next_update`).
    """
    if match not in ("names", "position"):
        raise ConfigError(f"match={match!r} is not 'names' or 'position'")
    tree, header = restore_tree(path)
    if not isinstance(tree, dict) or "optimizer" not in tree:
        raise CheckpointError(f"{path} holds no optimizer state (keys: {', '.join(map(str, tree))}); "
                              "write it with torch_compat.save or jaxguard compress")
    sd = tree["optimizer"]
    check_layout(sd, optimizer, str(path), match=match)
    check_certified_weights(header, optimizer, str(path), on_mismatch=check_weights)
    check_next_update(header, sd, sd["param_groups"], str(path), strict=strict)   # what load_state_dict installs
    live_names = [g.get("param_names") for g in optimizer.state_dict()["param_groups"]]
    for g, names in zip(sd["param_groups"], live_names):
        if names:
            g["param_names"] = names    # match="position": the live names win (they are the same parameters)
        else:
            g.pop("param_names", None)
    certified = certified_by_group(header, sd)
    optimizer.load_state_dict(sd)    # torch moves each state tensor to its parameter's device
    warn_other_kernel(certified, optimizer, str(path))
    watch_first_step(header, sd, optimizer, str(path), strict=strict)
    return optimizer
