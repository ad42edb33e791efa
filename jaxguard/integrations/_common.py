"""What the trainer integrations share: the file name, unwrapping framework optimizer
wrappers, and the early check that the optimizer is one the guard models."""
from __future__ import annotations


from jaxguard.errors import UnsupportedOptimizerError

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


def check_supported(optimizer, where: str) -> None:
    """Refuse, before training starts, an optimizer whose state the guard cannot certify.

    Args:
      optimizer: the optimizer (or a wrapper of one).
      where: what is checking, prefixed to the message (``"GuardedTrainer"``).

    Raises:
      UnsupportedOptimizerError: not torch Adam/AdamW, or a flag outside the op models
        (the message is `torch_compat.state.check_optimizer_state`'s, prefixed by `where`).
    """
    import torch
    from torch_compat import state as tstate
    opt = unwrap(optimizer)
    if not isinstance(opt, torch.optim.Adam):
        raise UnsupportedOptimizerError(f"{where}: the optimizer is {type(opt).__name__}; jaxguard guards "
                                        "torch.optim.Adam and AdamW state only")
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g.setdefault("param_names", [str(i) for i in g["params"]])
    try:
        tstate.check_optimizer_state(sd)
    except UnsupportedOptimizerError as exc:
        raise UnsupportedOptimizerError(f"{where}: {exc}") from None


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
