"""Would a sign-keeping cells bound close the gap between the cells tier and the cell bound?

The cells tier (`fastbound.fast_cells_bound`) bounds stage 1 of the update difference on
each cell by ``|A| + |m2'| |F|`` (docs/bound.md section 8.1).  The rate pass of logrel-ans
moves m~ and v~ together so that m~ / sqrt(v~) barely moves, and the two terms then cancel;
the triangle inequality cannot see it, and on those moves the tier's bound is ~1.12x the
threshold where the adaptive cell bound is ~0.84x (bench/experiments/ans_frontier.py).

This is a measurement, not a certificate: in float64, with no rounding analysis, it
evaluates on each coordinate's own 28-cell partition the interval form that keeps the signs,

    u1 - u2 = S B (keep (m - m~) / D1(g) + m2'(g) (D2 - D1)(g) / (D1 D2)(g)),
    D_i = sqrt(b2f v_i + c2 g^2) + eps B,   m2'(g) = keep m~ + a g,

each term bounded over the cell by its values at the cell's ends (the first is monotone in
|g|, the second a product of a linear factor and a factor of fixed sign and decreasing
magnitude), both signs of g, plus the tier's own stage 2.  It reports on the rate pass's
moves the cells tier refuses (captured from a logrel-ans encode of bench/codec_speed.py's
ByteTransformer): how many the adaptive cell bound certifies, how many the signed form
would, and, as a check of the form, that it is never below the exact float64 difference on
a dense grid of gradients.

    taskset -c 0 python bench/experiments/signed_cells.py [--out bench/experiments/results/signed_cells.md]
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys

os.environ.setdefault("JAXGUARD_ENCODE_THREADS", "1")
import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "experiments"))


def _terms(K, m, v, mt, vt, g, sign):
    """A(g), m2'(g), F(g) in float64 for gradient magnitudes g (branch `sign` of g)."""
    keep, a, b2f, c2, B, eps = (np.asarray(getattr(K, f), np.float64) for f in ("keep", "a", "b2f", "c2", "B", "eps"))
    m, v, mt, vt = (np.asarray(x, np.float64) for x in (m, v, mt, vt))
    r1 = np.sqrt(b2f * v + c2 * g * g)
    r2 = np.sqrt(b2f * vt + c2 * g * g)
    D1, D2 = r1 + eps * B, r2 + eps * B
    A = sign * keep * (m - mt) / D1
    m2 = sign * keep * mt + a * g
    F = b2f * (vt - v) / ((r1 + r2) * D1 * D2)
    return A, m2, F


def signed_ideal(K, m, v, mt, vt, edges_unit, clip):
    """sup over the cells and both signs of g of |A + m2' F|, times S B (float64)."""
    S, B = (np.asarray(getattr(K, f), np.float64) for f in ("S", "B"))
    clip = np.asarray(clip, np.float64)
    worst = np.zeros(m.shape, np.float64)
    for sign in (1.0, -1.0):
        ends = [_terms(K, m, v, mt, vt, clip * np.asarray(e, np.float64), sign) for e in edges_unit]
        for (A0, M0, F0), (A1, M1, F1) in zip(ends[:-1], ends[1:]):
            a_lo, a_hi = np.minimum(A0, A1), np.maximum(A0, A1)
            prods = np.stack([M0 * F0, M0 * F1, M1 * F0, M1 * F1])
            lo, hi = a_lo + prods.min(0), a_hi + prods.max(0)
            worst = np.maximum(worst, np.maximum(np.abs(lo), np.abs(hi)))
    return S * B * worst


