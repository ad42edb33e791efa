"""Enclosure audit: does `jaxguard.core.bound.cell_bounds` enclose the real native difference?

``jaxguard audit-enclosure`` draws random certifiable scalar cases (moments ``m, v``,
decoded moments ``m~, v~`` near them as the codecs produce, parameter ``p``, step ``t``,
learning rate, gradient clip and one cell of the mixed partition at a random level
1-4), computes the bound for that cell, and evaluates the *actual* difference
``|p1' - p2'|`` of the two float32 updates with the bit-exact torch replay
(`torch_compat.replay.adam_step`, for the op model's torch implementation) at
`POINTS_PER_CASE` gradient values of the cell (both
ends, one float32 ulp inside each end, the midpoint, 11 fixed interior points and 16
uniformly random ones).  A failure
is a point where the actual difference exceeds the bound.

``--no-radius`` removes the stage-2 allowance (native op radii and the final ``p + step``
rounding) and keeps only the ideal stage (`bound.shared_ideal`): the audit must then
find failures, which shows that it can detect an under-estimate.

Edge cases (``--edge-fraction``, default 0.25 of the cases and of the groups): moments
near FLT_MAX and on both sides of every overflow boundary of the op models (v near
FLT_MAX, ``FLT_MAX * B``, `bound.NATIVE_LIMIT` and ``NATIVE_LIMIT * B**2``; m near the
limit and ``sqrt(v)`` scaled), parameters up to FLT_MAX, clips whose square crosses the
limit, and (torch-adamw) groups with ``lr * wd`` from 0.5 to 30, across the decay factor
``|1 - lr wd| = 1``.  A bound of +inf means the coordinate escapes: never a failure, and
counted (``escaped``); a finite bound must enclose the replay, NaN/inf actual included.

The adaptive tier (`bound.batch_bound_adaptive_pc`: the cell bound on each coordinate's own
partition, on its gradient scale): `ADAPTIVE_FRACTION` of the cases (drawn from a stream of
their own, so the other draws do not change) take their cell from their own adaptive
partition instead of a fixed level's, so the cell check runs at those edges; and every
case's whole adaptive bound (the max over all its cells), on each of
`bound.ADAPTIVE_PARTITIONS` (the 8-, 20- and 28-cell ones, in the order the guard tries them),
must enclose the replay at the case's points too (they lie in ``[-clip, clip]``), counted
under ``adaptive`` (``finite`` and ``certified_at_tau_0.01`` count a case once a partition).

Cases are grouped: all cases of one group share ``(step, lr, wd)`` so that one
`adam_step` call (one jitted kernel, its numpy fallback for the extreme range included)
replays the whole group at once; groups differ in ``(step, lr)``.

``--lr-interval`` (``lr_interval=True``): every group is certified for an interval
``[lo, hi]`` (`jaxguard.core.bound.pack_interval`; ``hi/lo`` drawn from ``1 + 2**-14``
(a rate read from an optax transformation), 10, 100 and 1000, ``hi <= 1``, ``hi wd <=
1``) and replayed at ``lo``, at ``hi`` or at a log-uniform rate between (a third each);
the replay's difference is compared with the bound scaled to that rate, ``bound *
lr / lo`` (the interval's claim: ``|p1' - p2'| <= tau lr`` wherever ``bound <= tau lo``).
"""
from __future__ import annotations

__all__ = ["POINTS_PER_CASE", "draw_cases", "draw_edge_cases", "cell_points", "audit_enclosure", "run"]

import functools
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard.core import bound as _bound
from jaxguard.core import fastbound as _fastbound
from jaxguard.core.opmodel import GPU_OP_MODELS, TORCH_OP_MODELS, is_decoupled, split_torch_op_model, step_constants
from jaxguard.errors import ConfigError

POINTS_PER_CASE = 32         # 16 fixed points of the cell + 16 random interior ones
GROUP = 2048                 # cases sharing one (step, lr): one replay call
CHUNK = 65536                # cases per jitted bound evaluation
BETAS = (0.9, 0.999)
EPS = 1e-8
ADAMW_WD = 0.01
LEVEL_RANGE = (1, 4)
ADAPTIVE_FRACTION = 0.5      # cases whose cell is one of their own adaptive partition's (`bound.adaptive_unit_edges`)
_INTERIOR = np.array([1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144], np.float64) / 233.0  # 11 interior fractions


# ---------------------------------------------------------------- bound (jitted, vmapped)
def _one_cell(k, m, v, mt, vt, pabs, clip, e, sgn, no_radius, row_decay=False):
    if no_radius:
        gl, gh = clip * e[:1], clip * e[1:]
        b = _bound.shared_ideal(k, sgn * m, v, sgn * mt, vt, gl, gh)[0]
    else:
        # row_decay: optax-adamw's decay-in-update flag is read from the row (GPU models only)
        rows = _bound.cell_bounds(k, m, v, mt, vt, pabs, clip, e, **({"decay_in_update": None} if row_decay else {}))
        b = jnp.where(sgn > 0, rows[0, 0], rows[1, 0])
    return b


