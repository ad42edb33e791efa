"""What the trainer integrations share: the file name, unwrapping framework optimizer
wrappers, and the one save of an optimizer, which stores exactly what the guard cannot
certify (`jaxguard.uncovered`)."""
from __future__ import annotations

__all__ = ["OPTIMIZER_FILE", "unwrap", "model_names", "save_optimizer", "copy_for_later", "zero_lr_groups"]

from jaxguard import uncovered

OPTIMIZER_FILE = "optimizer.jg"


def unwrap(optimizer):
    """The torch optimizer inside accelerate's / Lightning's wrappers (``.optimizer``).

    Args:
      optimizer: a torch optimizer or a wrapper of one (up to 8 levels).

    Returns:
      The innermost optimizer.
    """
    seen = 0
    while hasattr(optimizer, "optimizer") and seen < 8:
        optimizer = optimizer.optimizer
        seen += 1
    return optimizer


def model_names(optimizer, models) -> dict:
    """The models' parameter names for an optimizer built from ``model.parameters()``.

    Its state_dict names nothing (`torch_compat.state.snapshot` calls parameter i of group
    g ``group<g>.param<i>``); the warning names them as the model does, by identity.

    Args:
      optimizer: the optimizer (or a wrapper of one).
      models: the modules its parameters belong to.

    Returns:
      ``{"group<g>.param<i>": model name}`` for each parameter a model holds.
    """
    by_id = {id(p): n for m in models for n, p in m.named_parameters()}
    return {f"group{g}.param{i}": by_id[id(p)] for g, group in enumerate(unwrap(optimizer).param_groups)
            for i, p in enumerate(group["params"]) if id(p) in by_id}


def save_optimizer(path, optimizer, *, spec, where: str, snapshot=None, names=None) -> dict:
    """The integrations' save of one optimizer: a save is never lost to the guard.

    What the guard certifies is compressed; what it cannot (bfloat16/float16 parameters or
    moments, amsgrad and the other flags outside the op models, an optimizer that is not
    Adam) is stored exactly, and one warning line names it (`jaxguard.uncovered`).

    Args:
      path: the container to write.
      optimizer: the optimizer (or a wrapper of one).
      spec: the guard settings.
      where: who saves, for the warning (``"GuardedTrainer: checkpoint-20"``).
      snapshot: a `torch_compat.state.snapshot` taken earlier (a background save), or None.
      names: `model_names`, for the warning (the file records the optimizer's own names).

    Returns:
      The save summary (``stored_exactly``: what was stored exactly and why).
    """
    import torch_compat
    from torch_compat import state as tstate
    if snapshot is None:
        summary = torch_compat.save(path, unwrap(optimizer), spec=spec, uncertifiable="exact")
    else:
        summary = tstate.save_snapshot(path, *snapshot, spec=spec, uncertifiable="exact")
    named = [{**s, "param": (names or {}).get(s["param"], s["param"])} for s in summary["stored_exactly"]]
    uncovered.warn(where, named, of=summary["parameters"])
    return summary


def copy_for_later(optimizer):
    """A snapshot for `save_optimizer` on a background thread while training goes on.

    Args:
      optimizer: any torch optimizer (or a wrapper of one).

    Returns:
      `torch_compat.state.snapshot` with every tensor cloned.
    """
    from torch_compat import state as tstate
    return tstate.snapshot(unwrap(optimizer), copy=True, any_optimizer=True)


def zero_lr_groups(optimizer) -> list:
    """Indices of param groups whose learning rate is <= 0.

    The guarantee is relative to the next update's lr (``tau * lr``); at lr 0 (the last
    step of a schedule that decays to 0, the Hugging Face default) there is nothing to
    certify against, and the integrations store that optimizer uncompressed instead.

    Args:
      optimizer: the optimizer (or a wrapper of one).

    Returns:
      The indices of those groups (empty when every lr is > 0).

    Raises:
      CheckpointError: a tensor lr of more than one element.
    """
    from torch_compat.state import scalar_value
    out = []
    for i, g in enumerate(unwrap(optimizer).param_groups):
        if not scalar_value(g["lr"], f"param group {i} lr") > 0:
            out.append(i)
    return out
