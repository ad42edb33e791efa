"""A torch optimizer state_dict as container records: each moment pair with the next
update it is certified for (`next_update`, `guard_config`), the rest stored exactly."""
from __future__ import annotations

__all__ = ['next_update', 'guard_config', 'step_count', 'MappedSource', 'state_records', 'UNNAMED_WHY',
           'writer_config', 'encoder_view', 'lazy_save_spec', 'torch_update_request']

import functools

from jaxguard.format.torchzip import FileTensor
from jaxguard.errors import CheckpointError, ConfigError, UnsupportedOptimizerError
from jaxguard.uncovered import policy as uncovered_policy
from torch_compat.state.tensors import HostTensor, is_tensor, jax_platform_of, scalar_value, writer
from torch_compat.state.skeleton import to_skeleton
from torch_compat.state.param_names import param_digest, param_index, param_map_of
from torch_compat.state.coverage import (EXACT_REASON, check_optimizer_state, group_uncovered, op_model_of,
                                         param_uncovered)


def next_update(group, step, *, device_type="cpu", op_model=None, lr=None):
    """The `jaxguard.core.config.NextUpdate` of one param group: what its next step will
    use, read from the group (torch keeps the next step's lr there once
    ``scheduler.step()`` ran), or the learning rate given to the save.

    Args:
      group: the param group (lr, betas, eps, weight_decay, decoupled_weight_decay, flags).
      step: the steps already taken.
      device_type, op_model: as `op_model_of` (where the state lives; the named kernel).
      lr: the next step's learning rate given to the save (a number or ``(lo, hi)``), or
        None: the group's.

    Returns:
      The `NextUpdate` (``stores_exactly`` where the learning rate is 0).

    Raises:
      CheckpointError: a tensor lr or beta of more than one element.
      UnsupportedOptimizerError: fused and foreach both set.
    """
    from jaxguard.core.config import NextUpdate   # jax: only compress pays for it, not restore
    rate = float(scalar_value(group["lr"], "lr")) if lr is None else lr
    return NextUpdate(lr=rate, step=int(step), betas=tuple(float(scalar_value(b, "beta")) for b in group["betas"]),
                      eps=float(group["eps"]), weight_decay=float(group.get("weight_decay", 0.0) or 0.0),
                      op_model=op_model_of(group, device_type, op_model),
                      source="param_groups" if lr is None else "param_groups+given")


def guard_config(group, step, *, spec, device_type="cpu", op_model=None, lr=None) -> GuardConfig:
    """The `GuardConfig` of one param group's next step (`next_update` with the save's `spec`).

    Args:
      group: the param group (lr, betas, eps, weight_decay, decoupled_weight_decay, flags).
      step: the steps already taken.
      spec: the save's `GuardSpec` (`jaxguard.core.config.save_spec`).
      device_type, op_model, lr: as `next_update`.

    Returns:
      The config, with the torch op model of the group's implementation on that device.

    Raises:
      CheckpointError: a tensor lr or beta of more than one element.
      UnsupportedOptimizerError: fused and foreach both set.
      ConfigError: a learning rate that is not > 0 (`next_update` stores such moments exactly).
    """
    from jaxguard.core.guard import GuardConfig   # jax: only compress pays for it, not restore
    return GuardConfig.from_update(spec, next_update(group, step, device_type=device_type, op_model=op_model, lr=lr))


def step_count(st, idx):
    """The ``step`` of one parameter's Adam state as an int.

    Args:
      st: the parameter's optimizer state (``opt_sd["state"][idx]``).
      idx: its key, for the error.

    Returns:
      The step count (steps already taken).

    Raises:
      CheckpointError: a step that is not a non-negative integer.
    """
    s = float(scalar_value(st["step"], f"state {idx}.step"))
    if s != int(s) or s < 0:
        raise CheckpointError(f"optimizer state {idx}.step={s} is not a non-negative integer")
    return int(s)


