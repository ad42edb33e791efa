"""What jaxguard covers in a torch optimizer: Adam/AdamW without the unsupported flags,
float32 state; the rest is stored exactly with the reason (`Uncovered`)."""
from __future__ import annotations

__all__ = ['UNSUPPORTED_FLAGS', 'EXACT_REASON', 'Uncovered', 'implementation_of', 'op_model_of', 'group_uncovered',
           'check_param_group', 'param_uncovered', 'check_optimizer_state']

from typing import NamedTuple

from jaxguard.errors import CheckpointError, ConfigError, UnsupportedOptimizerError
from jaxguard.core.opmodel import resolve_op_model, torch_op_model
from torch_compat.state.tensors import dtype_name, is_tensor, torch_version
from torch_compat.state.param_names import NO_NAMES, infer_param_names


UNSUPPORTED_FLAGS = ("amsgrad", "maximize", "capturable", "differentiable")
EXACT_REASON = "the param group's next learning rate is 0 (nothing to certify against): moments stored exactly"


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


def _state_uncovered(idx, st, gi, g) -> Uncovered | None:
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
        u = bad_groups.get(gi) or _state_uncovered(idx, st, gi, g)
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
