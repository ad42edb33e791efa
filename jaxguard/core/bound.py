"""The shared-gradient difference bound: one coordinate, one gradient cell.

Both the original and the restored update see the same gradient ``g`` and parameter
``p``.  Writing ``m1 = keep*m + a*g`` and ``m2 = keep*m~ + a*g``, ``v_i = b2f*v_i + c2*g^2``,
``d_i = sqrt(v_i)/B + eps`` and ``s_i = -S*m_i/d_i`` (the step), the difference is

    (s1 - s2)/S = -[ keep*(m - m~)/d1  -  m2 * b2f*(v - v~) / (B*(sqrt v1 + sqrt v2)*d1*d2) ]

``a*g`` cancels and ``p`` cancels, so the error is proportional to ``|m-m~|`` and ``|v-v~|``.
On a cell ``g in [gl, gh]`` with ``0 <= gl <= gh`` every factor is monotone in ``g`` or
linear in it, so interval arithmetic on this form is tight.  Negative cells are the
positive ones with ``m, m~`` negated (the bound is odd in ``(g, m, m~)``).

Numerical contract
------------------
`coordinate_bound` returns, for one coordinate and every cell of a partition of
``[-clip, clip]``, a float32 number ``>=`` the supremum over the cell of
``|p1' - p2'|``, the difference of the two *native* float32 updates under any variant of
the pinned operation model (lerp/addcmul fused or not, IEEE or MKL/GPU sqrt within 4 ulp,
division or reciprocal-multiply, torch or optax op order), provided the inputs are
*certifiable*: finite, ``v, v~ >= 0``, and every nonzero moment has magnitude
``>= 2**-80`` (`jaxguard.core.guard` escapes every other coordinate).  It is computed in
float32 without directed rounding modes: stage 1 (ideal, real arithmetic) is evaluated
in round-to-nearest and widened by ``GAMMA = 2**-17`` relative to the magnitudes
involved (>= twice the worst accumulated rounding of the <= 60 operations in the chain)
plus an absolute term for float32 flush-to-zero (XLA on CPU flushes subnormals); stage
2 adds per-op radii ``R(M) = 8*u*M + 4*n_min`` through the native op sequence, and the
final ``p + step`` rounding (of the decayed parameter for torch-adamw, whose
``|1 - lr*wd|`` may exceed 1).  A cell's bound is ``+inf`` (the coordinate escapes)
unless every float32 intermediate of the certificate is finite and every intermediate
of both modelled native updates (torch's and optax's op orders, optax's ``nu/bc2``
before its sqrt included) is bounded by ``NATIVE_LIMIT = 2**120`` over the cell; NaN
never comes out of `cell_bounds`.  The derivation is in docs/bound.md; the enclosure audit
(`jaxguard audit-enclosure`) checks it against the bit-exact torch replay.
"""
from __future__ import annotations

__all__ = ["U", "N_MIN", "GAMMA", "CONST_REL", "NATIVE_LIMIT", "RHO_MAX", "LEVELS", "unit_edges", "StepRow",
           "pack_constants", "pack_interval", "as_step_row", "stack_rows", "shared_ideal", "cell_bounds",
           "coordinate_bound", "batch_bound", "PROBE_POINTS", "DENSE_PROBE_POINTS", "batch_lower",
           "batch_bound_pc", "ADAPTIVE_GAMMAS", "ADAPTIVE_GAMMAS_DOUBLING", "ADAPTIVE_PARTITIONS",
           "adaptive_unit_edges", "batch_bound_adaptive_pc", "batch_lower_pc"]

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from typing import NamedTuple

from jaxguard.core.floatbits import TINY_MOMENT
from jaxguard.core.opmodel import StepConstants
from jaxguard.errors import ConfigError

U = 2.0**-24                 # unit roundoff of float32
N_MIN = 2.0**-126            # smallest normal float32
GAMMA = 2.0**-17             # stage-1 evaluation margin (relative)
CONST_REL = 2.0**-20         # default gap to the framework's constants (StepRow.const_rel overrides)
# TINY_MOMENT (from floatbits, 2**-80): smaller nonzero moments are not certified (escape)
NATIVE_LIMIT = 2.0**120      # bound on every modelled native float32 intermediate (FLT_MAX ~ 2**128)
RHO_MAX = 2.0**-8            # largest relative gap of the denominator the stage-2 algebra admits

# refinement levels: (linear cells per sign, geometric sub-steps per octave)
LEVELS = ((1, 0), (16, 1), (64, 2), (256, 4), (1024, 8))
GEOMETRIC_OCTAVES = 40       # geometric edges down to 2**-40 * clip


