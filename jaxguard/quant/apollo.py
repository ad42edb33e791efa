"""APOLLO (Zhu et al., MLSys 2025) in optax style; optax has none.

Follows ``apollo_torch.APOLLOAdamW`` 1.0.3 with its random projector (``proj="random"``,
``proj_type="std"``): for a 2-D parameter ``G`` of shape (m, n) and rank r,

* every ``update_proj_gap`` steps (from step 0) draw ``P ~ N(0, 1/r)``: shape (r, n) if
  ``m >= n`` (``R = G P^T``, shape (m, r)) else (m, r) (``R = P^T G``, shape (r, n));
* Adam moments ``mu``/``nu`` live in the projected space (HF-style: ``eps`` added to
  ``sqrt(nu)``, step size ``lr * sqrt(1-b2^t) / (1-b1^t)``);
* scaling factor ``s = ||N||/(||R|| + 1e-8)`` per channel (norms over the rank axis) or per
  tensor (``scale_type="tensor"``, APOLLO-Mini), ``N = mu / (sqrt(nu) + eps)``;
* update ``G * s``, norm-growth limiter (Fira): divide by ``max(||.||/(prev + 1e-8), 1.01)/1.01``
  after the first step, times ``sqrt(scale)``;
* weight decay after the step: ``p <- (p - step) * (1 - lr * wd)``.

Other parameters (not 2-D, or ``min(m, n) <= rank``) take the same HF-style AdamW.
The projection is drawn with ``jax.random`` (the reference uses torch's generator), so runs
match the reference only when the same matrix is supplied: ``projection(key, shape)`` is a
hook for that (tests pass the reference's matrix).
State fields: ``mu`` (signed), ``nu`` (non-negative) -- small (m x r) tensors -- plus the
projection ``proj`` and the limiter's previous norm ``prev_norm``.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import jax
import jax.numpy as jnp
import optax

from jaxguard.errors import ConfigError

__all__ = ["apollo", "ApolloState"]


class ApolloState(NamedTuple):
    """State of `apollo` (the module docstring has the algorithm).

    Fields: ``count`` (int32 steps taken), ``key`` (the PRNG key the projections are
    drawn from), ``mu``/``nu`` (float32 Adam moments, in the projected (m, r) or (r, n)
    space for projected parameters, else the parameter's shape), ``proj`` (the current
    projection matrix, ``(1,)`` for unprojected parameters) and ``prev_norm`` (the norm
    limiter's previous update norm, a float32 scalar per parameter).
    """
    count: jax.Array
    key: jax.Array
    mu: optax.Updates
    nu: optax.Updates
    proj: optax.Updates
    prev_norm: optax.Updates


def _projected(shape, rank) -> bool:
    return len(shape) == 2 and min(shape) > rank


def _proj_shape(shape, rank):
    m, n = shape
    return (rank, n) if m >= n else (m, rank)


def _low_shape(shape, rank):
    m, n = shape
    return (m, rank) if m >= n else (rank, n)


def apollo(learning_rate: Union[float, optax.Schedule], rank: int = 256, *,
           b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6, weight_decay: float = 0.0,
           scale: float = 1.0, scale_type: str = "channel", update_proj_gap: int = 200,
           seed: int = 0,
           projection: Optional[Callable] = None) -> optax.GradientTransformation:
    """APOLLO-AdamW (module docstring), as ``apollo_torch.APOLLOAdamW`` with ``proj="random"``.

    Args:
      learning_rate: a float or an optax schedule of the step count.
      rank: the projection rank r; 2-D parameters with ``min(m, n) > rank`` are projected.
      b1, b2: Adam's moment decays.
      eps: added to ``sqrt(nu)`` (HF style).
      weight_decay: decoupled decay after the step, ``p <- (p - step) * (1 - lr * wd)``;
        nonzero needs ``params`` in ``update``.
      scale: the update is multiplied by ``sqrt(scale)`` for projected parameters.
      scale_type: ``"channel"`` (norms per channel) or ``"tensor"`` (APOLLO-Mini).
      update_proj_gap: steps between fresh projections (drawn at step 0, gap, 2 gap, ...).
      seed: seed of the projection key.
      projection: ``projection(key, shape) -> float32 matrix`` overrides the N(0, 1/r)
        draw (the tests pass the reference's matrix).

    Returns:
      An ``optax.GradientTransformation`` whose state is an `ApolloState`.

    Raises:
      ConfigError: an unknown scale_type, a rank that is not a positive int, or
        update_proj_gap < 1.
    """
    if scale_type not in ("channel", "tensor"):
        raise ConfigError(f"scale_type={scale_type!r} is unknown; use 'channel' or 'tensor' (APOLLO-Mini)")
    if not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"rank={rank!r} must be a positive int")
    if update_proj_gap < 1:
        raise ConfigError(f"update_proj_gap={update_proj_gap!r} must be >= 1")
    if projection is None:
        def projection(key, shape):
            return jax.random.normal(key, shape, jnp.float32) / jnp.sqrt(jnp.float32(rank))

    def init_fn(params):
        def mom(p):
            return jnp.zeros(_low_shape(p.shape, rank) if _projected(p.shape, rank) else p.shape, jnp.float32)
        return ApolloState(
            count=jnp.zeros([], jnp.int32),
            key=jax.random.PRNGKey(seed),
            mu=jax.tree.map(mom, params), nu=jax.tree.map(mom, params),
            proj=jax.tree.map(lambda p: jnp.zeros(_proj_shape(p.shape, rank) if _projected(p.shape, rank)
                                                  else (1,), jnp.float32), params),
            prev_norm=jax.tree.map(lambda p: jnp.zeros([], jnp.float32), params),
        )

    def update_fn(updates, state, params=None):
        if weight_decay != 0.0 and params is None:
            raise ConfigError("apollo with weight_decay needs params in update(); pass params=params")
        count = state.count
        t = (count + 1).astype(jnp.float32)
        lr = learning_rate(count) if callable(learning_rate) else learning_rate
        step_size = lr * jnp.sqrt(1.0 - b2 ** t) / (1.0 - b1 ** t)
        refresh = (count % update_proj_gap) == 0
        treedef = jax.tree.structure(updates)
        flat_g = treedef.flatten_up_to(updates)
        flat = [treedef.flatten_up_to(x) for x in (state.mu, state.nu, state.proj, state.prev_norm)]
        flat_p = treedef.flatten_up_to(params) if params is not None else [None] * len(flat_g)
        keys = jax.random.split(jax.random.fold_in(state.key, count), len(flat_g))
        out = []
        for i, (g, mu, nu, P, prev, p) in enumerate(zip(flat_g, *flat, flat_p)):
            g = g.astype(jnp.float32)
            if _projected(g.shape, rank):
                P = jnp.where(refresh, projection(keys[i], P.shape).astype(jnp.float32), P)
                tall = g.shape[0] >= g.shape[1]
                R = g @ P.T if tall else P.T @ g
                mu = b1 * mu + (1.0 - b1) * R
                nu = b2 * nu + (1.0 - b2) * R * R
                N = mu / (jnp.sqrt(nu) + eps)
                if scale_type == "channel":
                    ax = 1 if tall else 0
                    s = jnp.linalg.norm(N, axis=ax) / (jnp.linalg.norm(R, axis=ax) + 1e-8)
                    s = s[:, None] if tall else s[None, :]
                else:
                    s = jnp.linalg.norm(N) / (jnp.linalg.norm(R) + 1e-8)
                sg = g * s
                nrm = jnp.linalg.norm(sg)
                limiter = jnp.where(count == 0, 1.0, jnp.maximum(nrm / (prev + 1e-8), 1.01) / 1.01)
                sg = sg / limiter
                prev = nrm / limiter
                d = sg * jnp.sqrt(jnp.float32(scale))
            else:
                mu = b1 * mu + (1.0 - b1) * g
                nu = b2 * nu + (1.0 - b2) * g * g
                d = mu / (jnp.sqrt(nu) + eps)
            u = -step_size * d
            if weight_decay != 0.0:
                u = u - lr * weight_decay * (p + u)
            out.append((u, mu, nu, P, prev))
        cols = [treedef.unflatten([o[i] for o in out]) for i in range(5)]
        return cols[0], ApolloState(optax.safe_increment(count), state.key, *cols[1:])

    return optax.GradientTransformation(init_fn, update_fn)
