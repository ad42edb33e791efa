"""The first-update audit and the certification totals, for every adapter (numpy only).

An audit runs the real framework (optax, torch.optim, torch under DCP) one step from the
original and from the restored optimizer state, for many gradients, and compares the two
updated parameters coordinate by coordinate.  The framework adapters run the steps
(`jaxguard.optax_adapter.audit`, `torch_compat.audit`, `torch_compat.dcp.first_update_audit`);
this module owns what they share: the gradient grid, the gap in learning-rate units, the
tally over gradients and the summary they return, and the totals of what a save certified.

Numerical contract
------------------
`gap_lr(a, b, lr)` is ``|a - b| / lr`` computed in float64 from the float32 (or any float)
updated parameters: exactly 0 where ``a`` and ``b`` are equal (the same float, or both NaN:
a NaN state is stored exactly, so a NaN parameter appears in both runs), ``inf`` where only
one of them is NaN, the largest float64 where the gap itself is infinite (``inf`` against
``-inf``; either way far over any tau).  The float64 difference of two float32 values is exact, so the only
rounding is the division by ``lr`` (relative 2**-53): a coordinate is "over tau" when its
gap exceeds ``tau``, the contract ``|p_ref - p_test| <= tau * lr`` checked as stated.
"""
from __future__ import annotations

__all__ = ["TOTAL_KEYS", "gradient_grid", "gap_lr", "AuditTally", "new_totals", "add_stats",
           "compression_summary", "certified_for", "describe_certified"]

import dataclasses
from typing import Any

import numpy as np

TOTAL_KEYS = ("coordinates", "escapes", "payload_bytes", "raw_fp32_bytes", "exact", "uncertifiable")


# ---------------------------------------------------------------- the gradients an audit applies
def gradient_grid(clip, n_linear=8, n_log=14) -> np.ndarray:
    """Gradient values across ``[-clip, clip]``, each applied to every coordinate.

    Args:
      clip: the gradient bound of the contract (``|g| <= clip``).
      n_linear: values per side on a linear grid (``2 * n_linear + 1`` from ``-clip`` to ``clip``).
      n_log: magnitudes per sign on a log grid from ``clip / 2`` down to ``clip * 2**-40``,
        where the update is most sensitive to a small change of ``v``.

    Returns:
      The sorted values (0 included) as a float32 array; they are distinct in float64,
      so two may round to one float32 (``clip / 2`` is on both grids): 44 values at the
      defaults.
    """
    lin = np.linspace(-clip, clip, 2 * n_linear + 1)
    logs = clip * 2.0 ** -np.linspace(1, 40, n_log)
    return np.unique(np.concatenate([lin, logs, -logs, [0.0]])).astype(np.float32)


# ---------------------------------------------------------------- comparing two updates
def gap_lr(a, b, lr) -> np.ndarray:
    """The gap between two updated parameters in units of the learning rate.

    Args:
      a, b: the parameters after one step from the original and from the restored state
        (array-likes of one shape: numpy, jax or CPU torch arrays).
      lr: the learning rate of that step (> 0).

    Returns:
      float64 array of ``|a - b| / lr``: 0 where equal or both NaN, ``inf`` where one is NaN,
      the largest float64 where the gap is infinite.
    """
    a, b = np.asarray(a), np.asarray(b)
    x, y = a.astype(np.float64), b.astype(np.float64)
    with np.errstate(invalid="ignore"):
        gap = np.abs(x - y) / lr
    same = (a == b) | (np.isnan(x) & np.isnan(y))
    return np.where(same, 0.0, np.nan_to_num(gap, nan=np.inf))


