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

__all__ = ["fast_bound", "fast_cell_ideal", "fast_cells_bound", "signed_cells_bound", "FAST_CELLS_GAMMAS",
           "FAST_CELLS_PARTITIONS", "batch_fast_cells_pc", "batch_signed_cells_pc", "adaptive_edge_list",
           "batch_fast_accept"]

import functools

import jax
import jax.numpy as jnp

from jaxguard.core import bound as _bound

U = _bound.U
SAFE_HI = 2.0**60            # inputs above this go to the cell partition
INTER_LO = 2.0**-100         # nonzero intermediates must stay in [INTER_LO, INTER_HI]
INTER_HI = 2.0**100
EPS_LO = 2.0**-60


def _inputs_in_limits(k, m, v, mt, vt, pabs, clip):
    """Every tier's input limits: magnitudes ``<= SAFE_HI`` (``S`` too) and ``eps >= EPS_LO``."""
    usable = (jnp.abs(m) <= SAFE_HI) & (jnp.abs(mt) <= SAFE_HI) & (v <= SAFE_HI) & (vt <= SAFE_HI)
    return usable & (pabs <= SAFE_HI) & (clip <= SAFE_HI) & (k.eps >= EPS_LO) & (k.S <= SAFE_HI)


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
    usable = _inputs_in_limits(k, m, v, mt, vt, pabs, clip)
    zdv = zv
    for x, z in ((n1, zm | zk), (t1, zm | zk), (w, zdv), (q1, zdv), (q2, zdv), (q3, zdv),
                 (q2 * (a / sc), zdv), (q3 * (a / (2 * sc)), zdv), (nk, zmt | zk), (t2, zmt | zk | zdv),
                 (ideal, (zm | zk) & zdv),
                 (r1, v == 0), (r2, vt == 0), (d1, False), (d2, False), (rs, False), (B * d2, False)):
        usable &= _in_range(x, z)
    if no_radius:
        return ideal, usable & (ideal >= 0) & (ideal <= INTER_HI)
    al1, al2, final, native_ok = _native_stage(k, m, mt, d1, d2, pabs, sc)
    usable &= native_ok
    total = (ideal + al1 + al2 + final) * (1 + 4 * U)
    usable &= (total >= 0) & (total <= INTER_HI)            # NaN fails both
    return total, usable


def _native_stage(k, m, mt, d1, d2, pabs, sc):
    """Stage 2 over every ``|g| <= clip``, both branches, and the final ``p + step``
    rounding: ``(al1, al2, final, usable)``, added to a stage-1 bound as
    ``(ideal + al1 + al2 + final) * (1 + 4u)``.  `d1`, `d2` are ``d(0)`` of each branch and
    `sc` is ``sqrt(c2)``, computed once by the caller (so that XLA sees the program it
    always saw: the closed form's bits do not move)."""
    k = _bound.as_step_row(k)
    a, B, lr, wd, const_rel = k.a, k.B, k.lr, k.weight_decay, k.const_rel
    bs = B / sc                                              # sup |g|/d(g) <= B/sqrt(c2)
    al1, s1 = _native_sup(k, jnp.abs(m), d1, bs, const_rel, pabs)
    al2, s2 = _native_sup(k, jnp.abs(mt), d2, bs, const_rel, pabs)
    usable = (bs * (24 * U) >= 2.0**-80) & (a * bs >= 2.0**-80) & (const_rel <= 0.25)
    usable &= 4e-19 / (B * jnp.minimum(d1, d2)) <= 0.25        # so rho <= 0.5 in `_native_sup`
    for x in (al1, al2, s1, s2):      # never legitimately zero (E > 0): flushed would under-count
        usable &= _in_range(x, False)
    pdec = pabs * jnp.maximum(1.0, jnp.abs(1 - lr * wd))   # torch-adamw decays p first
    final = 2 * U * (pdec + _bound.N_MIN + jnp.maximum(s1 + al1, s2 + al2)) + 2.0**-148
    return al1, al2, final, usable


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


