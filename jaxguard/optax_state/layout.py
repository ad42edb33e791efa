"""What every leaf of an optax state becomes in a checkpoint (`lay_out`, the one walk every
writer shares), and how a stored leaf is matched to the tree a load restores into."""
from __future__ import annotations

__all__ = ["StateLayout", "lay_out", "warn_other_platform", "stored_like_leaf"]

import warnings
from typing import NamedTuple

import jax
import numpy as np

from jaxguard.core.config import GuardConfig, GuardSpec, UpdateRequest
from jaxguard.core.opmodel import GPU_PLATFORMS, gpu_kernel, is_decoupled
from jaxguard.errors import CheckpointError, JaxguardWarning
from jaxguard.moments import MomentJob
from jaxguard.optax_state.paths import dtype_name, find_adam_states, flat_by_dotted
from jaxguard.optax_state.updates import exact_reasons, plan_updates, platforms_of


class StateLayout(NamedTuple):
    """What every leaf of an optax state becomes in a checkpoint (`lay_out`)."""

    plans: list          # `SitePlan` per Adam site
    coded: list          # a `jaxguard.moments.MomentJob` per certified pair (whole leaves), site by site
    leaves: list         # per state leaf: {"path", "kind" (mu / nu / raw), "entry", "dtype", "shape"[, "why"]}
    flat: dict           # {dotted path: leaf} of the state
    treedef: str         # the state's tree structure


def lay_out(opt_state, params, *, spec: GuardSpec, update: UpdateRequest | None = None, prefix: str = "state",
            sites=None, fixed=None) -> StateLayout:
    """The one walk of an optax state that every writer shares (the single-file save, the
    sharded save, the orbax handler, the jitted hook): the next update of each moment pair
    (`plan_updates`), which pairs are certified under which entry (a `MomentJob` each, on
    the whole leaves: the `optax_state.MomentPair` the walk found, now with its config,
    entry and mu mode), and every leaf's record.  No array's data is read.

    Args:
      opt_state, params: the optax state and its params.
      spec: the save's `GuardSpec`.
      update: the save's `UpdateRequest` (`plan_updates`).
      prefix: the entry-name prefix of the state's leaves.
      sites: the Adam sites (`find_adam_states`), when the caller found them on host views.
      fixed: the next updates resolved already (`plan_updates`).

    Returns:
      A `StateLayout`.

    Raises:
      CheckpointError, UnsupportedOptimizerError, ConfigError: as `plan_updates`; two leaves
        with one dotted path.
    """
    plans = plan_updates(opt_state, params, update=update, sites=sites, fixed=fixed)
    flat = flat_by_dotted(opt_state, "opt_state")
    exact = exact_reasons(plans)
    roles, coded = {}, []     # full dotted path -> (kind, entry name)
    for si, plan in enumerate(plans):
        for pair, update in plan.pairs:
            if update.stores_exactly:
                continue
            entry, raw_entry = f"{prefix}/moments/{pair.mu_path}", f"{prefix}/{pair.mu_path}"
            mu = "coded" if pair.mu_dtype == "float32" else "exact"
            coded.append(MomentJob(entry, pair.mu, pair.nu, pair.p, GuardConfig.from_update(spec, update),
                                   {"param": pair.param}, mu=mu, param=pair.param, mu_path=pair.mu_path,
                                   nu_path=pair.nu_path, raw_entry=raw_entry, site=si, shape=tuple(np.shape(pair.mu))))
            roles[pair.mu_path] = ("mu", entry) if mu == "coded" else ("raw", raw_entry)
            roles[pair.nu_path] = ("nu", entry)
    leaves = []
    for d, leaf in flat.items():
        kind, entry = roles.get(d, ("raw", f"{prefix}/{d}"))
        leaves.append({"path": d, "kind": kind, "entry": entry, "dtype": dtype_name(leaf), "shape": list(np.shape(leaf)),
                       **({"why": exact[d]} if d in exact else {})})
    return StateLayout(plans, coded, leaves, flat, str(jax.tree_util.tree_structure(opt_state)))


def warn_other_platform(sites_meta, like, source="the checkpoint") -> None:
    """Warn (one line, `JaxguardWarning`) when `like`'s Adam moments live on another kind of
    device than the op model that certified them runs on: the guarantee is stated for
    that model's update (XLA:GPU for ``optax-adam[w]-gpu``, XLA:CPU for the others).

    Args:
      sites_meta: the container's ``meta["state"]["sites"]`` (each with its ``config``).
      like: the state being restored into (only its `jax.Array` moments name a platform).
      source: how to name the checkpoint.
    """
    sites = {s.name: s for s in find_adam_states(like)}
    for sm in sites_meta:
        certified = (sm.get("config") or {}).get("op_model")
        site = sites.get(sm.get("path"))
        if site is None or not certified:
            continue
        platforms = platforms_of((site.state.mu, site.state.nu))
        if not platforms:
            continue
        on_gpu = all(p in GPU_PLATFORMS for p in platforms)
        if on_gpu != (gpu_kernel(certified) is not None):
            base = "optax-adamw" if is_decoupled(certified) else "optax-adam"
            runs = base + ("-gpu" if on_gpu else "")
            warnings.warn(f"{source} was certified for {certified} but its Adam state at {site.name!r} is restored "
                          f"onto {', '.join(sorted(platforms))}, whose update is {runs}: the tau guarantee holds for "
                          f"{certified}; resume where it was certified, or save the original state again with "
                          f"op_model={runs!r}", JaxguardWarning, stacklevel=3)
            return


def _python_number_takes(leaf, stored) -> bool:
    """A Python number in `like` (a linen TrainState's ``step=0``) takes a stored scalar of
    its kind (the int32 ``step`` of a jitted update); it is restored as a Python number."""
    if not isinstance(leaf, (bool, int, float)) or tuple(stored["shape"]) != ():
        return False
    try:
        return np.dtype(stored["dtype"]).kind == np.asarray(leaf).dtype.kind
    except TypeError:   # a dtype numpy does not name (bfloat16)
        return False


def stored_like_leaf(stored: dict, d: str, leaf, source) -> dict:
    """The stored record of `like`'s leaf at dotted path `d`, checked for presence, shape and dtype.

    Args:
      stored: {dotted path: leaf record} of the saved state (``meta["state"]["leaves"]``).
      d: the leaf's dotted path.
      leaf: `like`'s leaf there.
      source: how to name the checkpoint in the error.

    Returns:
      The record (``path``, ``kind``, ``entry``, ``dtype``, ``shape``).

    Raises:
      CheckpointError: one line naming the fix when the leaf is missing or its shape or dtype differs.
    """
    if d not in stored:
        raise CheckpointError(f"like has a leaf {d!r} that {source} does not hold; pass a state of the same "
                              "optax transformation and params as the one saved (e.g. tx.init(params))")
    s = stored[d]
    shape, dt = tuple(np.shape(leaf)), dtype_name(leaf)
    if tuple(s["shape"]) != shape:
        raise CheckpointError(f"like has shape {shape} at {d!r} but {source} holds {tuple(s['shape'])}; pass a "
                              "state initialised from params of the saved shapes")
    if s["dtype"] != dt and not _python_number_takes(leaf, s):
        hint = "the same mu_dtype" if "mu" in d.split(".") else "the same dtypes"
        raise CheckpointError(f"like has dtype {dt} at {d!r} but {source} holds {s['dtype']}; initialise like "
                              f"with {hint} as the saved state")
    return s
