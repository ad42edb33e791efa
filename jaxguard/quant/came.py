"""CAME (Luo et al., ACL 2023) in optax style; optax has none.

Follows ``came_pytorch.CAME`` 0.1.3 (the authors' reference) operation for operation:

.. math::
   u_t &= g_t^2 + \\epsilon_1 \\\\
   R_t &= \\beta_2 R_{t-1} + (1-\\beta_2)\\,\\mathrm{mean}_{-1}(u_t),\\quad
   C_t = \\beta_2 C_{t-1} + (1-\\beta_2)\\,\\mathrm{mean}_{-2}(u_t) \\\\
   \\hat u_t &= g_t \\odot \\frac{1}{\\sqrt{R_t/\\mathrm{mean}(R_t)}}\\frac{1}{\\sqrt{C_t}}
              \\;/\\; \\max(1, \\mathrm{RMS}(\\cdot)/d) \\\\
   m_t &= \\beta_1 m_{t-1} + (1-\\beta_1)\\hat u_t,\\quad
   U_t = (\\hat u_t - m_t)^2 + \\epsilon_2 \\\\
   S^R_t, S^C_t &= \\text{factored EMAs of } U_t \\text{ with } \\beta_3 \\\\
   p_t &= p_{t-1} - \\eta\\lambda p_{t-1} - \\eta\\, m_t \\odot \\widehat{S_t}^{-1/2}

Parameters with fewer than two dimensions keep an unfactored ``v`` and use ``m_t``
directly (no confidence factor), as the reference does.  State fields: ``mu`` (signed),
``v_row``, ``v_col``, ``v``, ``res_row``, ``res_col`` (non-negative), so
:func:`jaxguard.quant.quantized` can choose a code per field.  Unused fields hold a
``(1,)`` placeholder (the optax adafactor convention).
"""
from __future__ import annotations

from typing import NamedTuple, Union

import jax
import jax.numpy as jnp
import optax

from jaxguard.errors import ConfigError

__all__ = ["came", "scale_by_came", "CameState"]


class CameState(NamedTuple):
    """State of `scale_by_came` (the module docstring has the algorithm).

    Fields, float32 per parameter: ``count`` (int32 steps taken), ``mu`` (signed first
    moment, the parameter's shape), ``v_row``/``v_col`` (factored second-moment EMAs for
    parameters of >= 2 dims), ``v`` (the unfactored one otherwise), ``res_row``/``res_col``
    (factored EMAs of the confidence residual); unused fields hold a ``(1,)`` placeholder.
    """
    count: jax.Array
    mu: optax.Updates
    v_row: optax.Updates
    v_col: optax.Updates
    v: optax.Updates
    res_row: optax.Updates
    res_col: optax.Updates


def _factored(shape) -> bool:
    return len(shape) >= 2


def _approx(row, col):
    r = jax.lax.rsqrt(row / jnp.mean(row, axis=-1, keepdims=True))[..., None]
    c = jax.lax.rsqrt(col)[..., None, :]
    return r * c


def _rms(x):
    return jnp.linalg.norm(x.ravel()) / jnp.sqrt(jnp.float32(x.size))


def scale_by_came(b1: float = 0.9, b2: float = 0.999, b3: float = 0.9999,
                  eps1: float = 1e-30, eps2: float = 1e-16,
                  clip_threshold: float = 1.0) -> optax.GradientTransformation:
    """CAME's update direction (before the learning rate and weight decay).

    Args:
      b1: decay of the first moment ``mu``.
      b2: decay of the factored second moment.
      b3: decay of the confidence residual's EMAs.
      eps1: added to ``g**2`` before the second moment.
      eps2: added to the residual ``(u - mu)**2``.
      clip_threshold: d in the update clipping ``u / max(1, RMS(u) / d)``.

    Returns:
      An ``optax.GradientTransformation`` whose state is a `CameState`.

    Raises:
      ConfigError: a beta outside [0, 1].
    """
    for name, b in (("b1", b1), ("b2", b2), ("b3", b3)):
        if not 0.0 <= b <= 1.0:
            raise ConfigError(f"{name}={b!r} is outside [0, 1]; CAME's defaults are (0.9, 0.999, 0.9999)")

    def init_fn(params):
        def zeros_if(pred, shape_fn):
            return lambda p: jnp.zeros(shape_fn(p.shape) if pred(p.shape) else (1,), jnp.float32)
        fac = _factored
        return CameState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params),
            v_row=jax.tree.map(zeros_if(fac, lambda s: s[:-1]), params),
            v_col=jax.tree.map(zeros_if(fac, lambda s: s[:-2] + s[-1:]), params),
            v=jax.tree.map(zeros_if(lambda s: not fac(s), lambda s: s), params),
            res_row=jax.tree.map(zeros_if(fac, lambda s: s[:-1]), params),
            res_col=jax.tree.map(zeros_if(fac, lambda s: s[:-2] + s[-1:]), params),
        )

    def update_fn(updates, state, params=None):
        del params

        def one(g, mu, vr, vc, v, rr, rc):
            g = g.astype(jnp.float32)
            u = g * g + eps1
            if _factored(g.shape):
                vr = b2 * vr + (1.0 - b2) * jnp.mean(u, axis=-1)
                vc = b2 * vc + (1.0 - b2) * jnp.mean(u, axis=-2)
                u = _approx(vr, vc) * g
            else:
                v = b2 * v + (1.0 - b2) * u
                u = jax.lax.rsqrt(v) * g
            u = u / jnp.maximum(_rms(u) / clip_threshold, 1.0)
            mu = b1 * mu + (1.0 - b1) * u
            if _factored(g.shape):
                res = (u - mu) ** 2 + eps2
                rr = b3 * rr + (1.0 - b3) * jnp.mean(res, axis=-1)
                rc = b3 * rc + (1.0 - b3) * jnp.mean(res, axis=-2)
                out = _approx(rr, rc) * mu
            else:
                out = mu
            return out, mu, vr, vc, v, rr, rc

        treedef = jax.tree.structure(updates)
        leaves = [treedef.flatten_up_to(t) for t in
                  (updates, state.mu, state.v_row, state.v_col, state.v, state.res_row, state.res_col)]
        res = [one(*xs) for xs in zip(*leaves)]
        cols = [treedef.unflatten([r[i] for r in res]) for i in range(7)]
        return cols[0], CameState(optax.safe_increment(state.count), *cols[1:])

    return optax.GradientTransformation(init_fn, update_fn)


def came(learning_rate: Union[float, optax.Schedule], b1: float = 0.9, b2: float = 0.999,
         b3: float = 0.9999, eps1: float = 1e-30, eps2: float = 1e-16,
         clip_threshold: float = 1.0, weight_decay: float = 0.0) -> optax.GradientTransformation:
    """CAME with decoupled weight decay ``p -= lr * wd * p`` (as ``came_pytorch``).

    Args:
      learning_rate: a float or an optax schedule of the step count.
      b1, b2, b3, eps1, eps2, clip_threshold: as `scale_by_came`.
      weight_decay: the decoupled decay ``wd`` (params must be passed to ``update``
        when it is nonzero).

    Returns:
      ``optax.chain(scale_by_came(...), add_decayed_weights(wd), scale_by_learning_rate(lr))``.

    Raises:
      ConfigError: as `scale_by_came`.
    """
    return optax.chain(
        scale_by_came(b1, b2, b3, eps1, eps2, clip_threshold),
        optax.add_decayed_weights(weight_decay),
        optax.scale_by_learning_rate(learning_rate),
    )
