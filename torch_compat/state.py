"""torch state_dict <-> jaxguard container, and the first-update audit with real torch.

A checkpoint ("CKPT") is a dict with the model ``state_dict`` under ``"model"`` and an
Adam/AdamW optimizer ``state_dict`` under ``"optimizer"``.  Its param groups carry
``param_names`` when the optimizer was built from ``model.named_parameters()``; one
built from ``model.parameters()`` is mapped to the model's tensors only where the map is
provable (every moment's shape names one tensor), or in an order the user asserts
(`infer_param_names`).  Every other key passes through exactly (tensors as raw arrays,
numbers/strings/lists/dicts as JSON; nothing is pickled).

What each moment pair was certified for (the param group's next-step lr, betas, eps,
weight decay, the state's step, the op model, the parameter) is recorded in its entry;
`load` compares the optimizer about to step with it (`check_next_update`).
"""
from __future__ import annotations

__all__ = ["EXACT_REASON", "tensor_to_numpy", "to_skeleton", "scalar_value", "check_param_group",
           "check_optimizer_state", "implementation_of", "infer_param_names", "with_param_names",
           "param_index", "op_model_of", "next_update", "guard_config", "step_count", "MappedSource",
           "state_records", "writer_config", "encoder_view", "jax_platform_of", "HostTensor",
           "compress_checkpoint", "compress_checkpoint_to", "restore_tree", "save", "snapshot",
           "save_snapshot", "load", "check_next_update", "certified_by_group", "warn_other_kernel",
           "torch_step", "audit", "save_torch"]

import argparse
import functools
import hashlib
import math
import os
import sys
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from jaxguard import audit as jg_audit
from jaxguard.format.spec import DEFAULT_CLIP, DEFAULT_TAU
from jaxguard.format import container, reader
from jaxguard.format.torchzip import FileTensor
from jaxguard.errors import CheckpointError, ConfigError, UnsupportedOptimizerError
from jaxguard.uncovered import policy as uncovered_policy
from jaxguard.core.opmodel import resolve_op_model, torch_op_model
from torch_compat.replay import TORCH_FLAGS

if TYPE_CHECKING:
    from jaxguard.core.config import GuardSpec