@functools.partial(jax.jit, static_argnames=("no_radius",))
def _fast_bounds(k, m, v, mt, vt, pabs, clip, *, no_radius=False):
    """The closed-form tier (`jaxguard.core.fastbound`): one bound for all |g| <= clip."""
    b, usable = _fastbound.fast_bound(k.T, m, v, mt, vt, pabs, clip, no_radius=no_radius)
    return jnp.where(usable, b, jnp.nan), usable


# The two tiers on the coordinate's own cells: (bound on given edges, the guard's batch kernel,
# the partitions the guard runs it on).
CELLS_TIERS = {"fast_cells": (_fastbound.fast_cells_bound, _fastbound.batch_fast_cells_pc,
                              _fastbound.FAST_CELLS_PARTITIONS),
               "signed_cells": (_fastbound.signed_cells_bound, _fastbound.batch_signed_cells_pc,
                                (_fastbound.FAST_CELLS_GAMMAS,))}


@functools.partial(jax.jit, static_argnames=("tier", "no_radius"))
def _cell_tier_bounds(k, m, v, mt, vt, pabs, clip, e, *, tier, no_radius=False):
    """A cells tier (`CELLS_TIERS`) on the case's own cell alone (its two edges): a bound
    for both signs of every ``|g|`` in the cell."""
    b, usable = CELLS_TIERS[tier][0](k.T, m, v, mt, vt, pabs, clip, (e[:, 0], e[:, 1]), no_radius=no_radius)
    return jnp.where(usable, b, jnp.nan), usable


@functools.partial(jax.jit, static_argnames=("tier", "gammas"))
def _cell_tier_whole(k, m, v, mt, vt, pabs, clip, *, tier, gammas):
    """A cells tier as the guard runs it (the coordinate's own partition, `gammas`)."""
    return CELLS_TIERS[tier][1](_bound.as_step_row(k, -1), m, v, mt, vt, pabs, clip, gammas=gammas)


@jax.jit
def _adaptive_edges(k, v, vt, clip):
    return jax.vmap(lambda kk, a, b, c: _bound.adaptive_unit_edges(_bound.as_step_row(kk), a, b, c))(k, v, vt, clip)


def _adaptive_cells(rng, k, d, sel):
    """Give cases `sel` one non-empty cell of their own adaptive partition (uniform over those)."""
    if sel.size == 0:
        return
    e = np.asarray(_adaptive_edges(jnp.asarray(k[sel]), d["v"][sel], d["vt"][sel], d["clip"][sel]))
    nonempty = e[:, 1:] > e[:, :-1]
    count = nonempty.sum(1)                       # >= 1: the edges run from 0 to 1
    pick = np.minimum((rng.random(sel.size) * count).astype(np.int64), count - 1)
    idx = np.argmax(np.cumsum(nonempty, 1) > pick[:, None], axis=1)
    d["e"][sel, 0], d["e"][sel, 1] = e[np.arange(sel.size), idx], e[np.arange(sel.size), idx + 1]
    d["level"][sel] = -1


@functools.partial(jax.jit, static_argnames=("no_radius", "row_decay"))
def _bounds(k, m, v, mt, vt, pabs, clip, e, sgn, *, no_radius=False, row_decay=False):
    f = functools.partial(_one_cell, no_radius=no_radius, row_decay=row_decay)
    return jax.vmap(f)(k, m, v, mt, vt, pabs, clip, e, sgn)


# ---------------------------------------------------------------- case generation
def _loguniform(rng, lo, hi, n):
    return np.exp(rng.uniform(math.log(lo), math.log(hi), n))


def _certifiable(x):
    """Zero moments below 2**-80 in magnitude (the contract escapes them); float32."""
    x = np.asarray(x, np.float32)
    return np.where(np.abs(x) < np.float32(_bound.TINY_MOMENT), np.float32(0), x).astype(np.float32)