COARSE_EDGES = (0.0, 2.0**-30, 2.0**-20, 2.0**-14, 2.0**-10, 2.0**-7, 2.0**-5, 2.0**-3, 2.0**-2, 0.5, 1.0)


def unit_edges(level: int, partition: str = "mixed") -> np.ndarray:
    """Cell edges on [0, 1] (multiplied by the clip).  Level 0 is the cheap early accept:
    one cell for the linear partition, ten geometric cells for the mixed one.

    Args:
      level: refinement level, 0..4 (`LEVELS`: linear cells per sign and geometric
        sub-steps per octave).
      partition: ``"mixed"`` (linear cells plus geometric edges down to 2**-40) or
        ``"linear"``.

    Returns:
      Sorted unique float32 edges, first 0.0, last 1.0.

    Raises:
      ValueError: an unknown partition.
    """
    if level == 0 and partition == "mixed":
        return np.asarray(COARSE_EDGES, np.float32)
    n_lin, sub = LEVELS[level]
    edges = [np.linspace(0.0, 1.0, n_lin + 1)]
    if partition == "mixed" and sub:
        j = np.arange(0, GEOMETRIC_OCTAVES * sub + 1)
        edges.append(2.0 ** (-j / sub))
    elif partition not in ("mixed", "linear"):
        raise ConfigError(f"partition={partition!r}; use 'mixed' or 'linear'")
    e = np.unique(np.concatenate(edges + [np.array([0.0, 1.0])]).astype(np.float32))
    return e


class StepRow(NamedTuple):
    """The certificate's float32 constants of one step (a pytree: vmap, jit and gathers
    see twelve leaves).  Each field is a float32 scalar for one step, or an array with
    one entry per group of tensors (per coordinate after `take`).

    keep, a: weights of m and g in m'; b2f, c2: weights of v and g*g in v'; S: step
    size lr/(1 - b1**(t+1)); B: sqrt(1 - b2**(t+1)); eps; lr; weight_decay;
    threshold: ``tau*lr`` shrunk by 4 ulp (certified iff the bound is <= it);
    decay_in_update: 1.0 for optax-adamw with weight decay (``-lr*wd*p`` inside the
    update), else 0.0; const_rel: relative gap of S, B to the framework's constants.
    """

    keep: Any
    a: Any
    b2f: Any
    c2: Any
    S: Any
    B: Any
    eps: Any
    lr: Any
    weight_decay: Any
    threshold: Any
    decay_in_update: Any
    const_rel: Any

    def take(self, idx) -> "StepRow":
        """Rows ``idx`` of every field (numpy or jax arrays, whichever the fields are).

        Args:
          idx: integer indices into the leading axis (e.g. each coordinate's group id).

        Returns:
          A `StepRow` whose fields are ``field[idx]``.
        """
        return StepRow(*(x[idx] if isinstance(x, np.ndarray) else jnp.take(x, idx, axis=0) for x in self))

    def as_float32(self, xp=np) -> "StepRow":
        """Every field as a float32 array of `xp` (numpy or jax.numpy).

        Args:
          xp: the array module, ``numpy`` (default) or ``jax.numpy``.

        Returns:
          A `StepRow` of float32 arrays, values unchanged.
        """
        return StepRow(*(xp.asarray(x, xp.float32) for x in self))


def pack_constants(c: StepConstants, tau: float) -> StepRow:
    """The `StepRow` of step constants `c` (`opmodel.step_constants`) and tolerance `tau`.

    Args:
      c: the next update's constants.
      tau: the tolerance (certified: ``|p1' - p2'| <= tau * lr``).
    Returns:
      A `StepRow` of float32 scalars.
    """
    thr = np.float32(np.float32(tau) * np.float32(c.lr)) * np.float32(1 - 4 * U)
    vals = (c.keep, c.a, c.b2f, c.c2, c.S, c.B, c.eps, c.lr, c.weight_decay, thr,
            1.0 if c.decay_in_update else 0.0, c.const_rel)
    return StepRow(*(np.float32(x) for x in vals))


def _f32_up(x: float) -> np.float32:
    """The smallest float32 >= the double `x` (x finite, >= 0)."""
    y = np.float32(x)
    return y if float(y) >= x else np.nextafter(y, np.float32(np.inf))


# `S(lr)/lr` of every lr in an interval is within this relative factor of the endpoints'
# (each S is lr/(1 - b1**t) rounded once to float32, after at most one double rounding)
LR_RATIO_SLACK = 2.0**-22