# ---------------------------------------------------------------- compress / restore
class MappedSource:
    """The pages of a checkpoint file this process mapped (``torch.load(path, mmap=True)``),
    which `release` drops from memory once the compressor is done with an array in them.

    A memory-mapped checkpoint's pages stay resident (and count in the peak RSS) as they
    are read, so streaming the whole state would end with all of it in memory.  `release`
    madvises ``MADV_DONTNEED`` the whole pages of an array that lie inside a mapping of
    the file: they are read again from the page cache if anything touches them later.
    Memory outside the file's mappings (copies, the heap) is never touched.  Only for a
    checkpoint nobody wrote into: a private mapping's modified pages would revert to the
    file (the CLI loads it itself and never writes).  On other systems, or when the file
    was not mapped, `release` does nothing.

    Args:
      path: the checkpoint file, after it was loaded with ``mmap=True``.
    """

    MADV_DONTNEED = 4

    def __init__(self, path):
        import os
        self.ranges = []
        self._madvise = None
        try:
            real = os.path.realpath(path)
            with open("/proc/self/maps") as fh:
                for line in fh:
                    parts = line.split(None, 5)
                    if len(parts) == 6 and parts[5].strip() == real:
                        lo, hi = (int(x, 16) for x in parts[0].split("-"))
                        self.ranges.append((lo, hi))
            if self.ranges:
                import ctypes
                libc = ctypes.CDLL(None, use_errno=True)
                libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
                self._madvise = libc.madvise
                self.page = os.sysconf("SC_PAGE_SIZE")
        except (OSError, AttributeError, ValueError):
            self.ranges = []

    def release(self, arrays) -> None:
        """Drop the resident pages wholly inside both one of `arrays` and the file's mappings.

        Args:
          arrays: numpy arrays or CPU tensors the caller is done with (a tensor counts
            with its whole storage); memory outside the file's mappings is left alone.
        """
        if not self.ranges:
            return
        for a in arrays:
            if isinstance(a, FileTensor):   # its whole storage, as for a torch tensor
                a = a.storage
            if is_tensor(a):   # its whole storage: every page of the file may be re-read
                start, size = a.untyped_storage().data_ptr(), a.untyped_storage().nbytes()
            else:
                start, size = a.__array_interface__["data"][0], a.nbytes if a.flags.c_contiguous else 0
            for lo, hi in self.ranges:
                b = max(lo, -(-start // self.page) * self.page)
                e = min(hi, (start + size) // self.page * self.page)
                if e > b:
                    self._madvise(b, e - b, self.MADV_DONTNEED)


def state_records(opt_sd, params: dict, *, spec=None, update=None, prefix="optimizer", param_order=None,
                  notes: dict | None = None, param_map: str | None = None):
    """Validate `opt_sd` against `params` now; return (optimizer skeleton, write records).

    The records (`jaxguard.writer`) are a `MomentJob` per parameter (its ``exp_avg``,
    ``exp_avg_sq`` and the parameter, as zero-copy numpy views; ``source`` holds the
    three tensors) in state order, then a `Raw` record per other tensor of the state.
    A parameter whose group's next learning rate is 0 has no `MomentJob`: its moments are
    raw tensors, stored exactly.  Everything is validated before this returns, so a bad
    checkpoint fails before any encoding or output.

    Args:
      opt_sd: the optimizer state_dict (with ``param_names``, or mapped: `param_index`).
      params: {name: tensor} of the live parameters.
      spec: the save's `GuardSpec` (None: the defaults).
      update: the save's `jaxguard.core.config.UpdateRequest` (None: everything from the
        param groups, ``uncertifiable="refuse"``; `torch_update_request`).  Of it torch
        uses ``lr`` (the next step's learning rate instead of the groups': a number or
        ``(lo, hi)`` for every group, or a list with one per param group), ``op_model``
        (the kernel the run resumes on, `op_model_of`; None: the one torch runs where the
        state lives, e.g. foreach for CUDA state saved with foreach=None) and
        ``uncertifiable`` (``"refuse"``: raise on state the guard cannot certify;
        ``"exact"``: store it exactly and say so in `notes`, `jaxguard.uncovered`; an
        optimizer that is not Adam at all is stored whole).
      prefix: the entry-name prefix (``"optimizer"``).
      param_order: an asserted parameter order (`infer_param_names`).
      notes: a dict that receives ``stored_exactly`` (a list of ``{"param", "why"}``)
        for the container's meta, when some moments are.
      param_map: how `params` was matched (a key of `PARAM_MAPS`; default from `opt_sd`).

    Returns:
      ``(optimizer skeleton, list of records)``.

    Raises:
      CheckpointError: parameters missing from `params` or of other shapes, bad steps,
        not an optimizer state_dict (`check_optimizer_state`), no provable map of
        unnamed parameters, stale ``param_names``.
      UnsupportedOptimizerError: not float32, not Adam/AdamW, an unsupported flag.
      ConfigError: a bad `lr`; weight_decay, betas, eps or tx in `update` (torch reads
        them from the param groups).
    """
    spec = lazy_save_spec(spec)
    update = torch_update_request(update)
    lr, op_model = update.lr, update.op_model
    exact_ok = uncovered_policy(update.uncertifiable) == "exact"
    if exact_ok and _not_adam_at_all(opt_sd):
        return _stored_whole(opt_sd, prefix, notes, group_uncovered(0, opt_sd["param_groups"][0]).why)
    if exact_ok and isinstance(opt_sd, dict) and isinstance(opt_sd.get("param_groups"), list):
        try:
            param_index(opt_sd, params, param_order)
        except CheckpointError:    # which weights the moments belong to is not known: nothing to certify against
            return _stored_whole(opt_sd, prefix, notes, UNNAMED_WHY)
    found: dict | None = {} if exact_ok else None
    check_optimizer_state(opt_sd, params, param_order, uncovered=found)
    names = param_index(opt_sd, params, param_order)
    param_map = param_map or param_map_of(opt_sd, param_order)
    group_lr = _group_rates(lr, len(opt_sd["param_groups"]))
    group_no = {id(g): gi for gi, g in enumerate(opt_sd["param_groups"])}
    exact = []
    state_sk = []
    raws: list = []
    jobs = []
    configs: dict = {}     # one GuardConfig per (group, step, device): 1,026 tensors share a few
    for idx, st in opt_sd["state"].items():
        if idx not in names:
            raise CheckpointError(f"optimizer state has parameter index {idx} that no param group lists")
        name, group = names[idx]
        ename = f"{prefix}/state/{idx}"
        u = found.get(idx) if found else None
        if u is None:
            if name not in params:
                raise CheckpointError(f"parameter {name!r} is in the optimizer but not in the model state_dict; "
                                      "save model.state_dict() under 'model'")
            p = params[name]
            if tuple(p.shape) != tuple(st["exp_avg"].shape) or tuple(p.shape) != tuple(st["exp_avg_sq"].shape):
                raise CheckpointError(f"parameter {name!r} has shape {tuple(p.shape)} but its moments have "
                                      f"{tuple(st['exp_avg'].shape)}; the model and optimizer do not match")
            u = param_uncovered(name, p)
            if u is not None and not exact_ok:
                raise u.error
        if u is not None:    # uncertifiable="exact": the whole state raw, exactly
            exact.append({"param": name, "why": u.why})
            state_sk.append([idx, to_skeleton(st, ename, raws)])
            continue
        step, device_type = step_count(st, idx), st["exp_avg"].device.type
        cfg = configs.get((id(group), step, device_type))
        if cfg is None:
            update = next_update(group, step, device_type=device_type, op_model=op_model,
                                 lr=group_lr[group_no[id(group)]])
            cfg = configs[(id(group), step, device_type)] = (
                None if update.stores_exactly else writer_config(spec, update))
        if cfg is None:    # next lr 0: the whole state raw, exactly
            exact.append({"param": name, "why": EXACT_REASON})
            state_sk.append([idx, to_skeleton(st, ename, raws)])
            continue
        m, v = st["exp_avg"], st["exp_avg_sq"]
        jobs.append(writer.MomentJob(ename, encoder_view(m), encoder_view(v), encoder_view(p), cfg,
                                     {"param": name, "param_map": param_map,
                                      "param_sha256": functools.partial(param_digest, p)},
                                     source=(m, v, p), param=name))
        rest = {k: v for k, v in st.items() if k not in ("exp_avg", "exp_avg_sq")}
        sk = to_skeleton(rest, ename, raws)
        sk["__dict__"] += [["exp_avg", {"__moment__": ename, "which": "m"}],
                           ["exp_avg_sq", {"__moment__": ename, "which": "v"}]]
        state_sk.append([idx, sk])
    groups_sk = to_skeleton(opt_sd["param_groups"], f"{prefix}/param_groups", raws)
    opt_sk = {"__dict__": [["state", {"__dict__": state_sk}], ["param_groups", groups_sk]]}
    if exact and notes is not None:
        notes.setdefault("stored_exactly", []).extend(exact)
    return opt_sk, jobs + raws


def torch_update_request(update=None, **given):
    """The `UpdateRequest` a torch save certifies for.

    Args:
      update: an `UpdateRequest`, or None.
      **given: ``lr``, ``op_model``, ``uncertifiable``: the keywords `torch_compat.save`
        and the planners take, made into one when `update` is None.

    Returns:
      An `UpdateRequest` (the defaults when neither is given).

    Raises:
      ConfigError: both given; weight_decay, betas, eps or tx in it (torch reads the
        update's hyperparameters from ``param_groups``: set them on the optimizer).
    """
    from jaxguard.core.config import UpdateRequest   # jax: only compress pays for it, not restore
    if update is None:
        update = UpdateRequest(**given)
    elif given:
        raise ConfigError(f"pass the next update either as update= or as {', '.join(sorted(given))}=, not both")
    extra = [k for k in ("weight_decay", "betas", "eps", "tx") if getattr(update, k) is not None]
    if extra:
        raise ConfigError(f"a torch save reads {', '.join(extra)} from the optimizer's param_groups; set them there "
                          "instead of on the UpdateRequest")
    return update


def _not_adam_at_all(opt_sd) -> bool:
    """An optimizer state_dict none of whose groups is Adam/AdamW (SGD, Adafactor, ...)."""
    groups = opt_sd.get("param_groups") if isinstance(opt_sd, dict) else None
    return (isinstance(groups, list) and isinstance(opt_sd.get("state"), dict) and bool(groups)
            and all(isinstance(g, dict) and ("betas" not in g or "eps" not in g) for g in groups))


UNNAMED_WHY = ("moments whose parameters are not named (build the optimizer from model.named_parameters()), so no "
               "weights to certify against")


def _stored_whole(opt_sd, prefix, notes, why):
    """An optimizer that is not Adam, or whose parameters are not known, stored exactly as it
    is (``uncertifiable="exact"``)."""
    raws: list = []
    names = {idx: n for g in opt_sd["param_groups"] for idx, n in zip(g.get("params", ()), g.get("param_names") or ())}
    if notes is not None:
        notes.setdefault("stored_exactly", []).extend(
            {"param": names.get(idx, f"{prefix} parameter {idx}"), "why": why} for idx in opt_sd["state"])
    return to_skeleton(opt_sd, prefix, raws), raws


def _group_rates(lr, n_groups) -> list:
    """One given learning rate per param group (None: the group's), from a number, an
    interval or a list of one per group."""
    from jaxguard.core.config import is_interval
    if lr is None or is_interval(lr) or not isinstance(lr, (list, tuple)):
        return [lr] * n_groups
    if len(lr) != n_groups:
        raise ConfigError(f"lr has {len(lr)} values for {n_groups} param groups; give one value (every group) or one "
                          "per param group")
    return [tuple(x) if isinstance(x, list) else x for x in lr]


def writer_config(spec, update):
    """`GuardConfig.from_update` (jax: imported only where a save needs it).

    Args:
      spec: the save's `GuardSpec`.
      update: the `NextUpdate`.

    Returns:
      The `GuardConfig`.
    """
    from jaxguard.core.config import GuardConfig
    return GuardConfig.from_update(spec, update)


def lazy_save_spec(spec=None, **overrides):
    """`jaxguard.core.config.save_spec`, imported when called (restore never loads JAX for it).

    Args:
      spec: the save's `GuardSpec` (None: the defaults).
      **overrides: tau, clip, codec given beside it.
    """
    from jaxguard.core.config import save_spec   # jax: only compress pays for it, not restore
    return save_spec(spec, **overrides)


def encoder_view(t, *, dlpack=None):
    """A float32 tensor as the encoder takes it (`jaxguard.writer.MomentJob`'s m, v, p),
    where it lives: the one place torch_compat hands tensors to the encoder.

    * A contiguous tensor whose data is 64-byte aligned, on a device JAX has a backend
      for (CPU; CUDA when JAX has its GPU plugin), goes into JAX through DLPack
      (`jax.dlpack.from_dlpack`): zero-copy, the JAX array aliases the tensor.
    * Otherwise (a CUDA tensor with CPU-only JAX, a strided or unaligned view, or
      ``dlpack=False``) a `HostTensor`: copied to the host only when the writer reads it
      (`numpy.asarray`), one slab of tensors at a time, never the whole state at once.

    Either way the encoder sees the same float32 bits, so the bytes written do not depend
    on the route.

    Args:
      t: a float32 tensor (detached here).
      dlpack: None: DLPack where it is zero-copy; False: host slabs.

    Returns:
      A `jax.Array` (on the tensor's device) or a `HostTensor`.
    """
    if isinstance(t, FileTensor):   # read without torch: the host view (the same bits)
        if t.dtype_name != "float32":
            raise UnsupportedOptimizerError(f"a {t.dtype} tensor reached the encoder; jaxguard certifies float32 "
                                            "moments and parameters only")
        return t.contiguous_array()
    t = t.detach()
    if dlpack is None:
        # an unaligned or strided tensor is read on the host instead, lazily, so that no
        # copy of the whole state is made up front
        from jaxguard.core.guard import ALIGN   # jax: only compress pays for it, not restore
        dlpack = jax_platform_of(t.device.type) is not None and t.is_contiguous() and t.data_ptr() % ALIGN == 0
    if not dlpack:
        return HostTensor(t)
    import jax.dlpack
    return jax.dlpack.from_dlpack(t)