def _cell_scale(k, v):
    """A power of two near ``1 / D1(0)`` per coordinate, built from bits (so exact, and
    between ``2**-60`` and ``2**60``): `_cell_terms` works with ``r``, ``D`` scaled by
    it, which keeps its products near 1 where ``r**3`` alone would leave float32's range."""
    k = _bound.as_step_row(k)
    D = jnp.sqrt(k.b2f * v) + k.eps * k.B
    e = (jax.lax.bitcast_convert_type(jnp.asarray(D, jnp.float32), jnp.uint32) >> 23) & 0xFF   # biased exponent
    e = jnp.clip(e.astype(jnp.int32), 127 - 60, 127 + 60)
    return jax.lax.bitcast_convert_type(((254 - e) << 23).astype(jnp.uint32), jnp.float32)   # 2**(127 - e)


def _cell_terms(k, m, v, mt, vt, gl, gh, sigma):
    """`fast_cell_ideal`'s value on one cell and the intermediates to range-check, by kind:
    ``fixed`` (the same in every cell), ``rising`` (their exact values never decrease as
    the cell moves up: checked at the first and last cell of a partition) and ``own``
    (checked in every cell), each a list of ``(value, exact_zero_mask)`` with masks that
    do not depend on the cell.  ``r``, ``D`` and ``b2f|dv|`` are carried times the power
    of two `sigma` (``sigma**2``): exact scalings wherever the range checks pass."""
    k = _bound.as_step_row(k)
    keep, a, b2f, c2, S, B, eps = k.keep, k.a, k.b2f, k.c2, k.S, k.B, k.eps
    dm = jnp.abs(m - mt)
    dv = jnp.abs(v - vt)
    zm, zv, zmt, zk = dm == 0, dv == 0, mt == 0, keep == 0
    s2 = sigma * sigma
    gls = gl * sigma
    gl2 = gls * gls
    cg = c2 * gl2
    cg = jnp.where((gl2 >= INTER_LO) & (cg >= INTER_LO), cg, 0.0)   # below: evaluated at g = 0
    bv1, bv2 = b2f * v, b2f * vt
    sv1, sv2 = bv1 * s2, bv2 * s2
    r1 = jnp.sqrt(sv1 + cg)
    r2 = jnp.sqrt(sv2 + cg)
    eB = eps * B
    seB = eB * sigma
    D1, D2 = r1 + seB, r2 + seB
    rs = jnp.where(zv, 1.0, r1 + r2)        # with dv = 0 the second term is exactly 0
    n1 = keep * dm
    w = b2f * dv
    sw = w * s2
    nk = keep * jnp.abs(mt)
    mm = nk + jnp.maximum(a * gh, INTER_LO)  # a|g| rounded up to 2**-100 at least: never 0 nor tiny
    rsD2 = rs * D2
    num1 = n1 * rsD2
    mw = mm * sw
    num = num1 + mw
    D12 = D1 * D2
    den = rs * D12
    q = num / den                            # the ideal's q / sigma
    zq = (zm | zk) & zv
    Bq = (B * q) * sigma
    ideal = S * (Bq * (1 + _bound.GAMMA)) * (1 + 4 * U)
    fixed = [(bv1, v == 0), (bv2, vt == 0), (sv1, v == 0), (sv2, vt == 0), (eB, False), (seB, False),
             (n1, zm | zk), (w, zv), (sw, zv), (nk, zmt | zk)]
    rising = [(gl2, True), (cg, True), (r1, v == 0), (r2, vt == 0), (D1, False), (D2, False), (rs, False),
              (mm, False), (rsD2, False), (num1, zm | zk), (mw, zv), (num, zq), (D12, False), (den, False)]
    own = [(q, zq), (B * q, zq), (Bq, zq), (ideal, zq)]
    return ideal, fixed, rising, own