def pack_interval(c_lo: StepConstants, c_hi: StepConstants, tau: float) -> StepRow:
    """The `StepRow` that certifies every learning rate in ``[c_lo.lr, c_hi.lr]`` at once.

    Numerical contract: with ``0 < lo <= hi <= 1`` and ``hi * wd <= 1`` (checked by
    `jaxguard.core.config.NextUpdate`), every term of the bound (`cell_bounds`,
    `jaxguard.core.fastbound`) is ``S P + lr wd Q + R`` with ``P, Q, R >= 0`` that do not
    depend on the learning rate, so ``bound(lr) / lr <= bound(row) / lo`` for the row
    ``S = lo max(S(lr)/lr)`` (the endpoints' ratio widened by `LR_RATIO_SLACK`, rounded
    up), ``lr = lo``, threshold ``f32(tau lo)(1 - 4u)`` and ``const_rel`` the larger of
    the endpoints' (docs/bound.md, section 10).  A coordinate whose bound at this row is
    ``<=`` the threshold is therefore within ``tau * lr`` at every lr of the interval.

    Args:
      c_lo, c_hi: the step constants at ``lo`` and ``hi`` (`opmodel.step_constants`; the
        same op model, step, betas, eps and weight decay).
      tau: the tolerance.

    Returns:
      A `StepRow` of float32 scalars.
    """
    lo, hi = c_lo.lr, c_hi.lr
    ratio = max(c_lo.S / lo, c_hi.S / hi) * (1 + LR_RATIO_SLACK)
    row = pack_constants(c_lo, tau)
    return row._replace(S=_f32_up(lo * ratio), const_rel=np.float32(max(c_lo.const_rel, c_hi.const_rel)))


def as_step_row(k, axis: int = 0) -> StepRow:
    """`k` itself if it is a `StepRow`; else the old packed layout read by field order.

    Args:
      k: a `StepRow`, or an array whose `axis` holds the twelve constants in `StepRow`
        field order.
      axis: 0 for one row ``[12]``, -1 for a ``[G, 12]`` table.

    Returns:
      A `StepRow` (numpy fields for a numpy array, jax fields otherwise).
    """
    if isinstance(k, StepRow):
        return k
    k = jnp.moveaxis(k, axis, 0) if not isinstance(k, np.ndarray) else np.moveaxis(k, axis, 0)
    return StepRow(*(k[i] for i in range(len(StepRow._fields))))


def stack_rows(rows) -> StepRow:
    """One `StepRow` of [G] float32 arrays from G rows (row i: group i).

    Args:
      rows: a sequence of G `StepRow`s of scalars (`pack_constants`).

    Returns:
      A `StepRow` whose fields are float32 numpy arrays of shape [G].
    """
    return StepRow(*(np.asarray(col, np.float32) for col in zip(*rows)))


def shared_ideal(k, m, v, mt, vt, gl, gh):
    """Stage 1 (the ideal stage) on cells [gl, gh]: an upper bound of sup |s1 - s2|.

    ``s1``/``s2`` are the exact-arithmetic Adam steps from the original moments
    ``(m, v)`` and the decoded ones ``(mt, vt)``, over gradients ``g`` in ``[gl, gh]``
    (``g >= 0``; the negative side is the same call with ``m, mt`` negated). No native
    rounding allowance: `cell_bounds` adds stage 2.

    Args:
      k: the step constants, a `StepRow` (or the old packed row).
      m, v: original first/second moments (float32, broadcastable with the rest).
      mt, vt: decoded moments.
      gl, gh: the cell's gradient ends, float32, ``0 <= gl <= gh``.

    Returns:
      float32 bounds of the broadcast shape; +inf where any intermediate is not
      finite (an overflowed divisor would silently make a term 0: docs/bound.md,
      section 5).
    """
    k = as_step_row(k)
    keep, a, b2f, c2, S, B, eps = k.keep, k.a, k.b2f, k.c2, k.S, k.B, k.eps
    dm = m - mt
    dv = v - vt
    gl2, gh2 = gl * gl, gh * gh
    s1l, s1h = jnp.sqrt(b2f * v + c2 * gl2), jnp.sqrt(b2f * v + c2 * gh2)
    s2l, s2h = jnp.sqrt(b2f * vt + c2 * gl2), jnp.sqrt(b2f * vt + c2 * gh2)
    d1l, d1h = s1l / B + eps, s1h / B + eps
    d2l, d2h = s2l / B + eps, s2h / B + eps
    A_l, A_h = keep * dm / d1l, keep * dm / d1h
    A_lo, A_hi = jnp.minimum(A_l, A_h), jnp.maximum(A_l, A_h)
    nz = dv != 0
    R_l = jnp.where(nz, dv / jnp.where(nz, s1l + s2l, 1.0), 0.0)
    R_h = jnp.where(nz, dv / jnp.where(nz, s1h + s2h, 1.0), 0.0)
    # b2f R / (B d1 d2), divided in turn: the product B d1 d2 ~ v/B overflows for v > FLT_MAX B
    F_l = ((b2f * R_l) / d1l / B) / d2l
    F_h = ((b2f * R_h) / d1h / B) / d2h
    F_lo, F_hi = jnp.minimum(F_l, F_h), jnp.maximum(F_l, F_h)
    em2 = 4 * U * (jnp.abs(keep * mt) + a * gh) + 4 * N_MIN
    m2_lo = keep * mt + a * gl - em2
    m2_hi = keep * mt + a * gh + em2
    prods = (m2_lo * F_lo, m2_lo * F_hi, m2_hi * F_lo, m2_hi * F_hi)
    Bt_lo = functools.reduce(jnp.minimum, prods)
    Bt_hi = functools.reduce(jnp.maximum, prods)
    sup = jnp.maximum(jnp.abs(A_lo - Bt_hi), jnp.abs(A_hi - Bt_lo))
    amax = jnp.maximum(jnp.abs(A_lo), jnp.abs(A_hi))
    bmax = jnp.maximum(jnp.abs(Bt_lo), jnp.abs(Bt_hi))
    m2max = jnp.maximum(jnp.abs(m2_lo), jnp.abs(m2_hi))
    flush = N_MIN * (8.0 + ((4.0 * (m2max + 1.0)) * b2f / (B * d1l)) / d2l)
    fin = jnp.isfinite
    ok = (fin(dm) & fin(d1h) & fin(d2h) & fin(R_l) & fin(R_h) & fin(A_l) & fin(A_h) & fin(F_l) & fin(F_h)
          & fin(em2) & fin(m2_lo) & fin(m2_hi) & functools.reduce(jnp.logical_and, [fin(x) for x in prods])
          & fin(sup) & fin(flush))
    return jnp.where(ok, S * (sup + GAMMA * (amax + bmax) + flush) * (1 + 4 * U), jnp.inf)


