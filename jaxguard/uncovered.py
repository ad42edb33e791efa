"""State the guard does not cover, and the policy the trainer integrations share.

The guarantee covers float32 Adam/AdamW moments of float32 parameters under a pinned op
model (docs/coverage.md).  Everything else in an optimizer's state (bfloat16 or float16
parameters or moments, amsgrad and the other flags outside the op models, optimizers that
are not Adam, a next learning rate of 0) is *uncovered*.  Two policies:

* ``"refuse"`` (the explicit API: `jaxguard.save`, `torch_compat.save`, the CLI): one line
  naming the value and the fix; nothing is written.
* ``"exact"`` (the integrations: Hugging Face Trainer, accelerate, Lightning, the orbax
  handler, the DCP planner): what is uncovered is stored exactly, in its own dtype (a
  bfloat16 moment takes 2 bytes), the rest compressed as usual; the file records each
  parameter stored exactly and why (``stored_exactly``: ``{"param", "why"}``, shown by
  ``jaxguard inspect``), and one warning line names them (`warn`).  A save is never lost
  to the guard.
"""
from __future__ import annotations

__all__ = ["REFUSE", "EXACT", "POLICIES", "policy", "describe", "warn"]

import warnings

from jaxguard.errors import ConfigError, JaxguardWarning

REFUSE, EXACT = "refuse", "exact"
POLICIES = (REFUSE, EXACT)


def policy(value) -> str:
    """Check an ``uncertifiable=`` argument.

    Args:
      value: ``"refuse"`` or ``"exact"``.

    Returns:
      `value`.

    Raises:
      ConfigError: anything else (one line).
    """
    if value not in POLICIES:
        raise ConfigError(f"uncertifiable={value!r}: pass 'refuse' (raise on state the guard cannot certify) or "
                          "'exact' (store it exactly, uncompressed)")
    return value


def describe(stored, *, of: int | None = None) -> str:
    """One line naming what was stored exactly and why, grouped by reason.

    Args:
      stored: ``[{"param", "why"}, ...]`` (a file's or save summary's ``stored_exactly``).
      of: how many parameters the save holds (named when given).

    Returns:
      E.g. ``"3 of 8 parameters stored exactly, not compressed: bfloat16 parameters (the
      guarantee covers float32): 2, e.g. 'wte.weight'; parameters with amsgrad=True
      (outside the op models): 'head.bias'"``.
    """
    by_why: dict = {}
    for s in stored:
        by_why.setdefault(s["why"], []).append(s["param"])
    parts = [f"{why}: " + (f"{len(names)}, e.g. {names[0]!r}" if len(names) > 1 else repr(names[0]))
             for why, names in by_why.items()]
    n = len(stored)
    count = f"{n} of {of} parameters" if of is not None else f"{n} parameter{'s' if n != 1 else ''}"
    return f"{count} stored exactly, not compressed: " + "; ".join(parts)


def warn(where: str, stored, *, of: int | None = None) -> None:
    """The integrations' one warning line (`JaxguardWarning`) when a save stored state exactly.

    Args:
      where: who saved and where (``"GuardedTrainer: checkpoint-20"``).
      stored: the save's ``stored_exactly`` list (nothing is said when it is empty).
      of: how many parameters the save holds.
    """
    if stored:
        warnings.warn(f"{where}: {describe(stored, of=of)}", JaxguardWarning, stacklevel=3)