def draw_cases(rng, n):
    """Random certifiable scalar cases for the audit (the mix is in the module docstring).

    Args:
      rng: a `numpy.random.Generator` (the draw is a function of its state).
      n: how many cases.

    Returns:
      A dict of [n] arrays: ``m, v, mt, vt`` (float32 moments and decoded moments, v >= 0,
      magnitudes below 2**-80 zeroed), ``p`` (parameter), ``clip`` (gradient clip C),
      ``sgn`` (+1/-1, the cell's gradient sign), ``level`` (int, 1-4) and ``e`` ([n, 2]
      float32: the cell's unit edges, the gradient range is ``clip * e``).
    """
    # |m|: mostly typical, some extreme small/large; v likewise, 1e-20..1e2
    mag_m = np.where(rng.random(n) < 0.7, _loguniform(rng, 1e-8, 1e0, n), _loguniform(rng, 2.0**-79, 1e2, n))
    m = mag_m * rng.choice([-1.0, 1.0], n)
    v = np.where(rng.random(n) < 0.6, _loguniform(rng, 1e-12, 1e-2, n), _loguniform(rng, 1e-20, 1e2, n))
    # m~: m plus up to ~1% of a block absmax (absmax >= |m|)
    absmax = mag_m * _loguniform(rng, 1.0, 100.0, n)
    mt = m + rng.uniform(-1, 1, n) * 0.01 * absmax
    # v~: within half a log step (log step 2**(1/16)..2**1)
    half_step = 0.5 * rng.choice([1 / 16, 1 / 8, 1 / 4, 1.0], n)
    vt = v * np.exp2(rng.uniform(-1, 1, n) * half_step)
    # exact-equal and zero cases
    r = rng.random(n)
    mt = np.where(r < 0.05, m, mt)
    vt = np.where((r >= 0.05) & (r < 0.10), v, vt)
    m = np.where((r >= 0.10) & (r < 0.13), 0.0, m)
    mt = np.where((r >= 0.13) & (r < 0.16), 0.0, mt)
    v = np.where((r >= 0.16) & (r < 0.18), 0.0, v)
    vt = np.where((r >= 0.18) & (r < 0.20), 0.0, vt)
    both = (r >= 0.20) & (r < 0.22)
    m, mt, v, vt = (np.where(both, 0.0, x) for x in (m, mt, v, vt))
    m, mt, v, vt = (_certifiable(x) for x in (m, mt, v, vt))
    v, vt = np.abs(v), np.abs(vt)
    # p: typical, large, zero
    rp = rng.random(n)
    p = np.where(rp < 0.6, _loguniform(rng, 1e-6, 1e1, n), _loguniform(rng, 1e1, 1e8, n)) * rng.choice([-1.0, 1.0], n)
    p = np.where(rp > 0.95, 0.0, p).astype(np.float32)
    # clip: around sqrt(v)-ish scales, some far away
    clip = np.where(rng.random(n) < 0.5, _loguniform(rng, 1e-4, 1e1, n), _loguniform(rng, 1e-10, 1e2, n)).astype(np.float32)
    # one cell of the mixed partition, level 1..4; emphasis on cells near zero and the top
    level = rng.integers(LEVEL_RANGE[0], LEVEL_RANGE[1] + 1, n)
    e = np.zeros((n, 2), np.float32)
    rc = rng.random(n)
    for lv in range(LEVEL_RANGE[0], LEVEL_RANGE[1] + 1):
        sel = np.flatnonzero(level == lv)
        edges = _bound.unit_edges(lv, "mixed")
        nc = edges.size - 1
        idx = rng.integers(0, nc, sel.size)
        near0 = rc[sel] < 0.3
        idx = np.where(near0, rng.integers(0, min(8, nc), sel.size), idx)
        top = rc[sel] > 0.85
        idx = np.where(top, nc - 1 - rng.integers(0, min(4, nc), sel.size), idx)
        e[sel, 0], e[sel, 1] = edges[idx], edges[idx + 1]
    sgn = rng.choice([-1.0, 1.0], n).astype(np.float32)
    f = np.float32
    return dict(m=m.astype(f), v=v.astype(f), mt=mt.astype(f), vt=vt.astype(f), p=p, clip=clip,
                e=e, sgn=sgn, level=level)


FLT_MAX = float(np.finfo(np.float32).max)


def draw_edge_cases(rng, d, sel):
    """Overwrite cases `sel` of draw `d` with magnitudes at float32's edges (certifiable:
    finite, v >= 0): moments near FLT_MAX and both sides of the op models' overflow
    limits, parameters up to FLT_MAX, clips whose square crosses the limit.

    Args:
      rng: a `numpy.random.Generator`.
      d: a draw of `draw_cases`, changed in place.
      sel: integer indices of the cases to overwrite.
    """
    n = sel.size
    if n == 0:
        return
    lim = _bound.NATIVE_LIMIT
    centers = np.array([FLT_MAX, FLT_MAX * 0.0316, FLT_MAX * 1e-3, lim, lim * 1e-3, lim * 0.1, 1e30])
    v = centers[rng.integers(0, centers.size, n)] * np.exp(rng.uniform(-2.5, 2.5, n))
    r = rng.random(n)
    mag = np.where(r < 0.6, np.sqrt(v) * _loguniform(rng, 1e-3, 30.0, n),
                   np.where(r < 0.8, lim * _loguniform(rng, 1e-3, 1e3, n), FLT_MAX * rng.uniform(0.01, 1.0, n)))
    m = mag * rng.choice([-1.0, 1.0], n)
    mt = m + rng.uniform(-1, 1, n) * 0.01 * mag * _loguniform(rng, 1.0, 100.0, n)
    vt = v * np.exp2(rng.uniform(-1, 1, n) * 0.5 * rng.choice([1 / 16, 1 / 4, 1.0], n))
    r2 = rng.random(n)
    mt = np.where(r2 < 0.1, m, mt)
    vt = np.where((r2 >= 0.1) & (r2 < 0.2), v, vt)
    fin = lambda x: np.clip(x, -FLT_MAX, FLT_MAX).astype(np.float32)  # noqa: E731
    d["m"][sel], d["mt"][sel], d["v"][sel], d["vt"][sel] = fin(m), fin(mt), fin(v), fin(vt)
    rp = rng.random(n)
    p = np.where(rp < 0.5, _loguniform(rng, 1e20, FLT_MAX, n), _loguniform(rng, 1e-3, 1e8, n))
    d["p"][sel] = fin(p * rng.choice([-1.0, 1.0], n))
    rc = rng.random(n)
    d["clip"][sel] = np.where(rc < 0.2, _loguniform(rng, 1e10, 1e20, n), d["clip"][sel]).astype(np.float32)