class _LazyModule:
    """A module imported at its first attribute access: `jaxguard.writer` pulls in JAX
    (the guard), which compress needs and restore (numpy reader + torch) does not."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        import importlib
        return getattr(importlib.import_module(self._name), attr)


writer = _LazyModule("jaxguard.writer")   # compress only: restore never imports JAX
# `jaxguard compress` of a checkpoint read without torch (`jaxguard.format.torchzip.load`) never
# imports it: the compress path asks `is_tensor`, `dtype_name`, `torch_version`, never `torch.*`
torch = _LazyModule("torch")


def is_tensor(x) -> bool:
    """Whether `x` is a torch tensor or a `jaxguard.format.torchzip.FileTensor` (a tensor of a
    checkpoint read without torch), without importing torch to ask.

    Args:
      x: anything.

    Returns:
      A bool.
    """
    t = sys.modules.get("torch")
    return (t is not None and isinstance(x, t.Tensor)) or isinstance(x, FileTensor)


def dtype_name(t) -> str:
    """A tensor's dtype without the ``torch.`` prefix (``"float32"``, ``"bfloat16"``, ...).

    Args:
      t: a torch tensor or a `FileTensor`.

    Returns:
      The name.
    """
    return str(t.dtype).rsplit(".", 1)[-1]


def torch_version() -> str:
    """``torch.__version__``: from torch when it is imported, else as recorded beside the
    cached Adam variant of this environment (`torch_compat.variant_cache.fast_record`),
    else by importing torch.

    Returns:
      The version string.
    """
    if "torch" not in sys.modules:
        from torch_compat.variant_cache import fast_record
        rec = fast_record()
        if rec is not None:
            return rec["torch_version"]
    return torch.__version__

UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")
NO_NAMES = ("the optimizer state_dict has no 'param_names'; build the optimizer from "
            "model.named_parameters(), e.g. torch.optim.Adam(model.named_parameters(), lr=1e-3)")
BY_ORDER_FIX = ("build the optimizer from model.named_parameters(), e.g. "
                "torch.optim.Adam(model.named_parameters(), lr=1e-3), save with torch_compat.save(path, optimizer), "
                "or assert the order: jaxguard compress --param-order model (built from model.parameters()) or "
                "--param-order FILE (the names in the optimizer's order, one a line)")
# how an entry's parameter was found (its config's "param_map")
PARAM_MAPS = {"param_names": "the optimizer's param_names",
              "shapes": "each moment's shape names one tensor of the model (provable)",
              "asserted-model-order": "asserted: the optimizer was built from model.parameters() (--param-order model)",
              "asserted-names": "asserted: the names given in the optimizer's order (--param-order FILE)",
              "live": "the live optimizer's parameters (torch_compat.save)"}
EXACT_REASON = "the param group's next learning rate is 0 (nothing to certify against): moments stored exactly"


# ---------------------------------------------------------------- generic tree <-> JSON skeleton
def tensor_to_numpy(t: torch.Tensor):
    """A tensor's bits as a numpy array and the container dtype name.

    Args:
      t: any tensor (detached and copied to the CPU).

    Returns:
      ``(array, dtype name)``; bfloat16 travels as its uint16 bits with the name ``"bfloat16"``.
    """
    if isinstance(t, FileTensor):   # bfloat16 is held as its uint16 bits already
        return t.contiguous_array(), t.dtype_name
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    arr = t.numpy()
    return arr, container.numpy_dtype_name(arr)


def _writable(arr):
    """`arr` itself when torch may share it (writable: e.g. read from a container into a
    bytearray, or freshly decoded), else a copy."""
    return arr if arr.flags.writeable else np.array(arr)


def numpy_to_tensor(arr, dtype_name):
    """The inverse of `tensor_to_numpy`.

    Args:
      arr: the stored array (shared with the tensor when writable, else copied).
      dtype_name: its container dtype name (``"bfloat16"`` reinterprets uint16 bits).

    Returns:
      A CPU tensor with the same bits.
    """
    arr = _writable(np.asarray(arr))
    if dtype_name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


def _tie_key(t):
    """What makes two tensors the same stored values: one storage, offset, shape, strides
    and dtype (a tied weight under two state_dict keys); None for an empty tensor."""
    if t.numel() == 0:
        return None
    if isinstance(t, FileTensor):
        return ("file", t.key, t.offset, t.shape, t.stride, t.dtype_name)
    return (t.device.type, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()),
            t.dtype)


def to_skeleton(obj, path, raws, tied=None):
    """A checkpoint object as a JSON skeleton, its tensors appended to `raws` as raw entries.

    A tensor that is the very same view of one storage as a tensor met before (a tied
    weight, e.g. GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``) is stored once:
    its node names the first one's entry, as ``torch.save`` keeps one storage for both.

    Args:
      obj: tensors, dicts (str/int keys), lists, tuples, numbers, strings, None, numpy
        arrays and scalars, ``argparse.Namespace``.
      path: the entry-name prefix of `obj` (``"model"``, ``"optimizer/state/0"``).
      raws: the list the `container.Raw` records are appended to.
      tied: ``{tensor identity: entry name}`` shared by the calls of one checkpoint
        (None: a fresh one for `obj`).

    Returns:
      The skeleton (``{"__tensor__": name}``, ``{"__dict__": [[k, v], ...]}``, ...).

    Raises:
      CheckpointError: a key or value of a type the container cannot hold.
    """
    tied = {} if tied is None else tied
    if is_tensor(obj):
        key = _tie_key(obj)
        if key is not None and key in tied:
            return {"__tensor__": tied[key]}
        arr, dt = tensor_to_numpy(obj)
        raws.append(container.Raw(path, arr, dt))
        if key is not None:
            tied[key] = path
        return {"__tensor__": path}
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CheckpointError(f"key {k!r} under {path!r} is a {type(k).__name__}; only str and int keys can be stored")
            items.append([k, to_skeleton(v, f"{path}/{k}", raws, tied)])
        return {"__dict__": items}
    if isinstance(obj, (list, tuple)):
        tag = "__list__" if isinstance(obj, list) else "__tuple__"
        return {tag: [to_skeleton(v, f"{path}/{i}", raws, tied) for i, v in enumerate(obj)]}
    if isinstance(obj, (np.ndarray, np.generic)) and not isinstance(obj, np.str_):
        # numpy values as checkpoints hold them (best_val_loss=np.float64(...), np.random.get_state()'s
        # uint32 key): raw entries, restored with their type, shape and bits
        arr = np.ascontiguousarray(obj)
        raws.append(container.Raw(path, arr, container.numpy_dtype_name(arr)))
        return {"__ndarray__" if isinstance(obj, np.ndarray) else "__npscalar__": path}
    if isinstance(obj, argparse.Namespace):   # a run's arguments
        return {"__namespace__": to_skeleton(vars(obj), path, raws, tied)["__dict__"]}
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(obj)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise CheckpointError(f"{path!r} holds a {type(obj).__name__}; jaxguard stores tensors, numbers, strings, "
                          "lists, tuples, dicts, numpy arrays and scalars and argparse.Namespace (convert it, or keep "
                          "it outside the checkpoint)")


def from_skeleton(sk, arrays, dtypes):
    """Rebuild the object of a `to_skeleton` skeleton.

    Args:
      sk: the skeleton (from the container's meta).
      arrays: {entry name: array or (m~, v~)} (`container.entries_by_name`).
      dtypes: {entry name: dtype name}.

    Returns:
      The object, tensors as CPU tensors.

    Raises:
      CheckpointError: the skeleton names an entry the container does not hold.
    """
    if isinstance(sk, dict):
        reader.skeleton_ref(sk, arrays)
        if "__tensor__" in sk:   # an entry named twice (a tied weight) restores from one array
            return numpy_to_tensor(arrays[sk["__tensor__"]], dtypes[sk["__tensor__"]])
        if "__moment__" in sk:
            m, v = arrays[sk["__moment__"]]
            return torch.from_numpy(_writable(m if sk["which"] == "m" else v))
        if "__dict__" in sk:
            return {k: from_skeleton(v, arrays, dtypes) for k, v in sk["__dict__"]}
        if "__list__" in sk:
            return [from_skeleton(v, arrays, dtypes) for v in sk["__list__"]]
        if "__tuple__" in sk:
            return tuple(from_skeleton(v, arrays, dtypes) for v in sk["__tuple__"])
        if "__float__" in sk:
            return float(sk["__float__"])
        if "__ndarray__" in sk or "__npscalar__" in sk:
            name = sk.get("__ndarray__", sk.get("__npscalar__"))
            arr = np.array(arrays[name])
            if dtypes[name] == "bfloat16":
                import ml_dtypes
                arr = arr.view(ml_dtypes.bfloat16)
            return arr if "__ndarray__" in sk else arr.reshape(())[()]
        if "__namespace__" in sk:
            return argparse.Namespace(**{k: from_skeleton(v, arrays, dtypes) for k, v in sk["__namespace__"]})
    return sk


# ---------------------------------------------------------------- validation
def scalar_value(x, what):
    """A hyperparameter or step held as a Python number or a one-element tensor, as a number.

    Args:
      x: the value (``group["lr"]``, a beta, ``state["step"]``).
      what: its name, for the error.

    Returns:
      ``x.item()`` for a tensor, else `x`.

    Raises:
      CheckpointError: a tensor of more than one element.
    """
    if is_tensor(x):
        if x.numel() != 1:
            raise CheckpointError(f"{what} is a tensor of {x.numel()} elements; expected a scalar")
        return x.item()
    return x


class Uncovered(NamedTuple):
    """State the guard cannot certify (`jaxguard.uncovered`): why, in a few words (the
    integrations' warning, the file's ``stored_exactly``), and the one-line error the
    explicit API raises instead."""

    why: str
    error: Exception


def group_uncovered(gi, g, *, who="jaxguard") -> Uncovered | None:
    """Why param group `g` is outside the op models, or None.

    Args:
      gi: the group's index, for the error.
      g: the param group (a dict of an optimizer state_dict's ``param_groups``).
      who: what refuses it, for the error (``"jaxguard"``, ``"GuardedSavePlanner"``).

    Returns:
      An `Uncovered` (not Adam/AdamW, one of `UNSUPPORTED_FLAGS` set, fused and foreach both
      set), or None.
    """
    if "betas" not in g or "eps" not in g:
        return Uncovered("parameters of an optimizer that is not Adam or AdamW", UnsupportedOptimizerError(
            f"param group {gi} has no 'betas'/'eps': the optimizer is not Adam or AdamW; {who} compresses "
            "torch.optim.Adam and AdamW state only"))
    for flag in UNSUPPORTED_FLAGS:
        if g.get(flag):
            return Uncovered(f"parameters with {flag}={g[flag]!r} (outside the op models)", UnsupportedOptimizerError(
                f"param group {gi} has {flag}={g[flag]!r}; the guarantee covers {flag}=False only (rebuild the "
                f"optimizer with {flag}=False)"))
    try:
        implementation_of(g, gi)
    except UnsupportedOptimizerError as exc:
        return Uncovered("parameters with fused=True and foreach=True", exc)
    return None


def check_param_group(gi, g, *, who="jaxguard") -> None:
    """Check that one param group is Adam/AdamW without the flags the guarantee excludes.

    Args:
      gi: the group's index, for the error.
      g: the param group (a dict of an optimizer state_dict's ``param_groups``).
      who: what refuses it, for the error (``"jaxguard"``, ``"GuardedSavePlanner"``).

    Raises:
      UnsupportedOptimizerError: no ``betas``/``eps`` (not Adam), or one of
        `UNSUPPORTED_FLAGS` (amsgrad, maximize, ...) set (`group_uncovered`).
    """
    u = group_uncovered(gi, g, who=who)
    if u is not None:
        raise u.error


def state_uncovered(idx, st, gi, g) -> Uncovered | None:
    """Why one parameter's optimizer state cannot be certified, or None.

    Args:
      idx: its key in the state_dict's ``state``.
      st: the state (``exp_avg``, ``exp_avg_sq``, ``step``).
      gi, g: its param group and the group's index (None when no group lists it).

    Returns:
      An `Uncovered` (no Adam moments, a kernel no op model covers on the state's device,
      moments that are not float32), or None.
    """
    for key in ("exp_avg", "exp_avg_sq", "step"):
        if not isinstance(st, dict) or key not in st:
            return Uncovered("states without Adam moments", CheckpointError(
                f"optimizer state of parameter {idx} has no {key!r}; is this an Adam/AdamW state_dict?"))
    if g is not None and is_tensor(st["exp_avg"]) and st["exp_avg"].device.type != "cpu":
        try:
            op_model_of(g, st["exp_avg"].device.type, gi=gi)    # a kernel no op model covers: one line
        except UnsupportedOptimizerError as exc:
            impl = implementation_of(g, gi)
            has = f"has {impl}=True" if impl != "single" else "runs the single-tensor kernel"
            return Uncovered(f"states on {st['exp_avg'].device.type} whose kernel no op model covers",
                             UnsupportedOptimizerError(f"param group {gi} {has} with its state on "
                                                       f"{st['exp_avg'].device}: {str(exc).split(': ', 1)[-1]}"))
    for key in ("exp_avg", "exp_avg_sq"):
        if dtype_name(st[key]) != "float32":
            return Uncovered(f"{dtype_name(st[key])} moments (the guarantee covers float32)", UnsupportedOptimizerError(
                f"optimizer state {idx}.{key} is {st[key].dtype}; jaxguard certifies float32 moments only (keep "
                "Adam state in float32)"))
    return None


def param_uncovered(name, p) -> Uncovered | None:
    """Why parameter `p` cannot be the ``p`` of a certificate, or None.

    Args:
      name: its name, for the error.
      p: the parameter tensor.

    Returns:
      An `Uncovered` when it is not float32, else None.
    """
    if dtype_name(p) != "float32":
        return Uncovered(f"{dtype_name(p)} parameters (the guarantee covers float32)", UnsupportedOptimizerError(
            f"parameter {name!r} is {p.dtype}; the guarantee covers float32 parameters"))
    return None


def check_optimizer_state(opt_sd, model_sd=None, param_order=None, *, uncovered: dict | None = None) -> None:
    """Check that `opt_sd` is a torch Adam/AdamW state_dict jaxguard can certify.

    Args:
      opt_sd: ``optimizer.state_dict()``, with ``param_names`` in its groups (an optimizer
        built from ``model.named_parameters()``, torch >= 2.6) or without (then
        `model_sd` is needed and must map by order, `infer_param_names`).
      model_sd: the model ``state_dict`` the optimizer belongs to, optional.
      param_order: an asserted parameter order (`infer_param_names`).
      uncovered: a dict that receives ``{state index: Uncovered}`` for each parameter
        whose group or state the guard cannot certify, instead of raising
        (``uncertifiable="exact"``: `state_records`).

    Raises:
      CheckpointError: not an optimizer state_dict, no ``param_names`` and no provable
        map, a state without ``exp_avg``/``exp_avg_sq``/``step``.
      UnsupportedOptimizerError: not Adam/AdamW, an unsupported flag, foreach/fused state
        off the CPU, moments that are not float32.
    """
    if not isinstance(opt_sd, dict) or "state" not in opt_sd or "param_groups" not in opt_sd:
        raise CheckpointError("'optimizer' is not an optimizer state_dict (needs 'state' and 'param_groups'); "
                              "save optimizer.state_dict() under 'optimizer'")
    bad_groups = {}
    for gi, g in enumerate(opt_sd["param_groups"]):
        u = group_uncovered(gi, g)
        if u is not None:
            if uncovered is None:
                raise u.error
            bad_groups[gi] = u
        if "param_names" in g and len(g["param_names"]) != len(g["params"]):
            raise CheckpointError(f"param group {gi} has {len(g['param_names'])} param_names for {len(g['params'])} params")
    if param_order is not None or not all("param_names" in g for g in opt_sd["param_groups"]):
        if model_sd is None:
            raise CheckpointError(NO_NAMES)
        infer_param_names(opt_sd, model_sd, param_order)
    groups = {idx: (gi, g) for gi, g in enumerate(opt_sd["param_groups"]) for idx in g.get("params", ())}
    for idx, st in opt_sd["state"].items():
        gi, g = groups.get(idx, (None, None))
        u = bad_groups.get(gi) or state_uncovered(idx, st, gi, g)
        if u is not None:
            if uncovered is None:
                raise u.error
            uncovered[idx] = u


def implementation_of(group, gi=0) -> str:
    """torch's Adam implementation recorded in a param group: "fused" (``fused=True``),
    "foreach" (``foreach=True``) or "single" (both False or None: on CPU tensors torch's
    ``_default_to_fused_or_foreach`` picks the single-tensor path, foreach being a
    CUDA/XPU default only).

    Args:
      group: a param group dict.
      gi: its index, for the error.

    Returns:
      ``"fused"``, ``"foreach"`` or ``"single"``.

    Raises:
      UnsupportedOptimizerError: both fused and foreach set.
    """
    fused, foreach = group.get("fused"), group.get("foreach")
    if fused and foreach:
        raise UnsupportedOptimizerError(f"param group {gi} has fused=True and foreach=True, which torch rejects; "
                                        "save the state_dict of a working optimizer")
    return "fused" if fused else "foreach" if foreach else "single"


def infer_param_names(opt_sd, model_sd, param_order=None) -> list:
    """The parameter names of an optimizer state_dict whose groups have no ``param_names``
    (built from ``model.parameters()``), or whose ``param_names`` the user overrides.

    Without `param_order` the map is taken only when it is provable: every parameter with
    Adam state has an ``exp_avg`` whose shape is that of exactly one floating-point tensor
    of the model state_dict, a different one for each (a tied weight, one storage under
    two names such as nanoGPT's ``wte``/``lm_head``, counts once, by its first name).  Two
    same-shaped tensors (q/k/v projections, the layers of a stack) leave the map unproven:
    torch numbers the optimizer's parameters in the order it was given them, and param
    groups (weight decay on some) reorder them, so the order says nothing; it is refused
    in one line naming the fix.

    Args:
      opt_sd: the optimizer state_dict.
      model_sd: the model state_dict ({name: tensor}).
      param_order: an assertion the user makes instead of a proof: ``"model"`` (the
        optimizer was built from ``model.parameters()``: its i-th parameter is the model's
        i-th floating-point tensor, tied weights once; the count and every shape must
        agree) or a list of names in the optimizer's parameter order (groups in order).

    Returns:
      One list of names per param group (parallel to its ``params``).

    Raises:
      CheckpointError: no provable map and no assertion, or an assertion that the counts
        or shapes contradict (one line, naming the fix).
    """
    groups = opt_sd["param_groups"]
    if not isinstance(model_sd, dict):
        raise CheckpointError(f"the model state_dict is a {type(model_sd).__name__}; save model.state_dict() under 'model'")
    if param_order is None and any("param_names" in g for g in groups):
        raise CheckpointError("some param groups have 'param_names' and some do not; " + BY_ORDER_FIX)
    indices = [idx for g in groups for idx in g["params"]]
    floats = _parameter_candidates(model_sd)
    shape_of = {idx: tuple(st["exp_avg"].shape) for idx, st in opt_sd["state"].items()
                if isinstance(st, dict) and is_tensor(st.get("exp_avg"))}
    if param_order is None:
        names = _by_shape(indices, shape_of, floats, model_sd)
    elif isinstance(param_order, str) and param_order == "model":
        if len(floats) != len(indices):
            raise CheckpointError(f"--param-order model: the optimizer has {len(indices)} parameters, but the model "
                                  f"state_dict has {len(floats)} floating-point tensors (tied weights counted once; "
                                  "buffers or frozen weights make the count differ), so that order cannot be it; "
                                  "pass --param-order FILE with the names, or build the optimizer from "
                                  "model.named_parameters()")
        names = dict(zip(indices, floats))
    else:
        order = [str(n) for n in param_order]
        if len(order) != len(indices):
            raise CheckpointError(f"--param-order lists {len(order)} names for the optimizer's {len(indices)} "
                                  "parameters; list one name per parameter, in the optimizer's order")
        missing = [n for n in order if n not in model_sd]
        if missing or len(set(order)) != len(order):
            what = f"{missing[0]!r} is not in the model state_dict" if missing else "a name appears twice"
            raise CheckpointError(f"--param-order: {what}; list the model's parameter names in the optimizer's order")
        names = dict(zip(indices, order))
    for idx, shape in shape_of.items():
        if idx in names and tuple(model_sd[names[idx]].shape) != shape:
            raise CheckpointError(f"the optimizer's parameter {idx} would be {names[idx]!r} of shape "
                                  f"{tuple(model_sd[names[idx]].shape)}, but its state has shape {shape}; "
                                  + BY_ORDER_FIX)
    return [[names[idx] for idx in g["params"]] for g in groups]


def _parameter_candidates(model_sd) -> list:
    """The model's floating-point tensors in state_dict order, a tied weight (one storage,
    offset, shape and strides under two names) once, by its first name: what
    ``model.parameters()`` yields when every floating tensor is a parameter."""
    out, seen = [], set()
    for k, t in model_sd.items():
        if not (is_tensor(t) and t.is_floating_point()):
            continue
        key = _tie_key(t)
        if key is not None and key in seen:
            continue
        seen.add(key)
        out.append(k)
    return out


def _by_shape(indices, shape_of, floats, model_sd) -> dict:
    """{optimizer index: name} where every stateful parameter's shape names one candidate."""
    by_shape: dict = {}
    for k in floats:
        by_shape.setdefault(tuple(model_sd[k].shape), []).append(k)
    names, taken = {}, {}
    for idx in indices:
        if idx not in shape_of:
            continue
        hits = by_shape.get(shape_of[idx], [])
        if not hits:
            raise CheckpointError(f"the optimizer has no 'param_names' and no floating-point tensor of the model has "
                                  f"the shape {shape_of[idx]} of parameter {idx}'s state; the model and optimizer do "
                                  "not match, or " + BY_ORDER_FIX)
        if len(hits) > 1 or hits[0] in taken:
            what = f"{len(hits)} tensors of the model" if len(hits) > 1 else f"parameters {taken[hits[0]]} and {idx}"
            raise CheckpointError(f"the optimizer has no 'param_names' and {what} have the shape {shape_of[idx]}, so "
                                  f"which tensor parameter {idx}'s state belongs to cannot be proven (param groups "
                                  "reorder parameters); " + BY_ORDER_FIX)
        names[idx], taken[hits[0]] = hits[0], idx
    for idx in indices:
        names.setdefault(idx, f"unused.{idx}")    # no state: never certified
    return names


def stale_names_error(opt_sd, model_sd):
    """A one-line `CheckpointError` when the groups' ``param_names`` name tensors the
    model state_dict lacks, else None: torch's ``load_state_dict`` keeps the names of the
    run that saved the state, so after a module rename they are stale.

    Args:
      opt_sd, model_sd: the optimizer and model state_dicts.

    Returns:
      The error to raise, or None.
    """
    named = [n for g in opt_sd["param_groups"] for n in (g.get("param_names") or ())]
    missing = [n for n in named if n not in model_sd]
    if not missing or not isinstance(model_sd, dict):
        return None
    return CheckpointError(f"the optimizer's param_names name {len(missing)} parameters the model state_dict does not "
                           f"have (first {missing[0]!r}): names torch's load_state_dict kept from an earlier run, stale "
                           "after a module rename; pass --param-order model (CLI) or param_order='model' to map by "
                           "the order you assert, or save the model's state_dict under 'model' with the names the "
                           "optimizer has")


def with_param_names(opt_sd, model_sd, param_order=None):
    """`opt_sd` itself when every group has ``param_names`` (and no `param_order` is
    asserted), else a copy whose groups carry the names `infer_param_names` maps them to
    (state tensors shared, not copied).

    Args:
      opt_sd: an optimizer state_dict.
      model_sd: the model state_dict it belongs to.
      param_order: as `infer_param_names`.

    Returns:
      An optimizer state_dict with ``param_names`` in every group.

    Raises:
      CheckpointError: as `infer_param_names`.
    """
    if param_order is None and all("param_names" in g for g in opt_sd["param_groups"]):
        return opt_sd
    names = infer_param_names(opt_sd, model_sd, param_order)
    return {**opt_sd, "param_groups": [{**g, "param_names": list(n)} for g, n in zip(opt_sd["param_groups"], names)]}


def param_map_of(opt_sd, param_order=None) -> str:
    """How `param_index` finds an optimizer's parameters (a key of `PARAM_MAPS`).

    Args:
      opt_sd: the optimizer state_dict.
      param_order: as `infer_param_names`.

    Returns:
      ``"param_names"``, ``"shapes"``, ``"asserted-model-order"`` or ``"asserted-names"``.
    """
    if param_order is not None:
        return "asserted-model-order" if isinstance(param_order, str) else "asserted-names"
    return "param_names" if all("param_names" in g for g in opt_sd["param_groups"]) else "shapes"


def param_index(opt_sd, model_sd=None, param_order=None):
    """The name and group of every parameter of an optimizer state_dict.

    Args:
      opt_sd: an optimizer state_dict, with ``param_names`` in its groups or without
        (then mapped to `model_sd` where provable, `infer_param_names`).
      model_sd: the model state_dict, needed without ``param_names`` (and to see stale ones).
      param_order: an asserted order instead (`infer_param_names`).

    Returns:
      {state index: (name, group dict)}.

    Raises:
      CheckpointError: no ``param_names`` and no provable map; stale ``param_names``.
    """
    groups = opt_sd["param_groups"]
    if param_order is None and all("param_names" in g for g in groups):
        stale = stale_names_error(opt_sd, model_sd) if model_sd is not None else None
        if stale is not None:
            raise stale
        names = [g["param_names"] for g in groups]
    elif model_sd is None:
        raise CheckpointError(NO_NAMES)
    else:
        names = infer_param_names(opt_sd, model_sd, param_order)
    out = {}
    for g, gnames in zip(groups, names):
        for name, idx in zip(gnames, g["params"]):
            out[idx] = (name, g)
    return out


def op_model_of(group, device_type="cpu", op_model=None, gi=0) -> str:
    """The op model of the kernel a param group runs on `device_type`, resolved as torch
    resolves it (`jaxguard.core.opmodel.resolve_op_model`; foreach=None on CUDA is
    foreach), or the one the user names (`op_model`, the kernel the run resumes on).

    Args:
      group: the param group dict.
      device_type: where its state lives (``tensor.device.type``).
      op_model: the named op model, or None.
      gi: the group's index, for the error.

    Returns:
      An op model name (on CPU without `op_model`: exactly `implementation_of`'s model).

    Raises:
      UnsupportedOptimizerError: (one line) no op model covers the group's kernel.
    """
    decoupled = bool(group.get("decoupled_weight_decay", False))
    if device_type == "cpu" and op_model is None:
        return torch_op_model(decoupled=decoupled, implementation=implementation_of(group, gi))
    try:
        return resolve_op_model(device_type, foreach=group.get("foreach"), fused=group.get("fused"),
                                capturable=bool(group.get("capturable", False)), decoupled=decoupled,
                                torch_version=torch_version(),
                                differentiable=bool(group.get("differentiable", False)),
                                lr_is_tensor=is_tensor(group.get("lr")), op_model=op_model)
    except ConfigError as exc:
        raise UnsupportedOptimizerError(f"param group {gi}: {exc}") from None


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


def state_records(opt_sd, params: dict, *, spec=None, prefix="optimizer", op_model=None, param_order=None, lr=None,
                  notes: dict | None = None, param_map: str | None = None, uncertifiable: str = "refuse"):
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
      prefix: the entry-name prefix (``"optimizer"``).
      op_model: the kernel the run resumes on (`op_model_of`; None: the one torch runs
        where the state lives, e.g. foreach for CUDA state saved with foreach=None).
      param_order: an asserted parameter order (`infer_param_names`).
      lr: the next step's learning rate instead of the groups' (`next_update`): a number
        or ``(lo, hi)`` for every group, or a list with one per param group.
      notes: a dict that receives ``stored_exactly`` (a list of ``{"param", "why"}``)
        for the container's meta, when some moments are.
      param_map: how `params` was matched (a key of `PARAM_MAPS`; default from `opt_sd`).
      uncertifiable: ``"refuse"`` (raise on state the guard cannot certify) or ``"exact"``
        (store it exactly and say so in `notes`: `jaxguard.uncovered`; an optimizer that
        is not Adam at all is stored whole).

    Returns:
      ``(optimizer skeleton, list of records)``.

    Raises:
      CheckpointError: parameters missing from `params` or of other shapes, bad steps,
        not an optimizer state_dict (`check_optimizer_state`), no provable map of
        unnamed parameters, stale ``param_names``.
      UnsupportedOptimizerError: not float32, not Adam/AdamW, an unsupported flag.
      ConfigError: a bad `lr`.
    """
    spec = _save_spec(spec)
    exact_ok = uncovered_policy(uncertifiable) == "exact"
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
                                     source=(m, v, p)))
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


def _save_spec(spec=None, **overrides):
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


def jax_platform_of(device_type: str):
    """The JAX platform that takes tensors of torch `device_type` through DLPack, or None.

    Args:
      device_type: ``tensor.device.type`` (``"cpu"``, ``"cuda"``, ...).

    Returns:
      ``"cpu"`` for CPU tensors, ``"gpu"`` for CUDA ones when JAX has a GPU backend
      (its CUDA or ROCm plugin), else None (the tensor is read on the host).
    """
    if device_type == "cpu":
        return "cpu"
    if device_type != "cuda":
        return None
    import jax
    try:
        return "gpu" if jax.devices("gpu") else None
    except RuntimeError:   # JAX without a GPU backend
        return None


class HostTensor:
    """A tensor the encoder reads on the host: ``numpy.asarray`` copies it there (the
    writer does so one slab of tensors at a time); shape, dtype and size need no copy.

    Args:
      t: the (detached) float32 tensor, on any device.
    """

    def __init__(self, t):
        if t.dtype != torch.float32:
            raise UnsupportedOptimizerError(f"a {t.dtype} tensor reached the encoder; jaxguard certifies float32 "
                                            "moments and parameters only")
        self.tensor = t
        self.shape = tuple(t.shape)
        self.ndim = t.dim()
        self.size = t.numel()
        self.dtype = np.dtype(np.float32)

    def __array__(self, dtype=None, copy=None):
        arr = self.tensor.cpu().contiguous().numpy()
        return arr if dtype is None else arr.astype(dtype, copy=False)


def _checkpoint_records(ckpt, *, spec, op_model=None, param_order=None, lr=None, uncertifiable="refuse"):
    """(records, meta, extra header) of a CKPT dict; the header's guard fields come from
    the first moments entry (`jaxguard.writer`)."""
    if not isinstance(ckpt, dict):
        raise CheckpointError(f"the checkpoint is a {type(ckpt).__name__}; expected a dict with 'model' and 'optimizer' keys")
    for key in ("model", "optimizer"):
        if key not in ckpt:
            raise CheckpointError(f"the checkpoint has no {key!r} key (keys: {', '.join(map(str, ckpt))}); save "
                                  "{'model': model.state_dict(), 'optimizer': optimizer.state_dict()}")
    notes: dict = {}
    opt_sk, records = state_records(ckpt["optimizer"], ckpt["model"], spec=spec, op_model=op_model,
                                    param_order=param_order, lr=lr, notes=notes, uncertifiable=uncertifiable)
    top = []
    tied: dict = {}     # one table for the whole checkpoint: a tie may cross top-level keys
    for k, v in ckpt.items():
        top.append([k, opt_sk if k == "optimizer" else to_skeleton(v, str(k), records, tied)])
    meta = {"framework": "torch", "tree": {"__dict__": top}, "torch_version": torch_version(), **notes}
    extra = {"tau": spec.tau, "clip": spec.clip, "codec": spec.codec, "bound": spec.bound, "partition": spec.partition}
    return records, meta, extra


def _variant_of(variant):
    return variant() if callable(variant) else variant


def compress_checkpoint(ckpt, *, spec=None, tau=None, clip=None, codec=None, bound=None, partition=None, progress=False, variant=None,
                        op_model=None, device_encode=None, param_order=None, lr=None):
    """Compress a torch checkpoint dict in memory.

    Args:
      ckpt: ``{"model": state_dict, "optimizer": state_dict, ...}`` (other keys stored exactly).
      spec: the guard settings, a `jaxguard.GuardSpec` (default ``GuardSpec()``: tau 0.01,
        clip 0.2, log8-rel, shared bound, mixed partition).
      tau, clip, codec, bound, partition: override the spec's field when given.
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
    spec = _save_spec(spec, tau=tau, clip=clip, codec=codec, bound=bound, partition=partition)
    records, meta, extra = _checkpoint_records(ckpt, spec=spec, op_model=op_model, param_order=param_order, lr=lr)
    extra["variant"] = variant = _variant_of(variant)
    data, summary = writer.to_bytes(records, meta, extra_header=extra, progress=progress, device_encode=device_encode)
    return data, _with_variant(summary, variant)


def compress_checkpoint_to(path, ckpt, *, spec=None, tau=None, clip=None, codec=None, bound=None, partition=None, progress=False,
                           variant=None, release=None, op_model=None, device_encode=None, param_order=None, lr=None,
                           uncertifiable="refuse"):
    """`compress_checkpoint` written straight to `path` (atomically), streaming: moments
    are encoded in slabs and each entry is written as soon as it is ready, so memory holds
    the checkpoint plus one slab of work, never the container.

    Args:
      path: the output file or URL.
      ckpt, spec, tau, clip, codec, bound, partition, progress, variant, op_model, device_encode,
        param_order, lr: as `compress_checkpoint`.
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
    spec = _save_spec(spec, tau=tau, clip=clip, codec=codec, bound=bound, partition=partition)
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
         tau: float | None = None,
         clip: float | None = None, codec: str | None = None, bound: str | None = None, partition: str | None = None,
         progress: bool = False, op_model: str | None = None, device_encode: bool | None = None,
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
        clip 0.2, log8-rel, shared bound, mixed partition).
      tau, clip, codec, bound, partition: override the spec's field when given.
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
    return save_snapshot(path, sd, params, spec=spec, tau=tau, clip=clip, codec=codec, bound=bound,
                         partition=partition, progress=progress, op_model=op_model, device_encode=device_encode,
                         lr=lr, uncertifiable=uncertifiable)


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
                  bound: str | None = None, partition: str | None = None, progress: bool = False,
                  op_model: str | None = None, device_encode: bool | None = None,
                  lr: float | tuple | list | None = None, uncertifiable: str = "refuse") -> dict:
    """`save` of a `snapshot` (the same file `save` writes of that state).

    Args:
      path: the output file.
      sd, params: what `snapshot` returned.
      spec, tau, clip, codec, bound, partition, progress, op_model, device_encode, lr,
        uncertifiable: as `save`.

    Returns:
      The summary dict (``stored_exactly``: as `save`).

    Raises:
      UnsupportedOptimizerError, CheckpointError: as `save`.
    """
    spec = _save_spec(spec, tau=tau, clip=clip, codec=codec, bound=bound, partition=partition)
    notes: dict = {}
    opt_sk, records = state_records(sd, params, spec=spec, op_model=op_model, lr=lr, notes=notes, param_map="live",
                                    uncertifiable=uncertifiable)
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


HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def _group_values(group) -> tuple:
    """A param group's hyperparameters as comparable numbers."""
    return (float(scalar_value(group["lr"], "lr")),   # (a group that is not Adam, stored exactly: no betas, eps)
            tuple(float(scalar_value(b, "beta")) for b in group.get("betas", ())),
            float(group.get("eps", 0.0)), float(group.get("weight_decay", 0.0) or 0.0))


def next_update_differences(header, sd, groups, *, prefix="optimizer") -> list:
    """Where param groups `groups` (parallel to `sd`'s) would step otherwise than the
    moment pairs of `header` were certified for.

    Args:
      header: the container header.
      sd: the optimizer state_dict restored from it (its groups list the state indices).
      groups: the param groups about to step (dicts with lr, betas, eps, weight_decay).
      prefix: the entry-name prefix of the optimizer's state.

    Returns:
      ``[(group index, name, certified value, value it will step with)]``, one per group
      and hyperparameter that differs (an lr outside a certified interval differs).
    """
    from jaxguard.core.config import lr_bounds
    configs = {e.get("name"): e.get("config") or {} for e in header.get("entries", []) if e.get("kind") == "moments"}
    out = []
    for gi, (g, live) in enumerate(zip(sd["param_groups"], groups)):
        cfg = next((configs[f"{prefix}/state/{idx}"] for idx in g.get("params", ())
                    if f"{prefix}/state/{idx}" in configs), None)
        if not cfg or cfg.get("certify") is False:
            continue
        lr, betas, eps, wd = _group_values(live)
        lo, hi = lr_bounds(tuple(cfg["lr"]) if isinstance(cfg["lr"], list) else cfg["lr"])
        if not lo * (1 - 1e-6) <= lr <= hi * (1 + 1e-6):
            out.append((gi, "lr", cfg["lr"], lr))
        for name, want, got in (("betas", tuple(cfg["betas"]), betas), ("eps", cfg["eps"], eps),
                                ("weight_decay", cfg.get("weight_decay", 0.0), wd)):
            if want != got:
                out.append((gi, name, want, got))
    return out


def check_next_update(header, sd, groups, where="the checkpoint", *, strict=False, prefix="optimizer") -> None:
    """Warn (one `JaxguardWarning` line) or, with `strict`, raise when param groups
    `groups` would step with other hyperparameters than the moments of `header` were
    certified for (`next_update_differences`): the tau guarantee covers the certified
    update only.

    Args:
      header, sd, groups, prefix: as `next_update_differences`.
      where: how to name the checkpoint.
      strict: raise instead of warning.

    Raises:
      CheckpointError: (``strict``) the first difference, naming both values.
    """
    diffs = next_update_differences(header, sd, groups, prefix=prefix)
    if not diffs:
        return
    gi, name, want, got = diffs[0]
    fix = "compress again with --lr" if name == "lr" else "save again with the optimizer as it will step"
    msg = (f"{where}: param group {gi} will step with {name}={got!r} but its moments were certified for "
           f"{name}={want!r}: the tau guarantee covers the certified update only; set it back, or {fix}")
    if strict:
        raise CheckpointError(msg)
    import warnings
    from jaxguard.errors import JaxguardWarning
    warnings.warn(msg, JaxguardWarning, stacklevel=3)


def watch_first_step(header, sd, optimizer, where="the checkpoint", *, strict=False) -> None:
    """At `optimizer`'s first step after a load, compare its param groups with the
    certified updates again (`check_next_update`) if they changed since the load (a
    learning rate set by hand or by a scheduler); the hook is inert after that step.

    Args:
      header, sd: the container header and the state_dict loaded from it.
      optimizer: the optimizer it was loaded into.
      where: how to name the checkpoint.
      strict: raise (the step does not happen) instead of warning.
    """
    loaded = [_group_values(g) for g in optimizer.param_groups]
    done = []

    def hook(opt, args, kwargs):
        if done:
            return
        done.append(True)
        if [_group_values(g) for g in opt.param_groups] != loaded:
            check_next_update(header, sd, opt.param_groups, where, strict=strict)

    optimizer.register_step_pre_hook(hook)


def certified_by_group(header, sd, prefix="optimizer") -> list:
    """The op models that certified each param group's moments in a container.

    Args:
      header: the container header (`restore_tree`).
      sd: the optimizer state_dict restored from it.
      prefix: the entry-name prefix of the optimizer's state (``"optimizer"``).

    Returns:
      One sorted list of op model names per param group of `sd` (empty for a group
      without saved state).
    """
    models = {e.get("name"): (e.get("config") or {}).get("op_model") for e in header.get("entries", [])}
    return [sorted({models[f"{prefix}/state/{idx}"] for idx in g.get("params", ())
                    if models.get(f"{prefix}/state/{idx}")}) for g in sd["param_groups"]]


def warn_other_kernel(certified, optimizer, where="the checkpoint") -> None:
    """Warn (one line, `jaxguard.errors.JaxguardWarning`) when a param group of `optimizer`
    will run another kernel than the op model that certified its state: its parameters'
    device and its foreach/fused/capturable flags resolve (`op_model_of`) to another op
    model, or to none.  The first such group is named.

    Args:
      certified: per param group, the op models that certified it (`certified_by_group`).
      optimizer: the optimizer after ``load_state_dict`` (its groups carry the saved flags
        and the live parameters).
      where: how to name the checkpoint.
    """
    import warnings
    from jaxguard.errors import JaxguardWarning
    for gi, (models, group) in enumerate(zip(certified, optimizer.param_groups)):
        devices = sorted({p.device.type for p in group["params"]})
        for dev in devices:
            try:
                runs = op_model_of(group, dev, gi=gi)
            except UnsupportedOptimizerError:
                runs = None
            if models and (runs is None or any(m != runs for m in models)):
                flags = f"foreach={group.get('foreach')}, fused={group.get('fused')}" + \
                    (", capturable=True" if group.get("capturable") else "")
                what = f"whose update is {runs}" if runs else "which no op model covers"
                fix = f", or save the original state again with op_model={runs!r}" if runs else ""
                warnings.warn(f"{where} was certified for {', '.join(models)} but param group {gi} resumes on {dev} "
                              f"({flags}), {what}: the tau guarantee holds for {models[0]} only; resume on that "
                              f"kernel{fix}", JaxguardWarning, stacklevel=3)
                return


def param_digest(p: torch.Tensor) -> str:
    """The SHA-256 of a parameter's values: the weights a moment pair was certified
    against, recorded in its entry's config (``param_sha256``).

    Args:
      p: the parameter (any device; its bytes as stored are hashed on the host).
    Returns:
      The hex digest.
    """
    if isinstance(p, FileTensor):
        return hashlib.sha256(p.contiguous_array().reshape(-1).view(np.uint8)).hexdigest()
    t = p.detach().reshape(-1).contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy() if t.numel() else b"").hexdigest()


def check_certified_weights(header, optimizer, where="the checkpoint", *, on_mismatch="warn") -> None:
    """Compare `optimizer`'s live parameters with the weights each moment pair in `header`
    was certified against (``param_sha256``; containers written before it have none and
    are not checked).

    A framework that writes the model's weights and the optimizer's state as separate
    files in place (the HF Trainer, accelerate) leaves, after a kill between the two, a
    directory whose weights are the new save's and whose optimizer state is the previous
    one's; the guarantee (and the resume) was stated for the previous weights.

    Args:
      header: the container header (`restore_tree`).
      optimizer: the optimizer about to take the state (its params hold the weights the
        run resumes from: load the model first).
      where: how to name the checkpoint.
      on_mismatch: ``"warn"`` (one `JaxguardWarning` line), ``"raise"`` (one
        `CheckpointError` line) or ``"off"``.
    Raises:
      CheckpointError: ``on_mismatch="raise"`` and a parameter differs.
      ConfigError: `on_mismatch` is not one of the three.
    """
    if on_mismatch not in ("warn", "raise", "off"):
        raise ConfigError(f"check_weights={on_mismatch!r} is not 'warn', 'raise' or 'off'")
    if on_mismatch == "off":
        return
    want = {e["name"]: (e.get("config") or {}) for e in header.get("entries", []) if e.get("config")}
    sd_groups = optimizer.state_dict()["param_groups"]
    for g, live in zip(sd_groups, optimizer.param_groups):
        for idx, p in zip(g["params"], live["params"]):
            cfg = want.get(f"optimizer/state/{idx}")
            if not cfg or not cfg.get("param_sha256") or p.device.type == "meta" \
                    or param_digest(p) == cfg["param_sha256"]:   # a meta parameter has no values yet
                continue
            msg = (f"{where}: the Adam state of parameter {cfg.get('param') or idx!r} was certified against other "
                   "weights than the model's (SHA-256 differs): the model was not loaded first, or the directory "
                   "mixes two saves (weights rewritten in place by a save that was interrupted before the optimizer "
                   "file); load the matching weights, or resume from an earlier checkpoint")
            if on_mismatch == "raise":
                raise CheckpointError(msg)
            import warnings
            from jaxguard.errors import JaxguardWarning
            warnings.warn(msg, JaxguardWarning, stacklevel=3)
            return


def check_layout(sd, optimizer, where="the state", *, match="names") -> None:
    """Check that optimizer state_dict `sd` fits `optimizer`'s parameters (see `load`).

    Args:
      sd: a saved optimizer state_dict.
      optimizer: the live optimizer it is to be loaded into.
      where: what `sd` came from, for the error.
      match: ``"names"`` or ``"position"`` (names not compared: `load`).

    Raises:
      CheckpointError: the first difference (groups, parameter counts, names, shapes,
        dtypes), in one line.
    """
    live_groups = optimizer.param_groups
    names_live = optimizer.state_dict()["param_groups"]
    if len(live_groups) != len(sd["param_groups"]):
        raise CheckpointError(f"{where} has {len(sd['param_groups'])} param groups, this optimizer "
                              f"{len(live_groups)}; load it into an optimizer over the same parameters")
    index = {}
    for gi, (g, live, lsd) in enumerate(zip(sd["param_groups"], live_groups, names_live)):
        if len(g["params"]) != len(live["params"]):
            raise CheckpointError(f"{where}: param group {gi} has {len(g['params'])} parameters, this optimizer's "
                                  f"{len(live['params'])}; load it into an optimizer over the same parameters")
        a, b = g.get("param_names"), lsd.get("param_names")
        if a and b and list(a) != list(b) and match == "names":
            k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            raise CheckpointError(f"{where}: param group {gi} parameter {k} is {a[k]!r}, this optimizer's is "
                                  f"{b[k]!r}; load it into an optimizer over the same named parameters, or, if a "
                                  "module was renamed since the save, load with match='position' (the order you "
                                  "assert; shapes and certified weights are still checked)")
        for i, (idx, p) in enumerate(zip(g["params"], live["params"])):
            index[idx] = (gi, i, (a or b or [None] * len(g["params"]))[i], p)
    for idx, st in sd["state"].items():
        if idx not in index:
            raise CheckpointError(f"{where} has state for parameter index {idx}, which no param group lists")
        gi, i, name, p = index[idx]
        label = f"{name!r}" if name else f"group {gi} parameter {i}"
        for key in ("exp_avg", "exp_avg_sq"):
            t = st.get(key)
            if not isinstance(t, torch.Tensor):
                continue
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{where}: {label} has {key} of shape {tuple(t.shape)}, this optimizer's "
                                      f"parameter is {tuple(p.shape)}; load it into an optimizer over the same parameters")
            if t.dtype != p.dtype:
                raise CheckpointError(f"{where}: {label} has {key} {t.dtype}, this optimizer's parameter is "
                                      f"{p.dtype}; torch would cast the restored moments (keep the parameters {t.dtype})")


# ---------------------------------------------------------------- first-update audit

def torch_step(p, m, v, g, step, group, decoupled, lr=None):
    """One real torch Adam/AdamW step of one parameter, with the param group's flags.

    Args:
      p: the parameter (a float32 tensor; not modified).
      m, v: its ``exp_avg`` and ``exp_avg_sq`` (not modified).
      g: the gradient (a tensor of p's shape).
      step: the steps already taken (the state's ``step``).
      group: the param group (lr, betas, eps, weight_decay, foreach/fused flags).
      decoupled: AdamW's decoupled weight decay (``torch.optim.AdamW``).
      lr: the step's learning rate (None: the group's).

    Returns:
      The parameter after the step (a detached tensor).
    """
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    p = torch.nn.Parameter(p.clone())
    lr = float(scalar_value(group["lr"], "lr")) if lr is None else float(lr)
    opt = cls([p], lr=lr, betas=tuple(group["betas"]), eps=group["eps"],
              weight_decay=group.get("weight_decay", 0.0) or 0.0, **TORCH_FLAGS[implementation_of(group)])
    opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    p.grad = g
    opt.step()
    return p.detach()


def audit(original, restored, *, tau=DEFAULT_TAU, clip=DEFAULT_CLIP, grads=None, grid=None, progress=False,
          param_order=None, lr=None):
    """Run the real torch Adam/AdamW (with the param group's foreach/fused flags) one step from the
    original and the restored state for every gradient of a grid across [-clip, clip]
    (the same g for every coordinate, plus one random per-coordinate draw) and for any
    real gradients given in `grads` {name: tensor} (clamped to [-clip, clip]).

    Args:
      original, restored: torch checkpoints ``{"model": state_dict, "optimizer": state_dict}``,
        the saved one and the one restored from the container (`restore_tree`).
      tau, clip: the contract: ``|p_original - p_restored| <= tau * lr`` for ``|g| <= clip``.
      grads: real gradients {param name: tensor}, optional.
      grid: gradient values (default `jaxguard.audit.gradient_grid(clip)`).
      progress: show a tqdm bar over the tensors.
      param_order: an asserted order for an optimizer without provable names
        (`infer_param_names`); without it such a checkpoint is refused, never audited
        through a map that cannot be proven.
      lr: the learning rates to step with instead of each group's: a number, or ``(lo,
        hi)`` (an interval certificate: the audit steps at lo, sqrt(lo hi) and hi, each
        gap measured in its own lr).

    Returns:
      {"max_gap_lr", "violations" (coordinates over tau), "coordinates", "gradients",
      "param_map"} (`jaxguard.audit.AuditSummary`; ``param_map`` says how the moments were
      matched to the weights, `PARAM_MAPS`).

    Raises:
      UnsupportedOptimizerError, CheckpointError: an optimizer state_dict that is not a
        single-tensor FP32 Adam/AdamW one (`check_optimizer_state`), or unnamed parameters
        with no provable map and no `param_order`.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny steps: threads only add contention
    try:
        return _audit(original, restored, tau=tau, clip=clip, grads=grads, grid=grid, progress=progress,
                      param_order=param_order, lr=lr)
    finally:
        torch.set_num_threads(threads)


def _audit_rates(lr, group):
    """The learning rates an audit steps one group with (`audit`'s ``lr``)."""
    from jaxguard.core.config import is_interval, lr_bounds
    if lr is None:
        return [float(scalar_value(group["lr"], "lr"))]
    lo, hi = lr_bounds(lr)
    return sorted({lo, math.sqrt(lo * hi), hi}) if is_interval(lr) else [lo]


def _audit(original, restored, *, tau, clip, grads, grid, progress, param_order=None, lr=None):
    grid = jg_audit.gradient_grid(clip) if grid is None else grid
    for what, ck in (("the original checkpoint", original), ("the restored checkpoint", restored)):
        if not isinstance(ck, dict) or "optimizer" not in ck or (ck is original and "model" not in ck):
            raise CheckpointError(f"{what} has no {'model and ' if ck is original else ''}optimizer state "
                                  "to audit; pass {'model': model.state_dict(), 'optimizer': optimizer.state_dict()}")
    o_sd, r_sd = original["optimizer"], restored["optimizer"]
    check_optimizer_state(o_sd, original["model"], param_order)
    names = param_index(o_sd, original["model"], param_order)
    r_state = r_sd.get("state", {}) if isinstance(r_sd, dict) else {}
    for idx, st in o_sd["state"].items():
        rst = r_state.get(idx)
        name = names[idx][0] if idx in names else idx
        got = None if not isinstance(rst, dict) else [tuple(getattr(rst.get(k), "shape", ())) for k in
                                                      ("exp_avg", "exp_avg_sq")]
        want = [tuple(st[k].shape) for k in ("exp_avg", "exp_avg_sq")]
        if got != want or name not in original["model"]:
            raise CheckpointError(f"the container does not hold this checkpoint's optimizer state (parameter "
                                  f"{name!r}: moments {want[0]} in CKPT, {'missing' if got is None else got[0]} in the "
                                  "container); audit the container written from this CKPT")
    tally = jg_audit.AuditTally(tau)
    gen = torch.Generator().manual_seed(0)
    items = list(o_sd["state"].items())
    if progress:
        from tqdm import tqdm
        items = tqdm(items, desc="audit", unit="tensor", leave=False)
    for idx, st in items:
        name, group = names[idx]
        rst = r_sd["state"][idx]
        p = original["model"][name].detach().float()
        decoupled = bool(group.get("decoupled_weight_decay", False))
        step = step_count(st, idx)
        gs = [torch.full_like(p, float(g)) for g in grid]
        gs.append((torch.rand(p.shape, generator=gen) * 2 - 1) * clip)
        if grads is not None and name in grads:
            gs.append(grads[name].detach().float().clamp(-clip, clip))
        for rate in _audit_rates(lr, group):
            for g in gs:
                a = torch_step(p, st["exp_avg"], st["exp_avg_sq"], g, step, group, decoupled, rate)
                b = torch_step(p, rst["exp_avg"], rst["exp_avg_sq"], g, step, group, decoupled, rate)
                tally.add(idx, a.numpy(), b.numpy(), rate)
    return {**tally.summary(len(grid) + 1).to_json(), "param_map": param_map_of(o_sd, param_order)}


def save_torch(path, obj) -> None:
    """``torch.save(obj)`` to ``path`` atomically (a temporary file renamed into place).

    Args:
      path: a local path or an fsspec URL.
      obj: what torch.save accepts (a checkpoint dict of tensors).

    Raises:
      OSError: the file cannot be written; no partial file is left.
    """
    container.atomic_write_with(path, lambda fh: torch.save(obj, fh))   # straight to the file, no copy in memory