def _separate_ideal(k, m, v, mt, vt, gl, gh):
    """Ablation: range each update on its own and subtract the intervals."""
    s1_lo, s1_hi, _ = _step_range(k, m, v, gl, gh)
    s2_lo, s2_hi, _ = _step_range(k, mt, vt, gl, gh)
    sup = jnp.maximum(s1_hi - s2_lo, s2_hi - s1_lo)
    mag = jnp.maximum(jnp.maximum(jnp.abs(s1_lo), jnp.abs(s1_hi)), jnp.maximum(jnp.abs(s2_lo), jnp.abs(s2_hi)))
    return (sup + GAMMA * mag) * (1 + 4 * U)


def _step_range(k, mm, vv, gl, gh):
    k = as_step_row(k)
    keep, a, b2f, c2, S, B, eps = k.keep, k.a, k.b2f, k.c2, k.S, k.B, k.eps
    ml, mh = keep * mm + a * gl, keep * mm + a * gh
    dl = jnp.sqrt(b2f * vv + c2 * gl * gl) / B + eps
    dh = jnp.sqrt(b2f * vv + c2 * gh * gh) / B + eps
    q = (ml / dl, ml / dh, mh / dl, mh / dh)
    lo = S * functools.reduce(jnp.minimum, q)
    hi = S * functools.reduce(jnp.maximum, q)
    bad = ~(jnp.isfinite(dh) & jnp.isfinite(ml) & jnp.isfinite(mh) & jnp.isfinite(lo) & jnp.isfinite(hi))
    lo, hi = jnp.where(bad, -jnp.inf, lo), jnp.where(bad, jnp.inf, hi)   # never certifies
    return lo, hi, jnp.maximum(jnp.abs(lo), jnp.abs(hi))