def fast_cell_ideal(k, m, v, mt, vt, gl, gh):
    """Stage 1 of the closed form on the gradient magnitudes ``gl <= |g| <= gh`` (both signs).

    In the difference form ``|s1 - s2|/S <= keep|dm|/d1(g) + |m2(g)| F(g)`` with
    ``F = b2f|dv| / (B (r1+r2)(g) d1(g) d2(g))``, the factors ``1/d_i`` and ``F`` only
    decrease as ``|g|`` grows and ``|m2| <= keep|m~| + a|g|``, so on the cell, with
    ``D_i = B d_i = r_i + eps B`` evaluated at ``gl``,

        ideal <= S B (keep|dm| (r1+r2) D2 + (keep|m~| + a gh) b2f|dv|) / ((r1+r2) D1 D2),

    one division a cell.  The decreasing factors are evaluated at ``gl``, or at 0 where
    ``gl*gl`` or ``c2*gl*gl`` is below ``2**-100`` (any point at or below ``gl`` is a
    valid, looser, evaluation point), and ``a gh`` is raised to ``2**-100`` at least.
    Every intermediate is exactly zero for an exact reason or lies in ``[2**-100,
    2**100]`` (checked), so each operation has relative error ``<= u`` (sqrt ``<= 8u``,
    division ``<= 2u``); all terms are positive, the longest chain accumulates under 64u,
    and the result is widened by ``bound.GAMMA`` (128u) and ``4u``.

    Args:
      k: a `bound.StepRow` broadcasting against the coordinates.
      m, v, mt, vt: original and decoded moments (float32, certifiable).
      gl, gh: float32 cell ends, ``0 <= gl <= gh``, broadcasting against the moments.

    Returns:
      ``(ideal, usable)`` of the broadcast shape; only usable cells count.
    """
    ideal, fixed, rising, own = _cell_terms(k, m, v, mt, vt, gl, gh, _cell_scale(k, v))
    usable = jnp.ones(jnp.shape(ideal), bool)
    for x, z in fixed + rising + own:
        usable &= _in_range(x, z)
    return ideal, usable


# Monotone intermediates of a partition are range-checked at its first and last cells only,
# against this narrower range: a middle cell's exact value lies between theirs, and each
# computed value is within 64u of its exact one (approximate sqrt included), so it stays in
# [INTER_LO, INTER_HI].  Checking every cell cost 4x the bound itself (28 cells: 165 against
# 35 ns a row).
RISING_LO = 2.0 * INTER_LO
RISING_HI = 0.5 * INTER_HI


def fast_cells_bound(k, m, v, mt, vt, pabs, clip, edges, *, no_radius=False):
    """The closed form on a partition of ``[0, clip]``: the largest `fast_cell_ideal` over
    the cells plus the closed form's stage 2, which holds for every ``|g| <= clip``.

    Numerical contract: where ``usable``, ``bound`` is a finite float32 number ``>=
    sup |p1' - p2'|`` over the cells' gradients (every ``|g| <= clip`` when the edges run
    from 0 to 1) for every variant of the pinned operation model, as `fast_bound`; the
    partition decides how tight it is, never whether it holds.  ``usable`` requires the
    closed form's input limits, every cell's intermediates in range (the monotone ones
    checked at the first and last cell, `RISING_LO`) and the stage-2 conditions; what is
    not usable goes to the cell bound (`jaxguard.core.bound`).

    Args:
      k: a `bound.StepRow` broadcasting against the coordinates.
      m, v, mt, vt: original and decoded moments (float32, certifiable), shape ``[n]``.
      pabs: ``|p|``; clip: gradient bound per coordinate (coupled decay folded in).
      edges: a sequence of float32 unit edges, each ``[n]`` (or a scalar), non-decreasing
        from 0 to 1 (`bound.adaptive_unit_edges`); the cells are ``[clip*e_i,
        clip*e_(i+1)]``.  One elementwise pass per cell, so XLA fuses the whole bound.
      no_radius: stage 1 only (the enclosure audit's detection check).

    Returns:
      ``(bound, usable)``: [n] float32 bounds and a bool mask.
    """
    k = _bound.as_step_row(k)
    g = [clip * e for e in edges]
    worst = None
    usable = _inputs_in_limits(k, m, v, mt, vt, pabs, clip)
    last = len(g) - 2
    sigma = _cell_scale(k, v)
    for i, (gl, gh) in enumerate(zip(g[:-1], g[1:])):
        ideal, fixed, rising, own = _cell_terms(k, m, v, mt, vt, gl, gh, sigma)
        worst = ideal if worst is None else jnp.maximum(worst, ideal)
        for x, z in own + (fixed if i == 0 else []):
            usable &= _in_range(x, z)
        if i == 0:
            for x, z in rising:
                usable &= z | (x >= RISING_LO)
        if i == last:
            for x, _ in rising:
                usable &= x <= RISING_HI          # NaN fails
    if no_radius:
        return worst, usable
    return _plus_native_stage(k, m, v, mt, vt, pabs, worst, usable)


