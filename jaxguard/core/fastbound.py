"""A closed-form sufficient test: the first tier of the guard, before the cell partition.

`fast_bound` bounds, for one coordinate and *all* gradients ``|g| <= clip`` at once,
the same quantity as `jaxguard.core.bound.coordinate_bound`: ``sup |p1' - p2'|``, the
difference of the two native float32 updates (original and decoded moments) under any
variant of the pinned operation model.  It costs a few dozen float32 operations per
coordinate (no partition, no per-cell loop), so it certifies the bulk of a trained
state; whatever it does not certify goes on to the cell partition (`jaxguard.core.guard`),
which remains the reference.  Derivation: docs/bound.md section 7.

Stage 1 (ideal).  With ``r_i(g) = sqrt(b2f v_i + c2 g^2)``, ``d_i = r_i/B + eps`` and the
difference form of `jaxguard.core.bound`, ``|s1 - s2|/S <= |A| + |m2| |F|``, every factor
evaluated at ``g = 0`` except ``|m2| <= keep|m~| + a|g|``, whose ``a|g|`` part is
absorbed by ``a|g|/d2 <= a B/sqrt(c2)`` or by ``a|g|/(r1 + r2) <= a/(2 sqrt(c2))``
(the smaller of the two is taken):

    T1 = keep|dm|/d1(0)
    T2 = keep|m~| b2f|dv| / (B (r1+r2)(0) d1(0) d2(0))
    T3 = min( a b2f|dv| / (sqrt(c2) (r1+r2)(0) d1(0)),  a b2f|dv| / (2 sqrt(c2) B d1(0) d2(0)) )

Stage 2 (native) is `jaxguard.core.bound._native_allowance` on the single cell ``[0, clip]``
with ``|m|`` (which covers both signs of ``g``), plus the final ``p + step`` rounding
with the decayed parameter ``max(|p|, |1 - lr wd| |p|)``.

Numerical contract
------------------
`fast_bound` returns ``(bound, usable)``: where ``usable`` is True, ``bound`` is a
finite float32 number ``>=`` the supremum above; where it is False the coordinate must
go to the cell partition (it is never certified by this tier).  ``usable`` is False
unless every input magnitude is ``<= 2**60``, ``eps >= 2**-60``, and every float32
intermediate of the closed form is either exactly zero for an exact reason (``m == m~``,
``v == v~``, ``m~ == 0``, ``v == 0``, ``keep == 0``) or lies in ``[2**-100, 2**100]``:
so no intermediate is subnormal or flushed, each operation has relative error ``<= u``
(sqrt ``<= 8u``; division or reciprocal-multiply ``<= 2u``), and the widening by
``bound.GAMMA`` (> 40u accumulated on the longest chain) makes the computed stage 1
an upper bound of the exact one.  Inputs are the guard's candidates: finite, ``v, v~ >=
0``, nonzero moments ``>= 2**-80`` (`jaxguard.core.guard` escapes every other coordinate).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxguard.core import bound as _bound

U = _bound.U
SAFE_HI = 2.0**60            # inputs above this go to the cell partition
INTER_LO = 2.0**-100         # nonzero intermediates must stay in [INTER_LO, INTER_HI]
INTER_HI = 2.0**100
EPS_LO = 2.0**-60


def _in_range(x, exact_zero):
    return exact_zero | ((x >= INTER_LO) & (x <= INTER_HI))


def fast_bound(k, m, v, mt, vt, pabs, clip, *, no_radius=False):
    """Elementwise closed-form bound over ``|g| <= clip`` (see the module contract).

    Args:
      k: a `bound.StepRow` (`bound.pack_constants`) whose fields broadcast against the
        coordinates: each is a scalar or an array shaped like ``m``.
      m, v, mt, vt: original and decoded moments (float32, certifiable).
      pabs: ``|p|``; clip: gradient bound per coordinate (coupled decay already folded in).
      no_radius: ideal stage only (for the enclosure audit's detection check).

    Returns:
      ``(bound, usable)``: float32 bound and a boolean mask; only ``usable`` bounds count.
    """
    k = _bound.as_step_row(k)
    keep, a, b2f, c2, S, B, eps = k.keep, k.a, k.b2f, k.c2, k.S, k.B, k.eps
    lr, wd = k.lr, k.weight_decay
    dm = jnp.abs(m - mt)
    dv = jnp.abs(v - vt)
    zm, zv, zmt, zk = dm == 0, dv == 0, mt == 0, keep == 0
    r1 = jnp.sqrt(b2f * v)
    r2 = jnp.sqrt(b2f * vt)
    d1 = r1 / B + eps
    d2 = r2 / B + eps
    rs = jnp.where(zv, 1.0, r1 + r2)        # > 0 wherever v != v~ (one of them is >= 2**-80)
    n1 = keep * dm
    t1 = n1 / d1
    w = b2f * dv
    q1 = w / d1
    q2 = q1 / rs
    q3 = q1 / (B * d2)
    sc = jnp.sqrt(c2)
    t3 = jnp.minimum(q2 * (a / sc), q3 * (a / (2 * sc)))
    nk = keep * jnp.abs(mt)
    t2 = nk * (q2 / (B * d2))
    ideal = S * ((t1 + t2 + t3) * (1 + _bound.GAMMA)) * (1 + 4 * U)
    usable = ((jnp.abs(m) <= SAFE_HI) & (jnp.abs(mt) <= SAFE_HI) & (v <= SAFE_HI) & (vt <= SAFE_HI)
              & (pabs <= SAFE_HI) & (clip <= SAFE_HI) & (eps >= EPS_LO) & (S <= SAFE_HI))
    zdv = zv
    for x, z in ((n1, zm | zk), (t1, zm | zk), (w, zdv), (q1, zdv), (q2, zdv), (q3, zdv),
                 (q2 * (a / sc), zdv), (q3 * (a / (2 * sc)), zdv), (nk, zmt | zk), (t2, zmt | zk | zdv),
                 (ideal, (zm | zk) & zdv),
                 (r1, v == 0), (r2, vt == 0), (d1, False), (d2, False), (rs, False), (B * d2, False)):
        usable &= _in_range(x, z)
    if no_radius:
        return ideal, usable & (ideal >= 0) & (ideal <= INTER_HI)
    const_rel = k.const_rel
    bs = B / sc                                              # sup |g|/d(g) <= B/sqrt(c2)
    al1, s1 = _native_sup(k, jnp.abs(m), d1, bs, const_rel, pabs)
    al2, s2 = _native_sup(k, jnp.abs(mt), d2, bs, const_rel, pabs)
    usable &= (bs * (24 * U) >= 2.0**-80) & (a * bs >= 2.0**-80) & (const_rel <= 0.25)
    usable &= 4e-19 / (B * jnp.minimum(d1, d2)) <= 0.25        # so rho <= 0.5 in `_native_sup`
    for x in (al1, al2, s1, s2):      # never legitimately zero (E > 0): flushed would under-count
        usable &= _in_range(x, False)
    pdec = pabs * jnp.maximum(1.0, jnp.abs(1 - lr * wd))   # torch-adamw decays p first
    final = 2 * U * (pdec + _bound.N_MIN + jnp.maximum(s1 + al1, s2 + al2)) + 2.0**-148
    total = (ideal + al1 + al2 + final) * (1 + 4 * U)
    usable &= (total >= 0) & (total <= INTER_HI)            # NaN fails both
    return total, usable


def _native_sup(k, mabs, d0, bs, const_rel, pabs):
    """Stage 2 for one branch over all ``|g| <= clip``: (allowance, sup|s|).

    `jaxguard.core.bound._native_allowance` at a single gradient ``g`` (a degenerate cell),
    with its ``g``-dependent factors bounded over the whole range: ``rho_d(g) <=
    rho_d(0)``, ``1/d(g) <= 1/d(0)`` and ``|g|/d(g) <= B/sqrt(c2)`` (``bs``), so that
    ``e_m(g)/d(g) <= E`` and ``|m'(g)|/d(g) <= Mq`` (docs/bound.md section 7)."""
    k = _bound.as_step_row(k)
    keep, a, S, B, lr, wd = k.keep, k.a, k.S, k.B, k.lr, k.weight_decay
    rho = 64 * U + const_rel + 4e-19 / (B * d0)             # the caller checks rho <= 0.5
    E = (48 * U * mabs + 12 * _bound.N_MIN) / d0 + 24 * U * bs
    Mq = keep * mabs / d0 + a * bs
    inv = S / (1 - rho)
    s_max = inv * (Mq + E)
    alloc = inv * (E + (Mq + E) * (rho + 24 * U + const_rel))
    flag = k.decay_in_update                                             # optax-adamw: wd*p inside the update
    alloc = alloc + flag * (16 * U * (s_max + lr * wd * pabs))
    s_max = s_max + flag * (lr * wd * pabs)
    return alloc * (1 + 2.0**-16), s_max


@functools.partial(jax.jit, static_argnames=("no_radius",))
def batch_fast_bound(K, gidx, m, v, mt, vt, pabs, clip, *, no_radius=False):
    """`fast_bound` with one constants row per coordinate: ``K.take(gidx)``.

    Args:
      K: a `bound.StepRow` of [G] float32 arrays (or the old [G, 12] table), one row per
        group of tensors.
      gidx: [n] int group index of each coordinate.
      m, v, mt, vt: [n] original and decoded moments (float32, certifiable).
      pabs: [n] ``|p|``.
      clip: [n] gradient bounds (coupled decay already folded in).
      no_radius: ideal stage only (for the enclosure audit's detection check).

    Returns:
      ``(bound, usable)``: [n] float32 bounds and a bool mask; only ``usable`` bounds count.
    """
    kt = _bound.as_step_row(K, -1).take(gidx)
    return fast_bound(kt, m, v, mt, vt, pabs, clip, no_radius=no_radius)


@jax.jit
def batch_fast_accept(K, gidx, m, v, mt, vt, pabs, clip):
    """True where the closed form certifies: usable and ``bound <= K.threshold``.

    Args:
      K, gidx, m, v, mt, vt, pabs, clip: as `batch_fast_bound`.

    Returns:
      A [n] bool mask of the coordinates the closed-form tier accepts.
    """
    kt = _bound.as_step_row(K, -1).take(gidx)
    b, usable = fast_bound(kt, m, v, mt, vt, pabs, clip)
    return usable & (b <= kt.threshold)