def _native_allowance(k, mm, vv, pabs, gl, gh, decay_in_update):
    """Stage 2 for one branch: sup over the cell of |s_native - s_ideal|, and sup|s|.

    The allowance is +inf (the coordinate escapes) unless every float32 intermediate of
    the modelled native update, torch's or optax's op order, is bounded by
    `NATIVE_LIMIT` over the cell (docs/bound.md, section 5)."""
    k = as_step_row(k)
    keep, a, b2f, c2, S, B, eps = k.keep, k.a, k.b2f, k.c2, k.S, k.B, k.eps
    lr, wd = k.lr, k.weight_decay
    Mm = 2 * jnp.abs(mm) + gh
    e_m = 3 * (8 * U * Mm + 4 * N_MIN)
    mmax = jnp.maximum(jnp.abs(keep * mm + a * gl), jnp.abs(keep * mm + a * gh)) + e_m
    d_min = jnp.sqrt(b2f * vv + c2 * gl * gl) / B + eps
    const_rel = k.const_rel
    rho_d = 64 * U + const_rel + 4e-19 / (B * d_min)
    inv = S / (d_min * (1 - rho_d))
    s_max = inv * mmax
    alloc = inv * (e_m + mmax * (rho_d + 24 * U + const_rel))
    if decay_in_update is None:      # per-coordinate flag (batched, mixed op models)
        flag = k.decay_in_update
        alloc = alloc + flag * (16 * U * (s_max + lr * wd * pabs))
        s_max = s_max + flag * (lr * wd * pabs)
    elif decay_in_update:
        alloc = alloc + 16 * U * (s_max + lr * wd * pabs)
        s_max = s_max + lr * wd * pabs
    # Native magnitudes, both op orders: g*g, v' and optax's v'/bc2 (before its sqrt);
    # m' (and torch's g - m); m'/bc1 (optax), S m' (torch's addcdiv), over d, times lr;
    # wd p, lr wd p, (1 - lr wd) p (torch-adamw decays first) and the new parameter.
    vmax = b2f * vv + c2 * (gh * gh)
    big = jnp.maximum(jnp.maximum(1.0, S), S / lr)
    lr1 = jnp.maximum(1.0, lr)
    dirmax = big * (mmax / jnp.minimum(1.0, d_min * (1 - rho_d)))
    tot = (dirmax + wd * pabs * lr1) * lr1
    pnew = pabs * jnp.maximum(1.0, jnp.abs(1 - lr * wd)) + tot
    ok = ((Mm <= NATIVE_LIMIT) & (gh * gh <= NATIVE_LIMIT) & (vmax <= NATIVE_LIMIT)
          & ((vmax / B) / B <= NATIVE_LIMIT) & (tot <= NATIVE_LIMIT) & (pnew <= NATIVE_LIMIT)
          & (rho_d <= RHO_MAX) & jnp.isfinite(alloc) & jnp.isfinite(s_max))
    return jnp.where(ok, alloc * (1 + 2.0**-16), jnp.inf), s_max


def cell_bounds(k, m, v, mt, vt, pabs, clip, edges, *, bound="shared", decay_in_update=False):
    """Per-cell upper bounds of |p1' - p2'| for one coordinate.

    Row 0: cells with g >= 0, row 1: g <= 0 (m, m~ negated).  A cell is +inf (never
    certifies) where an intermediate of the certificate or of a modelled native update
    could overflow (docs/bound.md, section 5).

    Args:
      k: the step constants, a `StepRow` of float32 scalars (or the old packed row).
      m, v: the original float32 moments of one coordinate (v >= 0).
      mt, vt: its decoded moments.
      pabs: ``|p|``, the parameter's magnitude (float32).
      clip: the gradient clip C (float32, > 0): gradients ``|g| <= clip`` are covered.
      edges: float32 cell edges on [0, 1] (`unit_edges`), scaled by `clip`.
      bound: ``"shared"`` (the certificate) or ``"separate"`` (the ablation that ranges
        each update on its own).
      decay_in_update: optax-adamw's ``-lr*wd*p`` term is inside the update; None reads
        it per coordinate from ``k.decay_in_update``.

    Returns:
      float32 [2, ncells] (ncells = ``len(edges) - 1``), every entry >= 0 or +inf.
    """
    k = as_step_row(k)
    gl = clip * edges[:-1]
    gh = clip * edges[1:]
    # torch-adamw rounds p + step after p *= 1 - lr*wd: |p_dec| <= |1 - lr wd| |p|, which
    # exceeds |p| when lr*wd > 2; max(...) covers both orders of decay (and no decay)
    lr, wd = k.lr, k.weight_decay
    pdec = pabs * jnp.maximum(1.0, jnp.abs(1 - lr * wd) * (1 + 2.0**-16))
    out = []
    for sgn in (1.0, -1.0):
        sm, smt = sgn * m, sgn * mt
        if bound == "shared":
            ideal = shared_ideal(k, sm, v, smt, vt, gl, gh)
        else:
            ideal = _separate_ideal(k, sm, v, smt, vt, gl, gh)
        al1, s1 = _native_allowance(k, sm, v, pabs, gl, gh, decay_in_update)
        al2, s2 = _native_allowance(k, smt, vt, pabs, gl, gh, decay_in_update)
        final_round = 2 * U * (pdec + N_MIN + jnp.maximum(s1, s2)) + 2.0**-148
        cb = (ideal + al1 + al2 + final_round) * (1 + 4 * U)
        out.append(jnp.where(cb >= 0, cb, jnp.inf))    # NaN (e.g. 0 * inf) never certifies
    return jnp.stack(out)


