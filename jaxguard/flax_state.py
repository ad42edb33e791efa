"""Flax state as the plain optax pytrees jaxguard reads, and back.

Every optax entry point (`jaxguard.save`/`load`, the orbax handler, sharded saves) calls
`plain_state` and `plain_params` first, so a Flax user passes what Flax hands them:

* **NNX**: ``nnx.state(optimizer)`` (an ``nnx.State`` of ``OptState``/``OptArray``/
  ``OptVariable`` variables) and ``nnx.state(model, nnx.Param)`` (or the model itself).
  ``nnx.state`` keeps the arrays but not optax's types: its optimizer state is nested
  dicts (``{"opt_state": {0: {"count", "mu", "nu"}}, "step"}``), the chain's
  ``EmptyState``\\ s are gone, and ``optax.adam``, ``optax.adamw``, ``optax.adabelief`` and
  ``optax.novograd`` leave the same fields.  The types are rebuilt from the optimizer's
  own transformation: ``tx=optimizer.tx`` (``jax.eval_shape(tx.init, params)``, whose leaves
  must be the state's, path for path, shape for shape); without it a save is refused in
  one line (certifying AdaBelief's moments as Adam's would void the guarantee).  A load
  needs no ``tx``: it matches the stored leaves by path and gives back an ``nnx.State``
  of ``like``'s variables, for ``nnx.update(optimizer, state)``.
* **linen**: a ``flax.training.train_state.TrainState`` is a pytree with optax's types
  intact; saved whole, its ``params`` are the default params and its ``tx`` the
  transformation.  ``TrainState.opt_state`` is plain optax state.

Anything else passes through unchanged.  Nothing here imports Flax unless the input is a
Flax object.
"""
from __future__ import annotations

__all__ = ["Plain", "plain_params", "plain_state", "save_inputs"]

import sys
from typing import Any, Callable, NamedTuple

import jax

from jaxguard.errors import CheckpointError, ConfigError
from jaxguard.optax_state import dotted

NO_TX = ("{what} is an nnx.State, which keeps the optimizer's arrays but not optax's types (ScaleByAdamState, "
         "the chain): pass tx=optimizer.tx so that they are rebuilt from the optimizer's own transformation")


class Plain(NamedTuple):
    """An optimizer state as jaxguard reads it."""

    state: Any                      # the optax pytree (types intact)
    params: Any                     # the params it belongs to by default (a TrainState's), else None
    tx: Any                         # the transformation it records (a TrainState's), else None
    back: Callable[[Any], Any]      # a restored plain state -> the caller's own form
    kind: str                       # "optax", "nnx" or "linen"
    optax_part: Callable[[Any], Any] = None   # the plain state -> the state tx.update takes (None: all of it)


def _nnx():
    """flax.nnx when the caller has imported it (else no object can be an NNX one), or None."""
    return sys.modules.get("flax.nnx")


def _is_nnx_state(x) -> bool:
    """An ``nnx.State``, or a dict holding NNX variables (what ``nnx.state`` returns once
    Flax replaces ``State`` by the built-in dict, as 0.12 announces)."""
    nnx = _nnx()
    if nnx is None:
        return False
    if isinstance(x, nnx.State):
        return True
    return isinstance(x, dict) and any(_is_variable(leaf) for leaf in jax.tree_util.tree_leaves(x, is_leaf=_is_variable))


def _pure_dict(state) -> dict:
    """An NNX state as nested dicts of arrays (variables unwrapped)."""
    nnx = _nnx()
    return nnx.to_pure_dict(state) if hasattr(nnx, "to_pure_dict") else state.to_pure_dict()


def _is_train_state(x) -> bool:
    ts = sys.modules.get("flax.training.train_state")
    return ts is not None and isinstance(x, ts.TrainState)


def _is_variable(x) -> bool:
    nnx = _nnx()
    return nnx is not None and isinstance(x, nnx.Variable)


def _identity(x):
    return x


def plain_params(params):
    """The params as a plain pytree of arrays.

    Args:
      params: a pytree; an ``nnx.State`` (``nnx.state(model, nnx.Param)``) or an
        ``nnx.Module`` (its ``nnx.Param`` state).

    Returns:
      The pytree, an NNX state as nested dicts of arrays (``State.to_pure_dict``).
    """
    nnx = _nnx()
    if nnx is not None:
        if isinstance(params, nnx.Module):
            params = nnx.state(params, nnx.Param)
        if _is_nnx_state(params):
            return _pure_dict(params)
    return params


