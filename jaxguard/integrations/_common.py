"""What the trainer integrations share: the file name, unwrapping framework optimizer
wrappers, the early check that the optimizer is one the guard models, and publishing a
checkpoint directory as a whole."""
from __future__ import annotations

import os
import shutil

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


# A checkpoint directory is committed as a whole: the framework writes it into a hidden
# staging directory beside it, and two renames publish it (the previous directory, if any,
# moved aside first and removed last).  A kill before the renames leaves the previous
# checkpoint as it was; a kill between them leaves it under OLD_SUFFIX, which
# `recover_directory` (run by the next save or load) moves back.
STAGING_SUFFIX = ".jaxguard-staging"
OLD_SUFFIX = ".jaxguard-old"


def staging_path(final: str) -> str:
    """The hidden staging directory beside `final` (``parent/.NAME.jaxguard-staging``).

    Args:
      final: the checkpoint directory a save publishes.

    Returns:
      The staging path (no checkpoint-naming pattern matches it: it starts with a dot).
    """
    final = os.path.normpath(os.fspath(final))
    return os.path.join(os.path.dirname(final), f".{os.path.basename(final)}{STAGING_SUFFIX}")


def _old_path(final: str) -> str:
    final = os.path.normpath(os.fspath(final))
    return os.path.join(os.path.dirname(final), f".{os.path.basename(final)}{OLD_SUFFIX}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for here, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(here, name), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(here)


def recover_directory(final: str) -> str | None:
    """Undo what an interrupted commit of `final` left; the previous checkpoint comes back.

    Args:
      final: a checkpoint directory `commit_directory` publishes.

    Returns:
      A one-line description of what was recovered or removed, or None when nothing was left.
    """
    final = os.path.normpath(os.fspath(final))
    done = []
    old = _old_path(final)
    if os.path.isdir(old):
        if os.path.exists(final):      # the commit finished its renames, not the removal
            shutil.rmtree(old, ignore_errors=True)
            done.append(f"removed {old} (left by a save that committed)")
        else:                          # stopped between the renames: the previous checkpoint returns
            os.rename(old, final)
            _fsync_dir(os.path.dirname(final) or ".")
            done.append(f"restored {final} from {old} (a save stopped while publishing)")
    stage = staging_path(final)
    if os.path.isdir(stage):
        shutil.rmtree(stage, ignore_errors=True)
        done.append(f"removed {stage} (an unfinished save)")
    return "; ".join(done) or None


def recover_directories(parent: str) -> list:
    """`recover_directory` for every checkpoint under `parent` an interrupted commit left.

    Args:
      parent: the directory holding the checkpoint directories (a Trainer's output_dir).

    Returns:
      The descriptions of what was recovered or removed.
    """
    if not os.path.isdir(parent):
        return []
    out = []
    for name in sorted(os.listdir(parent)):
        for suffix in (OLD_SUFFIX, STAGING_SUFFIX):
            if name.startswith(".") and name.endswith(suffix) and len(name) > len(suffix) + 1:
                what = recover_directory(os.path.join(parent, name[1:-len(suffix)]))
                if what:
                    out.append(what)
    return out


def commit_directory(stage: str, final: str) -> None:
    """Publish the finished staging directory `stage` as `final`, replacing what was there.

    Every file under `stage` is fsynced first; then the previous `final` (if any) is
    renamed aside, `stage` renamed to `final`, and the previous one removed.

    Args:
      stage: the directory the save wrote (`staging_path(final)` or a directory inside it).
      final: the checkpoint directory to publish.
    """
    final = os.path.normpath(os.fspath(final))
    _fsync_tree(stage)
    old = _old_path(final)
    if os.path.exists(final):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(stage, final)
    _fsync_dir(os.path.dirname(final) or ".")
    if os.path.exists(old):
        shutil.rmtree(old)