def coordinate_bound(k, m, v, mt, vt, pabs, clip, edges, *, bound="shared", decay_in_update=False):
    """max over all cells of `cell_bounds`; a cell whose bound is not a number >= 0 (NaN
    or -inf from overflow) counts as +inf, so that it never certifies.

    The cleaning must happen per cell, before the max: XLA's vectorised max reduction
    drops NaN (measured: batches of >= 1024 coordinates whose cells were all NaN reduced
    to -inf, which then passed `<= threshold`).

    The same call bounds n coordinates at once (the batched form of the ``batch_*``
    functions): `k`'s fields and the moments as [n] arrays, `edges` as [ncells + 1, 1]
    (shared) or [ncells + 1, n] (each coordinate's own); cells then lie on the leading
    axes and coordinates on the last, so XLA vectorises over coordinates.  Every float32
    operation is the one the single-coordinate call performs (the results are bit-identical
    to vmapping it: tests/core/test_bound_layout.py), 1.5x faster than the vmapped form whose
    inner axis held the 7-28 cells.

    Args:
      k, m, v, mt, vt, pabs, clip, edges, bound, decay_in_update: as `cell_bounds`.

    Returns:
      A float32 upper bound of |p1' - p2'| over all ``|g| <= clip`` (a scalar, or [n]
      batched), or +inf.
    """
    cells = cell_bounds(k, m, v, mt, vt, pabs, clip, edges, bound=bound, decay_in_update=decay_in_update)
    return jnp.max(jnp.where(cells >= 0, cells, jnp.inf), axis=(0, 1))


@functools.partial(jax.jit, static_argnames=("bound", "decay_in_update"))
def batch_bound(k, m, v, mt, vt, pabs, clip, edges, *, bound="shared", decay_in_update=False):
    """`coordinate_bound` vmapped over coordinates.

    Args:
      k: the step constants, one `StepRow` of float32 scalars for all coordinates.
      m, v, mt, vt, pabs, clip: [n] arrays, one entry per coordinate (as `cell_bounds`).
      edges, bound, decay_in_update: as `cell_bounds`.

    Returns:
      float32 [n] bounds.
    """
    # vmapped: with one constants row for all, the batched layout evaluates a few bounds to
    # a neighbouring float32 value (tests/core/test_bound_layout.py); the per-coordinate forms
    # below are bit-identical batched, and they are the guard's
    f = functools.partial(coordinate_bound, bound=bound, decay_in_update=decay_in_update)
    return jax.vmap(f, in_axes=(None, 0, 0, 0, 0, 0, 0, None))(k, m, v, mt, vt, pabs, clip, edges)


def _shared_edges(edges):
    """[ncells + 1] unit edges as the [ncells + 1, 1] column the batched form broadcasts."""
    return jnp.asarray(edges, jnp.float32)[:, None]


# ---------------------------------------------------------------- early reject
PROBE_POINTS = (0.0, 2.0**-20, 2.0**-10, 2.0**-6, 2.0**-3, 0.5, 1.0)
# The second reject, on the few coordinates the adaptive tier leaves: half-power steps from
# the clip down to 2**-24 of it.  On GPT-2's 124M coordinates it rejected 36,450 of the
# ~106k padded rows that walked every fixed level to escape (PROBE_POINTS: none).
DENSE_PROBE_POINTS = (0.0,) + tuple(2.0 ** (-k / 2) for k in range(49))


def _ideal_difference_at(k, m, v, mt, vt, g):
    """(s1 - s2) at one gradient value, evaluated in float32 (round to nearest)."""
    k = as_step_row(k)
    keep, a, b2f, c2, S, B, eps = k.keep, k.a, k.b2f, k.c2, k.S, k.B, k.eps
    m1, m2 = keep * m + a * g, keep * mt + a * g
    d1 = jnp.sqrt(b2f * v + c2 * g * g) / B + eps
    d2 = jnp.sqrt(b2f * vt + c2 * g * g) / B + eps
    return S * (m1 / d1 - m2 / d2)