def plain_state(tree, *, tx=None, params=None, typed: bool = True, what: str = "opt_state") -> Plain:
    """`tree` as an optax pytree, and the way back to its own form.

    Args:
      tree: optax state, an ``nnx.State`` of an ``nnx.Optimizer``, or a linen ``TrainState``.
      tx: the optimizer's transformation (``optimizer.tx``): required to save an
        ``nnx.State`` (its types are rebuilt from ``tx.init``).
      params: the params the state belongs to (any form `plain_params` reads): what
        ``tx.init`` is traced with.
      typed: rebuild optax's types (a save); a load matches leaves by path and does not
        need them.
      what: how to name `tree` in errors.

    Returns:
      A `Plain`: the optax pytree, a TrainState's params and tx, and ``back``, which
      turns a restored plain state (of the same structure) into `tree`'s form.

    Raises:
      ConfigError: an ``nnx.State`` to save without `tx` or `params`.
      CheckpointError: `tx.init` does not give the state's leaves (another transformation).
    """
    if _is_train_state(tree):
        return Plain(tree, tree.params, tree.tx, _identity, "linen", lambda st: st.opt_state)
    if not _is_nnx_state(tree):
        return Plain(tree, None, None, _identity, "optax")
    pure = _pure_dict(tree)
    part = (lambda st: st["opt_state"]) if isinstance(pure, dict) and "opt_state" in pure else None
    if typed:
        if tx is None or params is None:
            raise ConfigError(NO_TX.format(what=what) if tx is None else
                              f"{what} is an nnx.State: pass its params too (nnx.state(model, nnx.Param))")
        template = _template(tx, plain_params(params))
        if isinstance(pure, dict) and "opt_state" in pure:
            pure = {**pure, "opt_state": _retyped(pure["opt_state"], template, ("opt_state",))}
        else:
            pure = _retyped(pure, template, ())
    return Plain(pure, None, None, lambda restored: _as_nnx_state(restored, tree), "nnx", part)


def _template(tx, params):
    try:
        return jax.eval_shape(tx.init, params)
    except Exception as exc:  # noqa: BLE001 - a tx that cannot init these params: one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointError(f"tx.init(params) failed ({type(exc).__name__}: {first[:160]}); pass the optimizer's "
                              "own tx and the params it was built for") from None


def _retyped(pure, template, prefix: tuple):
    """The leaves of the nested dict `pure` in the optax structure of `template`, matched by
    dotted path (dict keys and tuple indices name a leaf alike), checked for shape and dtype."""
    have = {dotted(p): x for p, x in jax.tree_util.tree_flatten_with_path(pure)[0]}
    want, treedef = jax.tree_util.tree_flatten_with_path(template)
    where = ".".join(map(str, prefix)) or "the state"
    names = [dotted(p) for p, _ in want]
    missing = [n for n in names if n not in have]
    extra = sorted(set(have) - set(names))
    if missing or extra:
        first = f"tx.init(params) has a leaf {missing[0]!r} that {where} lacks" if missing else \
            f"{where} has a leaf {extra[0]!r} that tx.init(params) lacks"
        raise CheckpointError(f"{first}: pass the optimizer's own tx (optimizer.tx) and the params it was built for")
    out = []
    for name, (_, spec) in zip(names, want):
        x = have[name]
        shape, dtype = tuple(getattr(x, "shape", ())), getattr(x, "dtype", None)
        if shape != tuple(spec.shape) or (dtype is not None and dtype != spec.dtype):
            raise CheckpointError(f"{where}.{name} is {dtype}{list(shape)} but tx.init(params) gives "
                                  f"{spec.dtype}{list(spec.shape)}: pass the optimizer's own tx and params")
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def _as_nnx_state(restored, like):
    """`like` (an ``nnx.State``) with each variable's value replaced by the leaf of
    `restored` at the same dotted path (new variables: `like` is left as it was)."""
    values = {dotted(p): x for p, x in jax.tree_util.tree_flatten_with_path(restored)[0]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(like, is_leaf=_is_variable)
    out = []
    for path, leaf in flat:
        new = values[dotted(path)]
        out.append(leaf.replace(new) if _is_variable(leaf) else new)
    return jax.tree_util.tree_unflatten(treedef, out)


def save_inputs(opt_state, params=None, tx=None, *, what: str = "opt_state") -> tuple:
    """What a save reads, from what the caller holds: ``(optax state, params, tx)``.

    Args:
      opt_state, params, tx: as given to `jaxguard.save` (params and tx may be None for a
        linen ``TrainState``, which holds both).

    Returns:
      The plain optax state, the plain params and the transformation (None when neither
      the caller nor the state gives one), whose ``update`` takes the whole plain state
      when its optax part is a field of it (a TrainState's ``opt_state``).

    Raises:
      CheckpointError: no params and none in the state.
      ConfigError, CheckpointError: as `plain_state`.
    """
    view = plain_state(opt_state, tx=tx, params=params, what=what)
    params = view.params if params is None else params
    if params is None:
        raise CheckpointError(f"no params for {what}: pass params= (the params the optimizer state belongs to, the "
                              "next update's p; nnx.state(model, nnx.Param) for NNX)")
    tx = tx if tx is not None else view.tx
    if tx is not None and view.optax_part is not None:
        tx = _on_part(tx, view.optax_part)
    return view.state, plain_params(params), tx


def _on_part(tx, part):
    """`tx` applied to the optax part of a larger state (a TrainState, an NNX optimizer's
    state): what reads the next update from ``tx.update`` gets the updates of that part."""
    import optax

    def update(updates, state, params=None, **extra):
        return tx.update(updates, part(state), params, **extra)[0], state

    return optax.GradientTransformation(tx.init, update)