# GPU op models only: odd hyperparameter groups and subnormal parameters and gradients
ODD_BETAS = ((0.0, 0.5), (0.3, 0.9), (0.5, 0.999), (0.6, 0.95), (0.99, 0.99999), (0.9, 0.9999999), (0.95, 0.98))
ODD_EPS = (1e-30, 1e-16, 1e-8, 1e-3, 1.0)


def _subnormal_cases(rng, d):
    """GPU audits: 4% of the cases get a subnormal parameter, 4% a clip whose cells hold
    subnormal gradients (the GPU kernels keep subnormals: no flush to zero)."""
    n = d["p"].size
    r = rng.random(n)
    sp = r < 0.04
    d["p"][sp] = (_loguniform(rng, 2.0**-149, 2.0**-126, int(sp.sum())) * rng.choice([-1.0, 1.0], int(sp.sum()))
                  ).astype(np.float32)
    sc = (r >= 0.04) & (r < 0.08)
    d["clip"][sc] = _loguniform(rng, 2.0**-140, 2.0**-100, int(sc.sum())).astype(np.float32)


def cell_points(rng, gl, gh):
    """The gradient magnitudes at which the audit replays each cell.

    Args:
      rng: a `numpy.random.Generator` for the 16 random interior points.
      gl, gh: [n] float32 cell ends, ``gl <= gh``.

    Returns:
      [n, POINTS_PER_CASE] float32, all in ``[gl, gh]``: both ends, one ulp inside each
      end, the midpoint, 11 fixed interior fractions and 16 uniform random ones.
    """
    gl64, gh64 = gl.astype(np.float64), gh.astype(np.float64)
    inner_lo = np.minimum(np.nextafter(gl, gh), gh)
    inner_hi = np.maximum(np.nextafter(gh, gl), gl)
    mid = ((gl64 + gh64) / 2).astype(np.float32)
    frac = np.concatenate([np.broadcast_to(_INTERIOR, (gl.size, _INTERIOR.size)),
                           rng.random((gl.size, POINTS_PER_CASE - 5 - _INTERIOR.size))], 1)
    interior = (gl64[:, None] + (gh64 - gl64)[:, None] * frac).astype(np.float32)
    pts = np.concatenate([gl[:, None], gh[:, None], inner_lo[:, None], inner_hi[:, None], mid[:, None], interior], 1)
    return np.clip(pts, gl[:, None], gh[:, None]).astype(np.float32)


