"""Reading the next update's hyperparameters from the optax transformation itself.

An optax state does not record everything its next update uses: ``optax.adamw``'s
weight decay and mask, a schedule's rate at the state's count, the betas and eps of a
``scale_by_adam`` (closure constants), whether it is Nesterov's variant.  `probe` asks the
transformation: it evaluates the real ``tx.update`` (one jitted call) on copies of the
state whose Adam moments and gradients are replaced by designed values, with everything
else (counts, schedules' states, ``inject_hyperparams`` values, masks, labels) left as
saved, and compares each parameter's update with the op model's prediction
(``optax.scale_by_adam`` + ``add_decayed_weights`` + ``scale_by_learning_rate``, written
with the same jnp operations):

* ``decay``: moments 0, gradient 0, params 1: the update is ``-lr wd`` (the Adam
  direction is exactly 0), so it gives ``lr * wd`` of every leaf (0 where a mask leaves
  it out);
* ``rate``: moments 1, a gradient of ``2**-20`` on every coordinate (so that ``b1 = 0``
  still moves), params 0: ``-lr`` times the predicted direction, so it gives ``lr`` of
  every leaf;
* ``eps``: ``mu`` small, ``nu`` 0: the direction is ``mu / eps`` (checks eps);
* ``gradient``: moments 0, a gradient of 1e-4 on one coordinate of every leaf (global
  norm ~1e-4 sqrt(leaves), below any sane clipping): checks ``1 - b1``, ``1 - b2`` and
  the bias corrections of a gradient, which Nesterov's variant changes;
* ``state``: the saved moments and params, gradient 0: the whole prediction on real data.

Every leaf's rate and decay must be uniform over the leaf and every probe must agree with
the prediction to `TOL` (relative) on every coordinate; otherwise the transformation is
refused in one line (an Adam variant the op model does not cover, betas or eps other than
the candidates, a rate that varies within a leaf, ...).

Numerical contract
------------------
This is a check by examples, not a proof over all inputs: it establishes the learning
rate and weight decay of every leaf (to a few ulps, from the ``rate`` and ``decay``
probes) and that ``tx.update`` reproduces the op model's update to `TOL` on the probes.
The learning rate is then certified as the interval ``lr (1 -+ LR_HALF_WIDTH)``
(`jaxguard.core.bound.pack_interval`), which covers the rate ``tx`` uses although it is
known only to a few ulps; the weight decay is widened by ``LR_HALF_WIDTH`` (every term
of the bound grows with it); the betas and eps are the candidates the probes confirmed.
"""
from __future__ import annotations

__all__ = ["TOL", "LR_HALF_WIDTH", "PROBE_WORDS", "Candidates", "probe"]

import functools
import itertools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

TOL = 2.0**-16               # relative gap allowed between tx.update and the prediction (fusion, pow)
LR_HALF_WIDTH = 2.0**-14     # an lr read from tx is certified on [lr (1 - w), lr (1 + w)]
GRADIENT = 1e-4              # the `gradient` probe's value on one coordinate of every leaf
RATE_GRADIENT = 2.0**-20     # the `rate` probe's gradient on every coordinate (global norm ~1e-6 sqrt(coordinates))
SMALL_MU = 1e-6              # the `eps` probe's mu
FLOOR = 2.0**-100            # absolute slack of the comparison (flush-to-zero of tiny updates)
PROBES = ("eps", "gradient", "state")
PROBE_WORDS = {"eps": "with nu = 0 (eps)", "gradient": "with a small gradient (1 - b1, 1 - b2, Nesterov)",
               "state": "on the saved moments (the whole update)"}


class Candidates(NamedTuple):
    """The betas and eps a site is checked with (Python floats, or float32 arrays where
    ``inject_hyperparams`` holds them: optax then computes ``1 - b`` in float32)."""

    b1: Any
    b2: Any
    eps: Any


class LeafReading(NamedTuple):
    """What the probes read for one parameter leaf of one Adam site."""

    lr: float            # the next update's learning rate (a few ulps)
    lr_wd: float         # lr * weight decay
    uniform: bool        # the rate and the decay are the same on every coordinate
    gaps: dict           # probe -> max relative gap to the prediction (inf: not finite where predicted)


def _adam_states(opt_state) -> list:
    """The `ScaleByAdamState`s of `opt_state` in flattening order (`find_adam_states`' order)."""
    return [x for x in jax.tree_util.tree_leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
            if isinstance(x, optax.ScaleByAdamState)]


def _replace_sites(opt_state, fn):
    """`opt_state` with every `ScaleByAdamState` replaced by ``fn(state)``."""
    return jax.tree_util.tree_map(lambda x: fn(x) if isinstance(x, optax.ScaleByAdamState) else x,
                                  opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))


def _direction(g, mu, nu, count, c: Candidates):
    """The op model's ``scale_by_adam`` direction, with optax's own jnp operations."""
    mu1 = (1 - c.b1) * g + c.b1 * mu
    nu1 = (1 - c.b2) * (g ** 2) + c.b2 * nu
    t = count + 1
    bc1, bc2 = 1 - c.b1 ** t, 1 - c.b2 ** t
    return (mu1 / bc1.astype(mu1.dtype)) / (jnp.sqrt(nu1 / bc2.astype(nu1.dtype)) + c.eps)


def _first(x):
    return x.reshape(-1)[0]


def _gap(real, pred, scale):
    """Max gap over a leaf relative to `scale` (the magnitudes the update sums: a direction
    and a decay that cancel leave a small update whose relative error says nothing);
    coordinates whose prediction is not finite are skipped (a non-finite saved moment
    escapes exactly); a finite prediction against a non-finite update is an infinite gap."""
    real, pred = real.astype(jnp.float32), pred.astype(jnp.float32)
    gap = jnp.abs(real - pred) / (scale + FLOOR)
    gap = jnp.where(real == pred, 0.0, jnp.where(jnp.isfinite(real), gap, jnp.inf))
    return jnp.max(jnp.where(jnp.isfinite(pred), gap, 0.0), initial=0.0)