def grid_ideal(K, m, v, mt, vt, clip, points=4001):
    """max over a dense grid of g in [-clip, clip] of the exact float64 |u1 - u2| (a lower bound)."""
    S, B = (np.asarray(getattr(K, f), np.float64) for f in ("S", "B"))
    best = np.zeros(m.shape, np.float64)
    for t in np.linspace(0.0, 1.0, points // 2 + 1):
        for sign in (1.0, -1.0):
            A, M2, F = _terms(K, m, v, mt, vt, np.asarray(clip, np.float64) * t, sign)
            best = np.maximum(best, np.abs(A + M2 * F))
    return S * B * best


def signed_ideal_f32(K, m, v, mt, vt, edges_unit, clip):
    """`signed_ideal` as a jitted float32 program (no range checks, no rounding budget): what
    its evaluation would cost per row, for timing only."""
    import jax.numpy as jnp
    keep, a, b2f, c2, S, B, eps = K.keep, K.a, K.b2f, K.c2, K.S, K.B, K.eps
    dm = m - mt
    dv = b2f * (vt - v)
    ends = []
    for e in edges_unit:
        g = clip * e
        cg = c2 * g * g
        r1, r2 = jnp.sqrt(b2f * v + cg), jnp.sqrt(b2f * vt + cg)
        D1, D2 = r1 + eps * B, r2 + eps * B
        ends.append((keep * dm / D1, a * g, dv / ((r1 + r2) * D1 * D2)))
    worst = jnp.zeros_like(m)
    for sign in (1.0, -1.0):
        for (A0, G0, F0), (A1, G1, F1) in zip(ends[:-1], ends[1:]):
            M0, M1 = sign * keep * mt + G0, sign * keep * mt + G1
            p00, p01, p10, p11 = M0 * F0, M0 * F1, M1 * F0, M1 * F1
            lo = sign * jnp.minimum(A0, A1) + jnp.minimum(jnp.minimum(p00, p01), jnp.minimum(p10, p11))
            hi = sign * jnp.maximum(A0, A1) + jnp.maximum(jnp.maximum(p00, p01), jnp.maximum(p10, p11))
            worst = jnp.maximum(worst, jnp.maximum(jnp.abs(lo), jnp.abs(hi)))
    return S * B * worst


def time_per_row(K, m, v, mt, vt, pabs, clip, rows=1 << 14, repeats=20):
    """ns a row of the cells tier, the signed form (float32, jitted) and the adaptive cell
    bound's three partitions, on the first `rows` captured rows, one core."""
    import jax
    from kernel_times import _median_ms
    from jaxguard.core import bound as _bound
    from jaxguard.core import fastbound
    sl = slice(0, rows)
    k = _bound.StepRow(*(np.asarray(x)[sl] for x in K))
    args = tuple(np.asarray(x)[sl] for x in (m, v, mt, vt, pabs, clip))

    @jax.jit
    def signed(k, m, v, mt, vt, pabs, clip):
        edges = fastbound.adaptive_edge_list(k, v, vt, clip, fastbound.FAST_CELLS_GAMMAS)
        return signed_ideal_f32(k, m, v, mt, vt, edges, clip)
    kernels = {"cells tier (shipped)": lambda: fastbound.batch_fast_cells_pc(k, *args),
               "signed form, float32": lambda: signed(k, *args)}
    for gammas in _bound.ADAPTIVE_PARTITIONS:
        kernels[f"adaptive cell bound, {len(gammas)} cells"] = (
            lambda gm=gammas: _bound.batch_bound_adaptive_pc(k, *args, gammas=gm))
    return {name: 1e6 * _median_ms(fn, repeats) / rows for name, fn in kernels.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "experiments" / "results" / "signed_cells.md"))
    ap.add_argument("--cache", default=str(ROOT / "bench" / ".cache"))
    args = ap.parse_args()
    from ans_frontier import capture_refused, cells_tier_parts, checkpoints
    from fast_cells_escapes import _items
    from jaxguard.core import bound as _bound
    from jaxguard.core import guard
    name, ck = checkpoints(pathlib.Path(args.cache))[0]
    K, m, v, mt, vt, pabs, clip = capture_refused(_items(ck, "logrel-ans"), guard.encode_many)
    ideal, total, usable, edges = cells_tier_parts(K, m, v, mt, vt, pabs, clip)
    native = total.astype(np.float64) - ideal
    thr = np.asarray(K.threshold, np.float64)
    adaptive = np.asarray(_bound.batch_bound_adaptive_pc(K, m, v, mt, vt, pabs, clip), np.float64)
    ad_ok = (adaptive >= 0) & (adaptive <= thr)
    signed = signed_ideal(K, m, v, mt, vt, edges, clip) + native
    sg_ok = signed <= thr
    grid = grid_ideal(K, m, v, mt, vt, clip)
    sel = usable
    below = int((signed[sel] - native[sel] < grid[sel] * (1 - 1e-9)).sum())
    n = int(sel.sum())
    q = lambda x: " / ".join(f"{y:.3f}" for y in np.percentile(x[sel] / thr[sel], [10, 50, 90]))   # noqa: E731
    lines = ["# A sign-keeping cells bound on the rate pass's margin (issue 26; a measurement, not a certificate)", "",
             f"`taskset -c 0 python bench/experiments/signed_cells.py` (one core): {n:,} rate-pass and width-search candidates of a logrel-ans "
             f"encode of {name} (867,328 coordinates) that the cells tier refuses (usable rows).", "",
             "| | certifies | share of the rows |", "|---|---:|---:|",
             f"| adaptive cell bound (28 cells, shipped) | {int(ad_ok[sel].sum()):,} | {100 * ad_ok[sel].mean():.1f}% |",
             f"| signed cells form (float64, + the tier's stage 2) | {int(sg_ok[sel].sum()):,} | "
             f"{100 * sg_ok[sel].mean():.1f}% |",
             f"| both | {int((ad_ok & sg_ok)[sel].sum()):,} | |",
             f"| signed only | {int((sg_ok & ~ad_ok)[sel].sum()):,} | |",
             f"| adaptive only | {int((ad_ok & ~sg_ok)[sel].sum()):,} | |", "",
             "Percentiles 10 / 50 / 90 over the threshold: cells tier " + q(total.astype(np.float64))
             + "; signed form " + q(signed) + "; adaptive cell bound " + q(adaptive)
             + "; dense-grid lower bound (+ stage 2) " + q(grid + native) + ".", "",
             f"Check of the form: signed stage 1 below the dense-grid value of the exact difference on {below} of {n:,} "
             "rows (must be 0).", "",
             "Cost a row (16,384 rows a call, medians of 20): "
             + "; ".join(f"{k} {v:.0f} ns" for k, v in time_per_row(K, m, v, mt, vt, pabs, clip).items()) + ".", "",
             "Not a tier: a certificate would need the float32 evaluation with a rounding budget for the "
             "cancelling sum (its error is relative to |A| + |m2' F|, not to the result), the range checks, "
             "a derivation in docs/bound.md and the enclosure audit."]
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
