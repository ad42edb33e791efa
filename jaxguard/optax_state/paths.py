"""Finding Adam states in any optax state pytree, naming its leaves by dotted path (the
package docstring), pairing each Adam site's moments with their parameters.  Nothing here
reads an array's data: it walks trees and checks shapes and dtypes.
"""
from __future__ import annotations

__all__ = ["INJECT_STATES", "NO_ADAM", "MU_DTYPES", "key_str", "dotted", "flat_by_dotted", "dtype_name", "AdamSite",
           "find_adam_states", "MomentPair", "moment_pairs"]

import dataclasses
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from jaxguard.errors import CheckpointError, UnsupportedOptimizerError

INJECT_STATES = tuple(c for c in (getattr(optax, "InjectHyperparamsState", None),
                                  getattr(optax, "InjectStatefulHyperparamsState", None)) if c is not None)
NO_ADAM = ("opt_state holds no optax.ScaleByAdamState; jaxguard.save compresses Adam/AdamW state "
           "(optax.adam, optax.adamw, or a chain containing optax.scale_by_adam); save other "
           "optimizers with orbax directly")
MU_DTYPES = ("float32", "bfloat16")


# ---------------------------------------------------------------- paths and dtypes
def key_str(k) -> str:
    """One key of a JAX key path as it appears in a dotted path.

    Args:
      k: a `jax.tree_util` key (DictKey, GetAttrKey, SequenceKey, FlattenedIndexKey) or
        anything else (its ``str``).

    Returns:
      The dict key, attribute name or index as a string.
    """
    tu = jax.tree_util
    if isinstance(k, tu.DictKey):
        return str(k.key)
    if isinstance(k, tu.GetAttrKey):
        return k.name
    if isinstance(k, tu.SequenceKey):
        return str(k.idx)
    if isinstance(k, tu.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def dotted(path) -> str:
    """A key path as its dotted name.

    Args:
      path: a JAX key path (a sequence of keys).

    Returns:
      ``"a.b.0.c"``: dict keys, attribute names and indices joined by ``"."``.
    """
    return ".".join(key_str(k) for k in path)


def flat_by_dotted(tree, what="tree") -> dict:
    """The leaves of `tree` by dotted path.

    Args:
      tree: any pytree.
      what: how to name the tree in the error (``"params"``, ``"opt_state"``).

    Returns:
      {dotted path: leaf}, in flattening order.

    Raises:
      CheckpointError: two leaves with the same dotted path.
    """
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        d = dotted(path)
        if d in out:
            raise CheckpointError(f"{what} has two leaves with the dotted path {d!r}; rename the keys so that "
                                  "joining them with '.' is unique")
        out[d] = leaf
    return out


def dtype_name(x) -> str:
    """The numpy dtype name of an array-like leaf (``"float32"``, ``"bfloat16"``, ...).

    Args:
      x: a jax/numpy array, or a Python or numpy scalar.

    Returns:
      ``np.dtype(x.dtype).name``, or that of ``np.asarray(x)`` when `x` has no dtype.
    """
    return np.dtype(getattr(x, "dtype", None) or np.asarray(x).dtype).name


# ---------------------------------------------------------------- finding Adam states
@dataclasses.dataclass
class AdamSite:
    """One `ScaleByAdamState` in an optax state tree, with its enclosing hyperparameters
    (``hparams``: Python floats; ``hparams_arrays``: the same as the state holds them)."""

    path: tuple
    state: Any
    hparams: dict
    # the state sits where optax.adamw's chain puts it (scale_by_adam, a stateless or
    # masked transform, then the learning rate): its weight decay is not in the state
    decay_layout: bool = False
    hparams_arrays: dict = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        """Returns: the dotted path of the state (``"<root>"`` for a bare `ScaleByAdamState`)."""
        return dotted(self.path) or "<root>"

    def leaf_path(self, field: str, sub=()) -> str:
        """The dotted path in the whole state of a leaf of this site.

        Args:
          field: ``"mu"``, ``"nu"`` or ``"count"``.
          sub: the key path inside that field (the param's path), empty for ``count``.

        Returns:
          The dotted path from the root of the optax state.
        """
        return dotted(self.path + (jax.tree_util.GetAttrKey(field),) + tuple(sub))


def _hparams(node, as_arrays=False) -> dict:
    out = {}
    for k, v in dict(node.hyperparams).items():
        try:
            a = np.asarray(v)
        except Exception:  # noqa: BLE001 - non-numeric hyperparameters are ignored
            continue
        if a.shape == () and np.issubdtype(a.dtype, np.number):
            out[k] = a if as_arrays else float(a)
    return out


def _is_stop(x):
    return isinstance(x, (optax.ScaleByAdamState,) + INJECT_STATES)


def _adamw_layouts(node, found=None) -> set:
    """ids of the `ScaleByAdamState`s that a chain state holds as ``optax.adamw`` lays it
    out: the Adam state, then an `EmptyState` or `MaskedState` (``add_decayed_weights``
    is stateless), then at least one more state (the learning rate); ``optax.adam`` has
    only the Adam state and the learning rate's."""
    found = set() if found is None else found
    if isinstance(node, optax.ScaleByAdamState):
        return found
    if isinstance(node, tuple) and not hasattr(node, "_fields"):
        for i, x in enumerate(node):
            if (isinstance(x, optax.ScaleByAdamState) and len(node) >= i + 3
                    and isinstance(node[i + 1], (optax.EmptyState, optax.MaskedState))):
                found.add(id(x))
    children = node if isinstance(node, (tuple, list)) else node.values() if isinstance(node, dict) else ()
    if hasattr(node, "_fields"):
        children = tuple(node)
    for x in children:
        _adamw_layouts(x, found)
    return found


def find_adam_states(opt_state) -> list[AdamSite]:
    """Every `optax.ScaleByAdamState` in `opt_state`, in flattening order.

    Args:
      opt_state: any optax state pytree (`adam`, `adamw`, `chain`, `inject_hyperparams`,
        `multi_transform`, `masked`, `named_chain`, ...).

    Returns:
      One `AdamSite` per Adam state, with the numeric scalar hyperparameters of the
      `inject_hyperparams` states enclosing it (inner ones win).
    """
    out: list[AdamSite] = []
    decay_layout = _adamw_layouts(opt_state)

    def walk(node, prefix, hp, hpa):
        for path, leaf in jax.tree_util.tree_flatten_with_path(node, is_leaf=_is_stop)[0]:
            full = prefix + tuple(path)
            if isinstance(leaf, optax.ScaleByAdamState):
                out.append(AdamSite(full, leaf, hp, id(leaf) in decay_layout, hpa))
            elif isinstance(leaf, INJECT_STATES):
                walk(leaf.inner_state, full + (jax.tree_util.GetAttrKey("inner_state"),), {**hp, **_hparams(leaf)},
                     {**hpa, **_hparams(leaf, as_arrays=True)})

    walk(opt_state, (), {}, {})
    return out


class MomentPair(NamedTuple):
    """The ``mu``/``nu`` leaves of one parameter in one Adam site, checked against it: the
    walk's record, before the pair's next update is known (`plan_updates` pairs it with a
    `NextUpdate`; `lay_out` turns a certified one into the `jaxguard.moments.MomentJob`
    every writer takes, with its config, entry and mu mode)."""

    param: str       # the param's dotted name (its path inside mu, nu and params)
    mu_path: str     # dotted path of mu's leaf in the whole optax state
    nu_path: str
    mu: Any
    nu: Any
    p: Any
    mu_dtype: str    # "float32" (coded) or "bfloat16" (stored raw, only nu coded)


def moment_pairs(site: AdamSite, params_by_dotted: dict, *, uncovered: list | None = None) -> list[MomentPair]:
    """The moment pairs of `site`, each matched to its parameter and checked.

    Args:
      site: from `find_adam_states`.
      params_by_dotted: ``flat_by_dotted(params, "params")``.
      uncovered: a list that receives ``(MomentPair, why)`` for each pair whose dtypes the
        guarantee does not cover, instead of raising (``uncertifiable="exact"``).

    Returns:
      One `MomentPair` per leaf of ``site.state.mu``, in flattening order.

    Raises:
      CheckpointError: mu and nu of different structures, a moment without a param, or
        shapes that differ.
      UnsupportedOptimizerError: a param or nu that is not float32, a mu that is neither
        float32 nor bfloat16 (the guarantee covers those).
    """
    mus = {dotted(p): (p, x) for p, x in jax.tree_util.tree_flatten_with_path(site.state.mu)[0]}
    nus = {dotted(p): (p, x) for p, x in jax.tree_util.tree_flatten_with_path(site.state.nu)[0]}
    if set(mus) != set(nus):
        raise CheckpointError(f"the Adam state at {site.name!r} has mu and nu of different structures")
    out = []
    for sub, (mpath, mu) in mus.items():
        npath, nu = nus[sub]
        if sub not in params_by_dotted:
            raise CheckpointError(f"params has no leaf {sub!r} but the Adam state at {site.name!r} does; pass "
                                  "the params the optimizer state belongs to (same tree)")
        p = params_by_dotted[sub]
        shape = tuple(np.shape(mu))
        if tuple(np.shape(p)) != shape or tuple(np.shape(nu)) != shape:
            raise CheckpointError(f"param {sub!r} has shape {tuple(np.shape(p))} but its Adam moments have "
                                  f"{shape}; the params and optimizer state do not match")
        mdt = dtype_name(mu)
        pair = MomentPair(sub, site.leaf_path("mu", mpath), site.leaf_path("nu", npath), mu, nu, p, mdt)
        if dtype_name(p) != "float32" or dtype_name(nu) != "float32":
            why = (f"{dtype_name(p)} parameters" if dtype_name(p) != "float32" else f"{dtype_name(nu)} nu") + \
                " (the guarantee covers float32)"
            error = UnsupportedOptimizerError(f"param {sub!r} is {dtype_name(p)} with nu {dtype_name(nu)}; the "
                                              "guarantee covers float32 params and nu (mu may be bfloat16)")
        elif mdt not in MU_DTYPES:
            why = f"{mdt} mu (the guarantee covers float32 and bfloat16)"
            error = UnsupportedOptimizerError(f"mu of {sub!r} is {mdt}; jaxguard supports float32 and bfloat16 mu")
        else:
            out.append(pair)
            continue
        if uncovered is None:
            raise error
        uncovered.append((pair, why))
    return out