def _one_coordinate(shape, value):
    """`value` on the first coordinate (``-value/1000`` on the second), 0 elsewhere."""
    n = int(np.prod(shape, dtype=np.int64))
    flat = jnp.zeros((n,), jnp.float32).at[0].set(value)
    if n > 1:
        flat = flat.at[1].set(-value * 1e-3)
    return flat.reshape(shape)


def _by_dotted(tree) -> dict:
    from jaxguard.optax_state.paths import dotted
    return {dotted(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _run(tx_update, opt_state, params, cands, owners):
    """All probes in one program.  `owners`: per params leaf (flattening order) ``(site,
    dotted path)`` of the Adam site holding its moments, or None.  Returns per leaf
    ``(lr_wd, rate, uniform, gaps)`` (None for a leaf no site holds)."""
    leaves, tdef = jax.tree_util.tree_flatten(params)
    shapes = [jnp.shape(x) for x in leaves]
    zeros = [jnp.zeros(sh, jnp.float32) for sh in shapes]
    ones = [jnp.ones(sh, jnp.float32) for sh in shapes]
    sites = _adam_states(opt_state)

    def with_moments(mu_fn, nu_fn):
        return _replace_sites(opt_state, lambda s: s._replace(
            mu=jax.tree.map(lambda m: mu_fn(m).astype(m.dtype), s.mu),
            nu=jax.tree.map(lambda v: nu_fn(v).astype(v.dtype), s.nu)))

    def update(state, grads, ps):
        u, _ = tx_update(jax.tree_util.tree_unflatten(tdef, grads), state, jax.tree_util.tree_unflatten(tdef, ps))
        return tdef.flatten_up_to(u)

    p32 = [jnp.asarray(x, jnp.float32) for x in leaves]
    zmom = with_moments(jnp.zeros_like, jnp.zeros_like)
    u_decay = update(zmom, zeros, ones)
    g_rate = [jnp.full(sh, RATE_GRADIENT, jnp.float32) for sh in shapes]
    u_rate = update(with_moments(jnp.ones_like, jnp.ones_like), g_rate, zeros)
    u_eps = update(with_moments(lambda m: jnp.full_like(m, SMALL_MU), jnp.zeros_like), zeros, zeros)
    g_small = [_one_coordinate(sh, GRADIENT) for sh in shapes]
    u_grad = update(zmom, g_small, zeros)
    u_state = update(opt_state, zeros, p32)
    mus = [_by_dotted(s.mu) for s in sites]
    nus = [_by_dotted(s.nu) for s in sites]
    out = []
    for li, owner in enumerate(owners):
        if owner is None:
            out.append(None)
            continue
        si, name = owner
        c, count, mu, nu = cands[si], sites[si].count, mus[si][name], nus[si][name]
        lr_wd = -_first(u_decay[li])
        d_rate = _direction(jnp.full((), RATE_GRADIENT, jnp.float32), jnp.ones((), mu.dtype), jnp.ones((), jnp.float32),
                            count, c)
        rate = -_first(u_rate[li]) / d_rate
        uniform = jnp.all(u_decay[li] == _first(u_decay[li])) & jnp.all(u_rate[li] == _first(u_rate[li]))
        wd = jnp.where(rate != 0, lr_wd / jnp.where(rate != 0, rate, 1.0), 0.0)

        def gap(real, g, m, v, p):
            d = _direction(g, m, v, count, c)
            return _gap(real, (d + wd * p) * (-rate), (jnp.abs(d) + jnp.abs(wd * p)) * jnp.abs(rate))

        z = zeros[li]
        gaps = {"eps": gap(u_eps[li], z, jnp.full(shapes[li], SMALL_MU, mu.dtype), z, z),
                "gradient": gap(u_grad[li], g_small[li], jnp.zeros(shapes[li], mu.dtype), z, z),
                "state": gap(u_state[li], z, mu, nu, p32[li])}
        out.append((lr_wd, rate, uniform, gaps))
    return out


def probe(tx, opt_state, params, owners: list, candidates: list) -> list:
    """Evaluate `tx.update` on the probe states (module docstring).

    Args:
      tx: the optax transformation the state belongs to.
      opt_state: the state (any tree holding `optax.ScaleByAdamState`s).
      params: the params the state belongs to.
      owners: per params leaf (flattening order), ``(site index, dotted name)``: the
        Adam site (`jaxguard.optax_state.find_adam_states` order) whose moments it has and
        the leaf's dotted path in them, or None.
      candidates: per Adam site, its `Candidates` (betas and eps to check).

    Returns:
      Per params leaf, a `LeafReading` (None for a leaf no Adam site holds).
    """
    # static: optax computes 1 - b in double for Python betas, in float32 for inject_hyperparams' arrays
    cands = tuple(Candidates(*(np.float32(x) if isinstance(x, (jax.Array, np.ndarray, np.floating)) else float(x)
                               for x in c)) for c in candidates)
    out = _run(tx.update, opt_state, params, cands, tuple(None if o is None else (int(o[0]), str(o[1]))
                                                        for o in owners))
    readings = []
    for r in out:
        if r is None:
            readings.append(None)
            continue
        lr_wd, rate, uniform, gaps = jax.device_get(r)
        readings.append(LeafReading(float(rate), float(lr_wd), bool(uniform), {k: float(v) for k, v in gaps.items()}))
    return readings