@dataclasses.dataclass(frozen=True)
class AuditSummary:
    """What an audit found.

    Attributes:
      max_gap_lr: the largest gap over all coordinates and gradients, in lr units.
      violations: coordinates whose gap exceeds tau for at least one gradient.
      coordinates: coordinates audited.
      gradients: gradients applied (grid values, random draws, real gradients).
      worst: where the largest gap was, ``(gradient label, parameter name)``, when tracked.
      clamped: real-gradient coordinates clamped into ``[-clip, clip]``, when counted.
    """

    max_gap_lr: float
    violations: int
    coordinates: int
    gradients: int
    worst: Any = None
    clamped: int | None = None

    @property
    def passed(self) -> bool:
        """Returns: True when no coordinate is over tau."""
        return self.violations == 0

    def to_json(self, *, with_worst=False, with_clamped=False) -> dict:
        """The summary as the adapters report it (the `audit --json` fields).

        Args:
          with_worst: include ``"worst"`` (the optax audit reports it).
          with_clamped: include ``"clamped"`` (the DCP audit reports it).

        Returns:
          {"max_gap_lr", "violations", "coordinates", "gradients"[, "worst"][, "clamped"]}.
        """
        out = {"max_gap_lr": float(self.max_gap_lr), "violations": int(self.violations),
               "coordinates": int(self.coordinates), "gradients": int(self.gradients)}
        if with_worst:
            out["worst"] = self.worst
        if with_clamped:
            out["clamped"] = int(self.clamped or 0)
        return out


class AuditTally:
    """Accumulates the gaps of one audit over parameters and gradients.

    Args:
      tau: the contract's tolerance in lr units.
    """

    def __init__(self, tau: float):
        self.tau = float(tau)
        self.max_gap_lr = 0.0
        self.worst: Any = None
        self._over: dict = {}

    def add(self, name, a, b, lr, label=None) -> np.ndarray:
        """Compare the two updates of parameter `name` after the gradient `label`.

        Args:
          name: the parameter (any hashable: a dotted name, an index).
          a, b: its values after the step from the original and from the restored state.
          lr: the learning rate of that step.
          label: the gradient applied (recorded in ``worst``).

        Returns:
          The gap array (`gap_lr`).
        """
        gap = gap_lr(a, b, lr)
        if gap.size and gap.max() > self.max_gap_lr:
            self.max_gap_lr, self.worst = float(gap.max()), (label, name)
        over = gap > self.tau
        self._over[name] = over if name not in self._over else self._over[name] | over
        return gap

    def summary(self, gradients: int, *, clamped=None) -> AuditSummary:
        """The summary of everything added.

        Args:
          gradients: how many gradients were applied.
          clamped: real-gradient coordinates clamped, where the caller counts them.

        Returns:
          An `AuditSummary`.
        """
        return AuditSummary(max_gap_lr=self.max_gap_lr, violations=int(sum(int(o.sum()) for o in self._over.values())),
                            coordinates=int(sum(o.size for o in self._over.values())), gradients=int(gradients),
                            worst=self.worst, clamped=clamped)


# ---------------------------------------------------------------- what a save certified
def new_totals(keys=TOTAL_KEYS) -> dict:
    """Zeroed totals of the guard's per-tensor stats.

    Args:
      keys: which stats to total (default `TOTAL_KEYS`).

    Returns:
      {key: 0}.
    """
    return {k: 0 for k in keys}


def add_stats(totals: dict, stats: dict) -> dict:
    """Add one encoded tensor's stats (``Encoded.stats``) to `totals`, in place.

    Args:
      totals: from `new_totals`.
      stats: the guard's stats of one tensor, holding every key of `totals`.

    Returns:
      `totals`.
    """
    for k in totals:
        totals[k] += stats[k]
    return totals