def coordinate_lower(k, m, v, mt, vt, clip, points=PROBE_POINTS):
    """A float32 number <= sup over |g| <= clip of |s1 - s2| (ideal): if it exceeds the
    threshold the coordinate can never be certified, so refinement is skipped.

    Numerical contract: each probe is a gradient in [-clip, clip]; its difference is
    evaluated in float32 and shrunk by ``GAMMA`` (and 2**-100 absolute), the margin the
    cell bound's own evaluation gets, so the result is below every upper bound the
    levels compute and a rejected coordinate is one no level would certify.

    Args:
      k: the step constants (`StepRow`).
      m, v: the original float32 moments of one coordinate.
      mt, vt: its decoded moments.
      clip: the gradient clip C.
      points: the probes, fractions of the clip in [0, 1] (each is taken with both signs).

    Returns:
      A float32 scalar lower bound (0 where the probes give NaN).
    """
    g = clip * jnp.asarray(points, jnp.float32)
    d = jnp.concatenate([_ideal_difference_at(k, m, v, mt, vt, g), _ideal_difference_at(k, m, v, mt, vt, -g)])
    lo = jnp.max(jnp.abs(d)) * (1 - GAMMA) - 2.0**-100
    return jnp.where(jnp.isnan(lo), 0.0, lo)


@jax.jit
def batch_lower(k, m, v, mt, vt, clip):
    """`coordinate_lower` vmapped over coordinates, one constants row for all.

    Args:
      k: the step constants (`StepRow` of scalars).
      m, v, mt, vt: [n] float32 moments and decoded moments.
      clip: [n] float32 gradient clips.

    Returns:
      float32 [n] lower bounds.
    """
    return jax.vmap(coordinate_lower, in_axes=(None, 0, 0, 0, 0, 0))(k, m, v, mt, vt, clip)


# ---------------------------------------------------------------- per-coordinate constants
@functools.partial(jax.jit, static_argnames=("bound",))
def batch_bound_pc(k, m, v, mt, vt, pabs, clip, edges, *, bound="shared"):
    """`batch_bound` with one constants row per coordinate; the adamw decay-in-update
    flag is read from ``k.decay_in_update``, so tensors of different groups and op models
    are certified in one call.

    Args:
      k: a `StepRow` of [n] float32 arrays, one row per coordinate (`StepRow.take`).
      m, v, mt, vt, pabs, clip: [n] arrays, one entry per coordinate (as `cell_bounds`).
      edges, bound: as `cell_bounds`.

    Returns:
      float32 [n] bounds.
    """
    if jnp.shape(edges)[0] - 1 <= BATCHED_MAX_CELLS:   # (an old packed [n, 12] table: its fields on axis -1)
        return coordinate_bound(as_step_row(k, -1), m, v, mt, vt, pabs, clip, _shared_edges(edges), bound=bound,
                                decay_in_update=None)
    f = functools.partial(coordinate_bound, bound=bound, decay_in_update=None)
    return jax.vmap(f, in_axes=(0, 0, 0, 0, 0, 0, 0, None))(k, m, v, mt, vt, pabs, clip, edges)


# Partitions of at most this many cells are bounded batched (cells on the leading axis,
# coordinates on the vector lanes); finer ones vmapped, whose inner axis of 64-1335 cells
# vectorises as well (measured per row, AMD EPYC: 10 cells 525 -> 218 ns, 28 adaptive
# cells 421 -> 267 ns; 64 cells and up within 6% either way).  Both give the same bits.
BATCHED_MAX_CELLS = 32


# ---------------------------------------------------------------- the coordinate's own partition
# Cell edges in units of the coordinate's gradient scale ``sqrt(max(b2f min(v, v~), (eps B)^2) / c2)``:
# where ``c2 g^2`` meets ``b2f v`` (or the eps term), the difference peaks; linear sixteenths
# below the scale, then a geometric tail.  Measured on the coordinates the closed form leaves
# (bench/experiments/results/adaptive_cells.md): 28 cells a sign certify about what level 3's 408 do.
ADAPTIVE_GAMMAS = tuple(j / 16 for j in range(16)) + (1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 64.0, 256.0,
                                                      4096.0)
# Eighths and the same tail: every cell a union of `ADAPTIVE_GAMMAS` cells, 20 a sign.  It
# certified 93.57% of what the 28-cell partition's 94.43% is taken from, so the guard tries
# it first and gives the 28 cells only what it leaves.
ADAPTIVE_GAMMAS_SHORT = ADAPTIVE_GAMMAS[:16:2] + ADAPTIVE_GAMMAS[16:]
# A doubling ladder, 8 cells a sign, every cell a union of `ADAPTIVE_GAMMAS_SHORT` cells.
# On 742,400 rows of a GPT-2 compress that reached the adaptive tier (2-core AMD EPYC):
# 167 ns a row against the 20 cells' 347, certifying 94.8% against 99.05%, and no row
# that the 20 and 28 cells both refused (as expected of cells that are unions of theirs);
# the tier certified the same coordinates at ~190 ns a row instead of ~350.  Soundness
# never depends on it: any partition covering [0, clip] is.
ADAPTIVE_GAMMAS_DOUBLING = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 16.0, 256.0)
# The adaptive tier's partitions, in the order the guard tries them.
ADAPTIVE_PARTITIONS = (ADAPTIVE_GAMMAS_DOUBLING, ADAPTIVE_GAMMAS_SHORT, ADAPTIVE_GAMMAS)


