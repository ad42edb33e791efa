"""Which model parameter each optimizer state entry belongs to: the optimizer's
``param_names``, a provable map by shapes, or an order the user asserts."""
from __future__ import annotations

__all__ = ['NO_NAMES', 'BY_ORDER_FIX', 'PARAM_MAPS', 'infer_param_names', 'with_param_names',
           'param_map_of', 'param_index', 'param_digest']

import hashlib

import numpy as np

from jaxguard.format.torchzip import FileTensor
from jaxguard.errors import CheckpointError
from torch_compat.state.tensors import is_tensor, torch
from torch_compat.state.skeleton import tie_key


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
        key = tie_key(t)
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


def _stale_names_error(opt_sd, model_sd):
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
        stale = _stale_names_error(opt_sd, model_sd) if model_sd is not None else None
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