def compression_summary(totals: dict, container_bytes: int, raw_state_bytes=None) -> dict:
    """The save summary (`compress --json` fields) from the totals.

    Args:
      totals: the summed stats (`TOTAL_KEYS`, plus anything else, kept as is).
      container_bytes: the size of what was written.
      raw_state_bytes: the size of the optimizer state uncompressed, when known.

    Returns:
      `totals` plus ``escape_rate``, ``payload_ratio``, ``container_bytes`` and, with
      `raw_state_bytes`, ``raw_state_bytes`` and ``container_ratio``.
    """
    n = max(totals["coordinates"], 1)
    s = {**totals, "escape_rate": totals["escapes"] / n,
         "payload_ratio": totals["payload_bytes"] / max(totals["raw_fp32_bytes"], 1),
         "container_bytes": container_bytes}
    if raw_state_bytes:
        s["raw_state_bytes"] = raw_state_bytes
        s["container_ratio"] = container_bytes / raw_state_bytes
    return s


# ---------------------------------------------------------------- what a file was certified for
# the fields of an entry's config that say which update it was certified for
CERTIFIED_FIELDS = ("lr", "weight_decay", "betas", "eps", "step", "op_model", "tau", "clip", "source", "param_map")


def certified_for(entries) -> list:
    """The moment entries of a file grouped by the update they were certified for, so that
    a GPT-2-sized file lists a few groups, not 150 identical rows (``jaxguard inspect``).

    Args:
      entries: ``(config, stats)`` per moment entry (or shard): its config dict (the
        `GuardConfig` JSON plus ``param``, ...) and its stats (``coordinates``,
        ``escapes``), either may lack fields (files written before they existed).

    Returns:
      One dict per distinct update, in order of first appearance: the `CERTIFIED_FIELDS`
      (``source`` defaults to ``"given"``; None where not recorded), ``certify`` (False
      for codes stored without the guard), ``tensors``, ``coordinates``, ``escapes`` and
      ``params`` (the parameter names, each once, in order).
    """
    groups: dict = {}
    for cfg, stats in entries:
        cfg = cfg or {}
        row = {k: cfg.get(k) for k in CERTIFIED_FIELDS}
        row["source"] = row["source"] or ("given" if cfg else None)
        row["certify"] = cfg.get("certify", True)
        key = repr(sorted(row.items()))
        g = groups.setdefault(key, {**row, "tensors": 0, "coordinates": 0, "escapes": 0, "params": []})
        g["tensors"] += 1
        g["coordinates"] += int((stats or {}).get("coordinates", 0))
        g["escapes"] += int((stats or {}).get("escapes", 0))
        if cfg.get("param") is not None and cfg["param"] not in g["params"]:
            g["params"].append(cfg["param"])
    return list(groups.values())


def describe_certified(group: dict, shown: int = 3) -> str:
    """One line of `certified_for`'s group for ``jaxguard inspect``.

    Args:
      group: a dict of `certified_for`.
      shown: how many parameter names to show.

    Returns:
      ``"lr 0.001, weight_decay 0.1, betas (0.9, 0.999), eps 1e-08, step 41, optax-adamw,
      tau 0.01, clip 0.2, from tx: 148 tensors, 124,439,808 coordinates, 12 escapes (a, b, ...)"``.
    """
    def fmt(k, v):
        if k == "lr" and isinstance(v, (list, tuple)):
            return f"lr [{v[0]:.6g}, {v[1]:.6g}] (every rate in it)"
        if k == "betas" and v is not None:
            return f"betas ({', '.join(f'{b:g}' for b in v)})"
        return f"{k} {v:.6g}" if isinstance(v, float) else f"{k} {v}"

    head = ", ".join(fmt(k, group[k]) for k in ("lr", "weight_decay", "betas", "eps", "step", "op_model", "tau", "clip")
                     if group.get(k) is not None)
    if not group.get("certify", True):
        head += ", NOT certified (certify=False)"
    names = group["params"]
    more = f", ... {len(names) - shown} more" if len(names) > shown else ""
    where = f", params by {group['param_map']}" if group.get("param_map") else ""
    return (f"{head or 'not recorded'}, from {group.get('source') or 'not recorded'}{where}: {group['tensors']} "
            f"tensors, {group['coordinates']:,} coordinates, {group['escapes']:,} escapes"
            + (f" ({', '.join(names[:shown])}{more})" if names else ""))