def adaptive_scale_ratio(k, v, vt, clip):
    """The coordinate's gradient scale over its clip, the unit of `adaptive_unit_edges`
    (+inf where it is not a finite number >= 0: every inner edge is then 1).

    Args:
      k: the coordinate's `StepRow`.
      v, vt: its original and decoded second moments (float32, >= 0).
      clip: its gradient clip (float32, > 0).

    Returns:
      float32 ``sqrt(max(b2f min(v, v~), (eps B)^2) / c2) / clip``.
    """
    k = as_step_row(k)
    scale = jnp.sqrt(jnp.maximum(k.b2f * jnp.minimum(v, vt), (k.eps * k.B) * (k.eps * k.B)) / k.c2)
    ratio = scale / clip
    return jnp.where(jnp.isfinite(ratio) & (ratio >= 0), ratio, jnp.inf)


def adaptive_unit_edges(k, v, vt, clip, gammas=ADAPTIVE_GAMMAS):
    """One coordinate's cell edges on [0, 1]: `gammas` times its gradient scale over the
    clip, capped at 1, then 1.

    Numerical contract: the edges start at exactly 0, end at exactly 1 and never decrease
    (each is ``min(gamma * ratio, 1)`` of one float32 ``ratio >= 0`` and ascending gammas;
    a ratio that is not finite makes every inner edge 1).  So the cells
    ``[clip*e_i, clip*e_(i+1)]`` cover ``[0, clip]`` with no gap, whatever the inputs, and
    `coordinate_bound` over them is as sound as over the fixed partitions: the partition
    decides how tight the bound is, never whether it holds.

    Args:
      k: the coordinate's `StepRow` (float32 scalars).
      v, vt: its original and decoded second moments (float32, >= 0).
      clip: its gradient clip (float32, > 0).
      gammas: ascending multiples of the scale, the first 0 (default `ADAPTIVE_GAMMAS`;
        others for bench/experiments/adaptive_cells.py).

    Returns:
      float32 [len(gammas) + 1] edges.
    """
    ratio = adaptive_scale_ratio(k, v, vt, clip)
    col = (-1,) + (1,) * jnp.ndim(ratio)        # batched: [n] arguments give [len(gammas) + 1, n]
    inner = jnp.minimum(jnp.asarray(gammas[1:], jnp.float32).reshape(col) * ratio, 1.0)
    ends = jnp.ones((1,) + jnp.shape(ratio), jnp.float32)
    return jnp.concatenate([jnp.zeros_like(ends), inner, ends])


@functools.partial(jax.jit, static_argnames=("gammas",))
def batch_bound_adaptive_pc(k, m, v, mt, vt, pabs, clip, *, gammas=ADAPTIVE_GAMMAS):
    """`batch_bound_pc` with each coordinate's own partition (`adaptive_unit_edges`).

    Args:
      k: a `StepRow` of [n] float32 arrays, one row per coordinate (`StepRow.take`).
      m, v, mt, vt, pabs, clip: [n] arrays, one entry per coordinate (as `cell_bounds`).
      gammas: the partition's multiples of the gradient scale (static tuple).

    Returns:
      float32 [n] bounds (`coordinate_bound` over the coordinate's cells).
    """
    k = as_step_row(k, -1)
    return coordinate_bound(k, m, v, mt, vt, pabs, clip, adaptive_unit_edges(k, v, vt, clip, gammas),
                            decay_in_update=None)


@functools.partial(jax.jit, static_argnames=("points",))
def batch_lower_pc(k, m, v, mt, vt, clip, *, points=PROBE_POINTS):
    """`batch_lower` with one constants row per coordinate.

    Args:
      k: a `StepRow` of [n] float32 arrays.
      m, v, mt, vt: [n] float32 moments and decoded moments.
      clip: [n] float32 gradient clips.
      points: the probes (`PROBE_POINTS`; `DENSE_PROBE_POINTS` for the second reject).

    Returns:
      float32 [n] lower bounds.
    """
    # vmapped, not batched as the bounds are: laid out that way XLA evaluated some probes'
    # differences to other float32 values on an AMD EPYC (and its max dropped NaN
    # differently), which would move rejects, so escapes; the probes cost 68 ns a row
    f = functools.partial(coordinate_lower, points=points)
    return jax.vmap(f, in_axes=(0, 0, 0, 0, 0, 0))(k, m, v, mt, vt, clip)