# ---------------------------------------------------------------- audit
def audit_enclosure(cases, *, no_radius=False, seed=0, op_model="torch-adam", keep_failures=20,
                    edge_fraction=0.25, variant=None, approx="adversarial", lr_interval=False) -> dict:
    """Check `bound.cell_bounds` against the bit-exact torch replay (module docstring).

    Args:
      cases: how many random scalar cases (grouped by `GROUP` per ``(step, lr, wd)``).
      no_radius: ideal stage only (`bound.shared_ideal`): the audit must then find
        failures, which shows it can detect an under-estimate.
      seed: the draw's seed (the same seed draws the same cases for every op model).
      op_model: any torch op model: ``torch-adam[w]`` replays the single-tensor kernels,
        ``-foreach`` foreach=True, ``-fused`` the fused CPU kernel (half the cases through
        its scalar tail, counted in ``tail_cases``); a GPU op model
        (`jaxguard.core.opmodel.GPU_OP_MODELS`) is evaluated by its numpy simulation
        (`torch_compat.gpu_sim.simulate_step`, on CPU).
      keep_failures: how many failure examples the report keeps.
      edge_fraction: the share of cases (and adamw groups) drawn at float32's edges.
      variant: the torch replay's operation variant (default: the detected one for the
        op model's implementation); the bound covers every variant, so the audit must pass
        whichever is given.
      approx: GPU op models only (`torch_compat.gpu_sim`): ``"adversarial"`` rounds every
        approximate op to the worst float32 its error allows, ``"nearest"`` to the nearest;
        each case's kernel contracts multiply-adds to FMA or not, and (foreach) divides
        by a host scalar through its reciprocal or not (drawn, 50% each).
      lr_interval: certify every group for an lr interval and replay it at a rate in it
        (module docstring).

    Returns:
      A dict: cases, failures (finite bound below the actual difference, or a NaN
      bound), escaped (+inf bounds), edge_cases / edge_finite (edge draws and those with a
      finite bound), max_ratio, worst case, failure examples, the closed-form tier's
      counts (``fast``), the adaptive tier's (``adaptive``), settings.

    Raises:
      ConfigError: an op model that is not a torch one.
    """
    from torch_compat.replay import adam_step, detect_implementation_variant

    gpu = op_model in GPU_OP_MODELS
    if op_model not in TORCH_OP_MODELS and not gpu:
        raise ConfigError(f"op_model={op_model!r} is not a torch or GPU op model; use one of "
                          f"{', '.join(TORCH_OP_MODELS + tuple(GPU_OP_MODELS))}")
    if gpu:
        from torch_compat.gpu_sim import simulate_step
        decoupled, implementation = is_decoupled(op_model), GPU_OP_MODELS[op_model].implementation
        # the simulation's own randomness (FMA per case, adversarial roundings) is drawn
        # apart, so the cases are those every other op model sees for the same seed
        sim_rng = np.random.default_rng([seed, 24])
    else:
        decoupled, implementation = split_torch_op_model(op_model)
        variant = variant or detect_implementation_variant(implementation)
    wd = ADAMW_WD if decoupled else 0.0
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    # fused: half the cases (drawn apart, so the other op models' cases do not change) are
    # replayed with the kernel's scalar-tail arithmetic, the other half with its vector body
    tail_rng = np.random.default_rng([seed, 16]) if implementation == "fused" else None
    tail_cases = 0
    cases = int(cases)
    n_groups = -(-cases // GROUP)
    steps = np.floor(np.exp(rng.uniform(0.0, math.log(40001.0), n_groups))).astype(np.int64) - 1
    steps = np.clip(steps, 0, 40000)
    lrs = _loguniform(rng, 1e-5, 1e-2, n_groups)
    wds = np.full(n_groups, wd)
    edge_group = rng.random(n_groups) < edge_fraction
    if decoupled:   # decay factor 1 - lr wd from 0.5 down to -29: across |1 - lr wd| = 1
        lrs = np.where(edge_group, _loguniform(rng, 1e-2, 10.0, n_groups), lrs)
        wds = np.where(edge_group, _loguniform(rng, 0.5, 30.0, n_groups) / lrs, wds)
    group_betas, group_eps = [BETAS] * n_groups, [EPS] * n_groups
    if gpu:   # a quarter of the groups with odd hyperparameters (lerp's weight >= 0.5 branch included)
        for i in np.flatnonzero(sim_rng.random(n_groups) < 0.25):
            group_betas[i] = ODD_BETAS[sim_rng.integers(len(ODD_BETAS))]
            group_eps[i] = ODD_EPS[sim_rng.integers(len(ODD_EPS))]
    replay_lrs = lrs
    if lr_interval:   # drawn apart: the other draws stay those of the point audit
        irng = np.random.default_rng([seed, 55])
        his = np.minimum(lrs, 1.0)
        los = his / irng.choice([1 + 2.0**-14, 10.0, 100.0, 1000.0], n_groups)
        wds = np.minimum(wds, 1.0 / his)
        at = irng.integers(0, 3, n_groups)
        between = np.exp(irng.uniform(np.log(los), np.log(his)))
        replay_lrs = np.where(at == 0, los, np.where(at == 1, his, between))

        def row(s, lo, hi, w, bb, ee):
            c = [step_constants(op_model, lr=float(x), step=int(s), betas=bb, eps=ee, weight_decay=float(w))
                 for x in (lo, hi)]
            return _bound.pack_interval(c[0], c[1], 0.01)
        ks = np.stack([row(s, lo, hi, w, bb, ee)
                       for s, lo, hi, w, bb, ee in zip(steps, los, his, wds, group_betas, group_eps)])
        lrs = los
    else:
        ks = np.stack([_bound.pack_constants(step_constants(op_model, lr=float(lr), step=int(s), betas=bb, eps=ee,
                                                            weight_decay=float(w)), 0.01)
                       for s, lr, w, bb, ee in zip(steps, lrs, wds, group_betas, group_eps)])
    failures = 0
    max_ratio = 0.0
    worst = None
    examples = []
    nan_bounds = escaped = edge_cases = edge_finite = edge_failures = 0
    done = 0
    fast_usable = fast_certified = fast_failures = 0
    fast_max_ratio = 0.0
    fast_examples = []
    adapt_rng = np.random.default_rng([seed, 32])   # apart: the other draws stay those of earlier audits
    adaptive_cells = a_finite = a_certified = a_failures = a_cell_failures = 0
    a_max_ratio = 0.0
    a_examples = []
    tiers = {t: {"cell_usable": 0, "cell_failures": 0, "finite": 0, "certified_at_tau_0.01": 0, "failures": 0,
                 "max_ratio": 0.0, "failure_examples": []} for t in CELLS_TIERS}
    for c0 in range(0, cases, CHUNK):
        n = min(CHUNK, cases - c0)
        d = draw_cases(rng, n)
        edge = rng.random(n) < edge_fraction
        draw_edge_cases(rng, d, np.flatnonzero(edge))
        if gpu:
            _subnormal_cases(sim_rng, d)
        gid = (c0 + np.arange(n)) // GROUP
        k = ks[gid]
        pabs = np.abs(d["p"])
        in_adaptive = np.flatnonzero(adapt_rng.random(n) < ADAPTIVE_FRACTION)
        _adaptive_cells(adapt_rng, k, d, in_adaptive)
        adaptive_cells += in_adaptive.size
        b = np.asarray(_bounds(jnp.asarray(k), d["m"], d["v"], d["mt"], d["vt"], pabs, d["clip"], d["e"], d["sgn"],
                               no_radius=no_radius, **({"row_decay": True} if gpu else {})), np.float64)
        gl = (d["clip"] * d["e"][:, 0]).astype(np.float32)
        gh = (d["clip"] * d["e"][:, 1]).astype(np.float32)
        g = cell_points(rng, gl, gh) * d["sgn"][:, None]
        actual = np.empty(g.shape, np.float64)
        P = POINTS_PER_CASE
        for grp in np.unique(gid):
            rows = np.flatnonzero(gid == grp)
            nr = rows.size
            pp = np.repeat(d["p"][rows], P)
            gg = g[rows].reshape(-1)
            args = dict(step=int(steps[grp]), lr=float(replay_lrs[grp]), betas=group_betas[grp], eps=group_eps[grp],
                        weight_decay=float(wds[grp]))
            scale = float(lrs[grp]) / float(replay_lrs[grp])     # 1 unless an interval is replayed inside
            if gpu:
                fma = np.repeat(sim_rng.random(nr) < 0.5, P)
                recip = np.repeat(sim_rng.random(nr) < 0.5, P)
                out, _, _ = simulate_step(op_model, np.concatenate([pp, pp]), np.concatenate([gg, gg]),
                                          np.concatenate([np.repeat(d["m"][rows], P), np.repeat(d["mt"][rows], P)]),
                                          np.concatenate([np.repeat(d["v"][rows], P), np.repeat(d["vt"][rows], P)]),
                                          fma=np.concatenate([fma, fma]), recip=np.concatenate([recip, recip]),
                                          approx=approx, rng=sim_rng, **args)
                p1, p2 = out[:nr * P].astype(np.float64), out[nr * P:].astype(np.float64)
                with np.errstate(invalid="ignore"):
                    diff = np.where(np.isfinite(p1) & np.isfinite(p2), np.abs(p1 - p2), np.inf)
                actual[rows] = diff.reshape(nr, P) * scale
                continue
            args.update(decoupled=decoupled, variant=variant, implementation=implementation)
            if tail_rng is not None:
                in_tail = np.repeat(tail_rng.random(nr) < 0.5, P)
                tail_cases += int(in_tail.sum()) // P
                args["tail_mask"] = np.concatenate([in_tail, in_tail])
            # both updates in one array: first half original moments, second half decoded
            out, _, _ = adam_step(np.concatenate([pp, pp]), np.concatenate([gg, gg]),
                                  np.concatenate([np.repeat(d["m"][rows], P), np.repeat(d["mt"][rows], P)]),
                                  np.concatenate([np.repeat(d["v"][rows], P), np.repeat(d["vt"][rows], P)]), **args)
            p1, p2 = out[:nr * P].astype(np.float64), out[nr * P:].astype(np.float64)
            # a non-finite update (even the same inf on both sides) is a failure unless escaped:
            # a finite bound claims that every native intermediate is finite
            with np.errstate(invalid="ignore"):
                diff = np.where(np.isfinite(p1) & np.isfinite(p2), np.abs(p1 - p2), np.inf)
            actual[rows] = diff.reshape(nr, P) * scale
        amax = actual.max(1)
        # the closed-form tier bounds every |g| <= clip, so it must enclose every point of
        # the cell as well; only coordinates it declares usable count (others go to cells)
        fb, fu = (np.asarray(x) for x in _fast_bounds(jnp.asarray(k), d["m"], d["v"], d["mt"], d["vt"], pabs,
                                                       d["clip"], no_radius=no_radius))
        fast_usable += int(np.count_nonzero(fu))
        fast_certified += int(np.count_nonzero(fu & (fb <= k[:, 9])))
        fbad = fu & ~(amax <= fb.astype(np.float64))
        fast_failures += int(np.count_nonzero(fbad))
        with np.errstate(divide="ignore", invalid="ignore"):
            fr = np.where(fu & (amax > 0), amax / fb.astype(np.float64), 0.0)
        fast_max_ratio = max(fast_max_ratio, float(np.nanmax(fr)) if fr.size else 0.0)
        for i in np.flatnonzero(fbad)[: max(0, keep_failures - len(fast_examples))]:
            fast_examples.append(_describe(d, i, steps[gid[i]], lrs[gid[i]], wds[gid[i]], float(fb[i]), actual[i], g[i]))
        # each cells tier on the case's own cell (it covers both signs), then on the whole
        # partition the guard runs it on
        for tier, fc in tiers.items():
            cb, cu = (np.asarray(x) for x in _cell_tier_bounds(jnp.asarray(k), d["m"], d["v"], d["mt"], d["vt"], pabs,
                                                                d["clip"], jnp.asarray(d["e"]), tier=tier,
                                                                no_radius=no_radius))
            fc["cell_usable"] += int(np.count_nonzero(cu))
            cbad = cu & ~(amax <= cb.astype(np.float64))
            fc["cell_failures"] += int(np.count_nonzero(cbad))
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios = [np.where(cu & (amax > 0), amax / cb.astype(np.float64), 0.0)]
            bad = [(i, float(cb[i])) for i in np.flatnonzero(cbad)]
            for gammas in CELLS_TIERS[tier][2]:   # each partition the guard runs the tier on
                wb = np.asarray(_cell_tier_whole(jnp.asarray(k), d["m"], d["v"], d["mt"], d["vt"], pabs, d["clip"],
                                                 tier=tier, gammas=gammas), np.float64)
                w_fin = np.isfinite(wb)
                fc["finite"] += int(np.count_nonzero(w_fin))
                fc["certified_at_tau_0.01"] += int(np.count_nonzero(w_fin & (wb <= k[:, 9])))
                wbad = w_fin & ~(amax <= wb)
                fc["failures"] += int(np.count_nonzero(wbad))
                with np.errstate(divide="ignore", invalid="ignore"):
                    ratios.append(np.where(w_fin & (amax > 0), amax / wb, 0.0))
                bad += [(i, float(wb[i])) for i in np.flatnonzero(wbad)]
            fcr = np.concatenate(ratios)
            fc["max_ratio"] = max(fc["max_ratio"], float(np.nanmax(fcr)) if fcr.size else 0.0)
            for i, bnd in bad[: max(0, keep_failures - len(fc["failure_examples"]))]:
                fc["failure_examples"].append(_describe(d, i, steps[gid[i]], lrs[gid[i]], wds[gid[i]], bnd,
                                                        actual[i], g[i]))
        # the adaptive tier's whole bound (all cells of the coordinate's own partition), for
        # each partition the guard tries
        for gammas in _bound.ADAPTIVE_PARTITIONS:
            ab = np.asarray(_bound.batch_bound_adaptive_pc(_bound.as_step_row(jnp.asarray(k), -1), d["m"], d["v"],
                                                           d["mt"], d["vt"], pabs, d["clip"], gammas=gammas), np.float64)
            a_fin = np.isfinite(ab)
            a_finite += int(np.count_nonzero(a_fin))
            a_certified += int(np.count_nonzero(a_fin & (ab <= k[:, 9])))
            abad = a_fin & ~(amax <= ab)
            a_failures += int(np.count_nonzero(abad))
            with np.errstate(divide="ignore", invalid="ignore"):
                ar = np.where(a_fin & (amax > 0), amax / ab, 0.0)
            a_max_ratio = max(a_max_ratio, float(np.nanmax(ar)) if ar.size else 0.0)
            for i in np.flatnonzero(abad)[: max(0, keep_failures - len(a_examples))]:
                a_examples.append(_describe(d, i, steps[gid[i]], lrs[gid[i]], wds[gid[i]], float(ab[i]), actual[i],
                                            g[i]))
        nan_bounds += int(np.count_nonzero(np.isnan(b)))
        esc = b == np.inf           # the coordinate escapes: nothing is claimed
        escaped += int(np.count_nonzero(esc))
        bad = ~esc & ~(amax <= b)   # NaN bound, or a finite bound below the actual difference
        failures += int(np.count_nonzero(bad))
        a_cell_failures += int(np.count_nonzero(bad[in_adaptive]))
        edge_cases += int(np.count_nonzero(edge))
        edge_finite += int(np.count_nonzero(edge & ~esc))
        edge_failures += int(np.count_nonzero(edge & bad))
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = np.where((amax == 0) | esc, 0.0, amax / b)
        ratio = np.where(np.isnan(ratio), np.inf, ratio)
        i = int(np.argmax(ratio))
        if ratio[i] > max_ratio or worst is None:
            max_ratio = float(ratio[i])
            worst = _describe(d, i, steps[gid[i]], lrs[gid[i]], wds[gid[i]], b[i], actual[i], g[i])
        for i in np.flatnonzero(bad)[: max(0, keep_failures - len(examples))]:
            examples.append(_describe(d, i, steps[gid[i]], lrs[gid[i]], wds[gid[i]], b[i], actual[i], g[i]))
        done += n
    return {
        "cases": done, "failures": failures, "points_per_case": POINTS_PER_CASE,
        "evaluations": done * POINTS_PER_CASE * 2, "max_ratio": max_ratio, "nan_bounds": nan_bounds,
        "escaped": escaped, "edge_fraction": edge_fraction, "edge_cases": edge_cases, "edge_finite": edge_finite,
        "edge_failures": edge_failures,
        "seconds": round(time.perf_counter() - t0, 2), "no_radius": bool(no_radius), "seed": int(seed),
        "op_model": op_model, "weight_decay": wd if not decoupled else "0.01; edge groups lr*wd in [0.5, 30]",
        "lr_interval": ("hi/lo in {1+2**-14, 10, 100, 1000}, replayed at lo, hi or between; actual scaled by lo/lr"
                        if lr_interval else False),
        "betas": list(BETAS), "eps": EPS,
        "levels": list(LEVEL_RANGE), "partition": "mixed",
        "variant": ({"simulation": "torch_compat.gpu_sim (CPU, not a GPU)", "approx": approx, "fma": "per case, 50%",
                     "recip": "per case, 50% (foreach scalar division)"}
                    if gpu else variant.to_dict()),
        "implementation": implementation, "tail_cases": tail_cases,
        "worst": worst, "failure_examples": examples,
        "fast": {"usable": fast_usable, "certified_at_tau_0.01": fast_certified, "failures": fast_failures,
                 "max_ratio": fast_max_ratio, "failure_examples": fast_examples},
        **tiers,
        "adaptive": {"cell_cases": adaptive_cells, "cell_failures": a_cell_failures, "finite": a_finite, "certified_at_tau_0.01": a_certified,
                     "failures": a_failures, "max_ratio": a_max_ratio, "failure_examples": a_examples},
    }


def _describe(d, i, step, lr, wd, b, actual, g):
    j = int(np.argmax(actual))
    f = lambda x: float(np.float32(x))  # noqa: E731
    return {"m": f(d["m"][i]), "v": f(d["v"][i]), "mt": f(d["mt"][i]), "vt": f(d["vt"][i]), "p": f(d["p"][i]),
            "step": int(step), "lr": float(lr), "weight_decay": float(wd), "clip": f(d["clip"][i]), "level": int(d["level"][i]),
            "cell_unit": [f(d["e"][i, 0]), f(d["e"][i, 1])], "sign": int(d["sgn"][i]),
            "g_worst": f(g[j]), "actual": float(actual[j]), "bound": float(b)}


# ---------------------------------------------------------------- CLI
def run(args) -> int:
    """Run ``jaxguard audit-enclosure`` and print its report (JSON with ``--json``).

    Args:
      args: the parsed ``argparse.Namespace`` (cases, no_radius, seed, op_model,
        edge_fraction, json).

    Returns:
      The exit code: 1 if a finite bound failed (either tier), else 0; always 0 with
      ``--no-radius`` (failures are expected there).
    """
    rep = audit_enclosure(args.cases, no_radius=args.no_radius, seed=args.seed, op_model=args.op_model,
                          edge_fraction=args.edge_fraction, lr_interval=getattr(args, "lr_interval", False))
    if args.json:
        print(json.dumps(rep))
    else:
        print(f"audit-enclosure ({rep['op_model']}{', no radius' if rep['no_radius'] else ''}"
              f"{', lr intervals' if rep['lr_interval'] else ''}): "
              f"{rep['cases']} cases x {rep['points_per_case']} points, {rep['failures']} failures, "
              f"max actual/bound {rep['max_ratio']:.4g}, {rep['escaped']} escaped (bound +inf); edge cases "
              f"{rep['edge_cases']} ({rep['edge_finite']} with a finite bound, {rep['edge_failures']} failures), "
              f"{rep['seconds']} s; closed-form tier: {rep['fast']['usable']} usable, {rep['fast']['failures']} "
              f"failures, max actual/bound {rep['fast']['max_ratio']:.4g}; adaptive tier: {rep['adaptive']['cell_cases']} "
              f"cases in adaptive cells ({rep['adaptive']['cell_failures']} cell failures), {rep['adaptive']['finite']} finite whole bounds, "
              f"{rep['adaptive']['failures']} failures, max actual/bound {rep['adaptive']['max_ratio']:.4g}; "
              + "; ".join(f"{name}: {rep[t]['cell_usable']} usable on the case's cell ({rep[t]['cell_failures']} "
                          f"failures), {rep[t]['finite']} usable whole bounds ({rep[t]['failures']} failures), "
                          f"max actual/bound {rep[t]['max_ratio']:.4g}"
                          for t, name in (("fast_cells", "closed-form cells"), ("signed_cells", "signed cells"))))
    if rep["no_radius"]:
        return 0
    return 1 if (rep["failures"] or rep["fast"]["failures"] or rep["adaptive"]["failures"]
                 or any(rep[t]["failures"] or rep[t]["cell_failures"] for t in CELLS_TIERS)) else 0