def _plus_native_stage(k, m, v, mt, vt, pabs, ideal, usable):
    """A cell-wise stage 1 `ideal` (over every ``|g| <= clip``) plus the closed form's
    stage 2, which holds for every ``|g| <= clip``: ``(total, usable)``."""
    B, eps = k.B, k.eps
    r1, r2 = jnp.sqrt(k.b2f * v), jnp.sqrt(k.b2f * vt)
    d1, d2 = r1 / B + eps, r2 / B + eps
    for x, z in ((r1, v == 0), (r2, vt == 0), (d1, False), (d2, False)):
        usable &= _in_range(x, z)
    al1, al2, final, native_ok = _native_stage(k, m, mt, d1, d2, pabs, jnp.sqrt(k.c2))
    total = (ideal + al1 + al2 + final) * (1 + 4 * U)
    usable &= native_ok & (total >= 0) & (total <= INTER_HI)
    return total, usable


def signed_cells_bound(k, m, v, mt, vt, pabs, clip, edges, *, no_radius=False, check_every_edge=False):
    """The cell enclosure of docs/bound.md section 2, signs kept, on a whole partition at
    once, plus the closed form's stage 2: the cells tier without its triangle inequality
    (docs/bound.md section 8.2).

    With ``t = |g|``, ``D_i = B d_i = r_i(t) + eps B``, ``A = keep (m - m~) / D1`` and
    ``F = 1/D1 - 1/D2 = b2f (v~ - v) / ((r1 + r2) D1 D2)``:

        (s1 - s2) / (S B) = A + (keep m~ + a t) F     (g = +t)
                          = -(A + (keep m~ - a t) F)  (g = -t)

    On a cell ``[t_l, t_h]`` ``A`` and ``F`` keep their signs and shrink in magnitude as
    ``t`` grows, and ``keep m~ +- a t`` is linear, so each sign's difference lies between
    ``min(A_l, A_h)`` plus the least of the four products of ``{M(t_l), M(t_h)}`` and
    ``{F_l, F_h}`` and the same with the greatest.  Each edge's values serve the two cells
    beside it: two divisions an edge.  Where the rate pass moves ``m~`` and ``v~``
    together, ``A`` and ``m2 F`` cancel, which the cells tier's ``|A| + |m2| |F|`` cannot see.

    Numerical contract: where ``usable``, ``bound`` is a finite float32 number ``>= sup
    |p1' - p2'|`` over every ``|g| <= clip`` for every variant of the pinned operation
    model, as `fast_cells_bound`, whose stage 2 it shares.  Computed ``A`` is within
    ``14.5u`` of the exact one, ``F`` within ``38.5u`` (sqrt ``8u``, division ``2u``), each
    corner product within ``42u (|keep m~| + a t_h) |F_l|``; the cancelling ends are off by
    at most ``44u`` times ``T = |A_l| + (|keep m~| + a t_h) |F_l|``, so each cell adds
    ``GAMMA T`` (``GAMMA = 128u``) and the largest ``2**-100`` (a flushed product or sum;
    ``a t >= 2**-100`` where ``t > 0``).  ``usable`` requires the closed form's input
    limits, at every edge ``t == 0`` or ``(sigma t)**2``, ``c2 (sigma t)**2``, ``a t >=
    2**-100``, the monotone intermediates in ``[2**-99, 2**99]`` at the first and last edge
    (so every edge's lies in ``[2**-100, 2**100]``, as `RISING_LO`), the final products in
    range and the stage-2 conditions.

    Args:
      k: a `bound.StepRow` broadcasting against the coordinates.
      m, v, mt, vt: original and decoded moments (float32, certifiable), shape ``[n]``.
      pabs: ``|p|``; clip: gradient bound per coordinate (coupled decay folded in).
      edges: float32 unit edges, each ``[n]`` (or a scalar), non-decreasing from 0 to 1.
      no_radius: stage 1 without its rounding budget and without stage 2 (the enclosure
        audit's detection check).
      check_every_edge: range-check every intermediate at every edge, not the monotone
        ones at the first and last edge only (the tests' reference; slower, never looser).

    Returns:
      ``(bound, usable)``: [n] float32 bounds and a bool mask.
    """
    k = _bound.as_step_row(k)
    keep, a, b2f, c2, S, B, eps = k.keep, k.a, k.b2f, k.c2, k.S, k.B, k.eps
    sigma = _cell_scale(k, v)
    s2 = sigma * sigma
    dm = m - mt
    dv = vt - v
    zm, zv, zmt, zk = dm == 0, dv == 0, mt == 0, keep == 0
    bv1, bv2 = b2f * v, b2f * vt
    sv1, sv2 = bv1 * s2, bv2 * s2
    eB = eps * B
    seB = eB * sigma
    n1 = keep * dm                 # signed
    w = b2f * dv
    sw = w * s2                    # signed: b2f (v~ - v) sigma**2
    nk = keep * mt                 # signed
    usable = _inputs_in_limits(k, m, v, mt, vt, pabs, clip)
    for x, z in ((bv1, v == 0), (bv2, vt == 0), (sv1, v == 0), (sv2, vt == 0), (eB, False), (seB, False),
                 (jnp.abs(n1), zm | zk), (jnp.abs(w), zv), (jnp.abs(sw), zv), (jnp.abs(nk), zmt | zk)):
        usable &= _in_range(x, z)
    ts = [clip * e for e in edges]
    ends = []
    for i, t in enumerate(ts):
        gs = t * sigma
        g2 = gs * gs
        cg = c2 * g2
        at = a * t
        usable &= (t == 0) | ((g2 >= INTER_LO) & (cg >= INTER_LO) & (at >= INTER_LO))
        r1 = jnp.sqrt(sv1 + cg)
        r2 = jnp.sqrt(sv2 + cg)
        D1, D2 = r1 + seB, r2 + seB
        rs = jnp.where(zv, 1.0, r1 + r2)      # with v == v~, F is exactly 0 whatever rs is
        rsD1 = rs * D1
        den = rsD1 * D2
        A = n1 / D1
        F = sw / den
        ends.append((A, F, nk + at, nk - at, at))
        rising = ((r1, v == 0), (r2, vt == 0), (D1, False), (D2, False), (rs, False), (rsD1, False), (den, False))
        falling = ((jnp.abs(A), zm | zk), (jnp.abs(F), zv))
        if i == 0:       # exact values: rising ones smallest here, falling ones largest
            for x, z in rising:
                usable &= z | (x >= RISING_LO)
            for x, _ in falling:
                usable &= x <= RISING_HI
        if i == len(ts) - 1:   # cg and a t rise too; their lower ends are checked at every edge above
            for x, _ in rising + ((cg, None), (at, None)):
                usable &= x <= RISING_HI      # NaN fails
            for x, z in falling:
                usable &= z | (x >= RISING_LO)
        if check_every_edge:
            for x, z in rising + falling + ((cg, t == 0), (at, t == 0)):
                usable &= _in_range(x, z)
    mnk = jnp.abs(nk)
    worst = None
    for (Al, Fl, Pl, Ql, _), (Ah, Fh, Ph, Qh, ath) in zip(ends[:-1], ends[1:]):
        a_lo, a_hi = jnp.minimum(Al, Ah), jnp.maximum(Al, Ah)
        cell = None
        for Ml, Mh in ((Pl, Ph), (Ql, Qh)):   # m2'(g) F for g >= 0, then (sign folded) for g <= 0
            p = (Ml * Fl, Ml * Fh, Mh * Fl, Mh * Fh)
            lo = a_lo + jnp.minimum(jnp.minimum(p[0], p[1]), jnp.minimum(p[2], p[3]))
            hi = a_hi + jnp.maximum(jnp.maximum(p[0], p[1]), jnp.maximum(p[2], p[3]))
            sup = jnp.maximum(jnp.abs(lo), jnp.abs(hi))
            cell = sup if cell is None else jnp.maximum(cell, sup)
        if not no_radius:
            cell = cell + _bound.GAMMA * (jnp.abs(Al) + (mnk + ath) * jnp.abs(Fl))
        worst = cell if worst is None else jnp.maximum(worst, cell)
    if no_radius:
        return S * ((B * worst) * sigma), usable
    bx = B * (worst + INTER_LO)
    bxs = bx * sigma
    ideal = S * bxs * (1 + 8 * U)
    for x in (bx, bxs, ideal):
        usable &= _in_range(x, False)
    return _plus_native_stage(k, m, v, mt, vt, pabs, ideal, usable)


