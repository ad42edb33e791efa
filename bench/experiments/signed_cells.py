"""The signed cells tier: how much of the adaptive cell bound it recovers, at what cost, and what it does to an encode.

The cells tier (`fastbound.fast_cells_bound`) bounds stage 1 of the update difference on
each cell by ``|A| + |m2'| |F|`` (docs/bound.md section 8.1).  The rate pass of logrel-ans
moves m~ and v~ together so that m~ / sqrt(v~) barely moves, and the two terms then cancel;
the triangle inequality cannot see it, and on those moves the tier's bound is ~1.13x the
threshold where the adaptive cell bound is ~0.97x (bench/experiments/ans_frontier.py).

The signed cells tier (`fastbound.signed_cells_bound`, docs/bound.md section 8.2) keeps
the signs.  On the rate pass's and the width search's candidates that the cells tier
refuses (captured from a logrel-ans encode of bench/codec_speed.py's ByteTransformer) this
reports how many the adaptive cell bound certifies, how many the float64 form of the
signed enclosure would (no rounding analysis:

    u1 - u2 = S B (keep (m - m~) / D1(g) + m2'(g) (D2 - D1)(g) / (D1 D2)(g)),

each term bounded over the cell by its values at the cell's ends, both signs of g, plus
the tier's own stage 2) and how many the float32 tier does; that the float64 form is never
below the exact difference on a dense grid of gradients; each kernel's cost a row; and
then each checkpoint encoded with the tier and with it switched off.

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


def time_per_row(K, m, v, mt, vt, pabs, clip, rows=1 << 14, repeats=20):
    """ns a row of the cells tier, the signed cells tier and the adaptive cell bound's three
    partitions, on the first `rows` captured rows, one core."""
    from kernel_times import _median_ms
    from jaxguard.core import bound as _bound
    from jaxguard.core import fastbound
    sl = slice(0, rows)
    k = _bound.StepRow(*(np.asarray(x)[sl] for x in K))
    args = tuple(np.asarray(x)[sl] for x in (m, v, mt, vt, pabs, clip))
    kernels = {"cells tier": lambda: fastbound.batch_fast_cells_pc(k, *args),
               "signed cells tier": lambda: fastbound.batch_signed_cells_pc(k, *args)}
    for gammas in _bound.ADAPTIVE_PARTITIONS:
        kernels[f"adaptive cell bound, {len(gammas)} cells"] = (
            lambda gm=gammas: _bound.batch_bound_adaptive_pc(k, *args, gammas=gm))
    return {name: 1e6 * _median_ms(fn, repeats) / rows for name, fn in kernels.items()}


def encode_with_and_without(sets, codecs=("logrel-ans", "log8-rel"), repeats=3):
    """Each checkpoint encoded by each codec with the signed cells tier and with it switched off
    (its kernel answering +inf, so every row goes on as before the tier), alternating,
    `repeats` times: rows of (checkpoint, codec, coordinates, payload % with / without,
    escapes with / without, same arrays, median encode s with / without, candidate rows the
    tier certified in one encode)."""
    import time
    from fast_cells_escapes import _digest, _items, counting
    from fast_cells_escapes import _refuse_all as off
    from jaxguard.core import fastbound, guard
    real = fastbound.batch_signed_cells_pc
    rows = []
    for name, ck in sets:
        for codec in codecs:
            items = _items(ck, codec)
            guard.encode_many(items)                     # compile both paths' shapes first
            runs = {True: [], False: []}
            count = [0]
            for _ in range(repeats):
                for on in (True, False):
                    count[0] = 0 if on else count[0]
                    fastbound.batch_signed_cells_pc = counting(real, count) if on else off
                    try:
                        t0 = time.perf_counter()
                        encs = guard.encode_many(items)
                        runs[on].append((time.perf_counter() - t0, encs))
                    finally:
                        fastbound.batch_signed_cells_pc = real
            (w, e1), (wo, e0) = runs[True][-1], runs[False][-1]
            n = sum(e.n for e in e1)
            pay = [100 * sum(e.stats["payload_bytes"] for e in x) / (8 * n) for x in (e1, e0)]
            esc = [sum(e.stats["escapes"] for e in x) for x in (e1, e0)]
            med = [float(np.median([t for t, _ in runs[on]])) for on in (True, False)]
            rows.append((name, codec, n, pay[0], pay[1], esc[0], esc[1], _digest(e1) == _digest(e0), med[0], med[1],
                         count[0]))
            print(rows[-1], flush=True)
    return rows


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
    from jaxguard.core import fastbound
    tier = np.asarray(fastbound.batch_signed_cells_pc(K, m, v, mt, vt, pabs, clip), np.float64)
    tr_ok = (tier >= 0) & (tier <= thr)
    grid = grid_ideal(K, m, v, mt, vt, clip)
    sel = usable
    below = int((signed[sel] - native[sel] < grid[sel] * (1 - 1e-9)).sum())
    n = int(sel.sum())
    q = lambda x: " / ".join(f"{y:.3f}" for y in np.percentile(x[sel] / thr[sel], [10, 50, 90]))   # noqa: E731
    lines = ["# The signed cells tier on the rate pass's margin (issue 26)", "",
             f"`taskset -c 0 python bench/experiments/signed_cells.py` (one core): {n:,} rate-pass and width-search candidates of a logrel-ans "
             f"encode of {name} (867,328 coordinates) that the cells tier refuses (usable rows).", "",
             "| | certifies | share of the rows |", "|---|---:|---:|",
             f"| adaptive cell bound (28 cells, shipped) | {int(ad_ok[sel].sum()):,} | {100 * ad_ok[sel].mean():.1f}% |",
             f"| signed cells form (float64, + the tier's stage 2) | {int(sg_ok[sel].sum()):,} | "
             f"{100 * sg_ok[sel].mean():.1f}% |",
             f"| signed cells tier (float32, `fastbound.batch_signed_cells_pc`) | {int(tr_ok[sel].sum()):,} | "
             f"{100 * tr_ok[sel].mean():.1f}% |",
             f"| float32 tier only (adaptive bound refuses) | {int((tr_ok & ~ad_ok)[sel].sum()):,} | |",
             f"| tier not usable | {int((~np.isfinite(tier))[sel].sum()):,} | |",
             f"| float64 form and adaptive bound both | {int((ad_ok & sg_ok)[sel].sum()):,} | |",
             f"| float64 form only | {int((sg_ok & ~ad_ok)[sel].sum()):,} | |",
             f"| adaptive bound only (not the float64 form) | {int((ad_ok & ~sg_ok)[sel].sum()):,} | |", "",
             "Percentiles 10 / 50 / 90 over the threshold: cells tier " + q(total.astype(np.float64))
             + "; signed form " + q(signed) + "; adaptive cell bound " + q(adaptive)
             + "; dense-grid lower bound (+ stage 2) " + q(grid + native) + ".", "",
             f"Check of the form: signed stage 1 below the dense-grid value of the exact difference on {below} of {n:,} "
             "rows (must be 0).", "",
             "Cost a row (16,384 rows a call, medians of 20): "
             + "; ".join(f"{k} {v:.0f} ns" for k, v in time_per_row(K, m, v, mt, vt, pabs, clip).items()) + ".", "",
             "The float32 tier carries a rounding budget of GAMMA (|A| + |m2'| |F|) a cell and its range checks "
             "(docs/bound.md section 8.2); the enclosure audit checks it (`jaxguard audit-enclosure`)."]
    enc = encode_with_and_without(checkpoints(pathlib.Path(args.cache)))
    lines += ["", "## The tier in the guard (`certify.certify_pc`)", "",
              "The signed cells tier runs on the width search's and the rate pass's candidates (`max_level=-1`), "
              "after the cells tier; only rows it puts within `certify.SIGNED_MARGIN` of the threshold go on to the "
              "adaptive partitions. The final certificate does not run it. Each checkpoint encoded with the tier "
              "and with it switched off (kernel answering +inf), alternating, 3 times each, one core; medians.", "",
              "| checkpoint | codec | coordinates | payload % with / without | escapes with / without | same arrays | "
              "encode s with / without | candidate rows the tier certified |", "|---|---|---:|---:|---:|---|---:|---:|"]
    for name, codec, n, p1, p0, e1, e0, same, t1, t0, c in enc:
        lines.append(f"| {name} | {codec} | {n:,} | {p1:.3f} / {p0:.3f} | {e1:,} / {e0:,} | "
                     f"{'yes' if same else 'no'} | {t1:.2f} / {t0:.2f} ({t1 / t0:.2f}x) | {c:,} |")
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