# The partition the cells tier uses (multiples of the coordinate's gradient scale,
# `bound.adaptive_unit_edges`).  Measured on the coordinates a GPT-2 compress's closed form
# left (six slabs, 1.02M coordinates): the 20-cell partition certifies 96.8-99.0% of them,
# the 28-cell one 97.9-99.5%, the 8-cell doubling ladder 88.5-95.2%.
FAST_CELLS_GAMMAS = _bound.ADAPTIVE_GAMMAS
# The partitions the guard runs the cells tier on, in order, each on what the previous
# refused.  On 655,360 rows that tier saw in a GPT-2 compress (40 calls of 16K, one core):
# the 8-cell doubling ladder costs 33 ns a row and certifies 90.9%, the 28 cells 71 ns and
# 98.7%; the ladder first, 40 ns a row in all.  Every ladder cell is a union of 28-partition
# cells, and the 28 cells certified every row the ladder did (and 85% of the rest), so the
# two together certify what the 28 cells alone do.
FAST_CELLS_PARTITIONS = (_bound.ADAPTIVE_GAMMAS_DOUBLING, FAST_CELLS_GAMMAS)


def _on_own_partition(tier_bound, k, m, v, mt, vt, pabs, clip, gammas):
    k = _bound.as_step_row(k, -1)
    b, usable = tier_bound(k, m, v, mt, vt, pabs, clip, adaptive_edge_list(k, v, vt, clip, gammas))
    return jnp.where(usable, b, jnp.inf)


@functools.partial(jax.jit, static_argnames=("gammas",))
def batch_fast_cells_pc(k, m, v, mt, vt, pabs, clip, *, gammas=FAST_CELLS_GAMMAS):
    """`fast_cells_bound` on each coordinate's own partition, +inf where not usable.

    Args:
      k: a `bound.StepRow` of [n] float32 arrays, one row per coordinate (`StepRow.take`).
      m, v, mt, vt, pabs, clip: [n] arrays, one entry per coordinate.
      gammas: the partition's multiples of the gradient scale (static tuple).

    Returns:
      float32 [n] bounds (+inf: the coordinate goes on to the cell bound).
    """
    return _on_own_partition(fast_cells_bound, k, m, v, mt, vt, pabs, clip, gammas)


@functools.partial(jax.jit, static_argnames=("gammas",))
def batch_signed_cells_pc(k, m, v, mt, vt, pabs, clip, *, gammas=FAST_CELLS_GAMMAS):
    """`signed_cells_bound` on each coordinate's own partition, +inf where not usable.

    Args:
      k, m, v, mt, vt, pabs, clip, gammas: as `batch_fast_cells_pc`.

    Returns:
      float32 [n] bounds (+inf: the coordinate goes on to the adaptive cell bound).
    """
    return _on_own_partition(signed_cells_bound, k, m, v, mt, vt, pabs, clip, gammas)


def adaptive_edge_list(k, v, vt, clip, gammas):
    """`bound.adaptive_unit_edges` as a list of [n] edges (the same values), for
    `fast_cells_bound`.

    Args:
      k, v, vt, clip: as `bound.adaptive_unit_edges`.
      gammas: ascending multiples of the gradient scale, the first 0.

    Returns:
      ``len(gammas) + 1`` float32 edges: 0, ``min(gamma * ratio, 1)``..., 1.
    """
    return list(_bound.adaptive_unit_edges(k, v, vt, clip, gammas))


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
