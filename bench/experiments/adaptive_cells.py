"""Per-coordinate cell partitions for the guard's exact certificate (issues 25 and 26).

The refinement levels partition ``[-C, C]`` with edges fixed in units of the clip
(`jaxguard.core.bound.unit_edges`).  The difference ``|s1 - s2|`` of a coordinate peaks
at gradients on the scale of its own ``sqrt(b2f v / c2)`` (where ``c2 g^2`` meets
``b2f v``), so cells placed on that scale bound the supremum tightly with few cells.
`jaxguard.core.bound.cell_bounds` is sound for any partition that covers ``[0, 1]``
(its cells are ``[clip*e_i, clip*e_(i+1)]``), so the partition is a speed/tightness
choice, never a soundness one.

    python bench/experiments/adaptive_cells.py CKPT.pt [--codec log8-rel] [--out OUT.md]

Captures the coordinates the guard sends to the cell levels (the closed form did not
certify them), then certifies them with each fixed level and with adaptive partitions,
timing each (median of 3, after a compile).
"""
from __future__ import annotations

import argparse
import time

import jax.numpy as jnp
import numpy as np
import torch

from jaxguard.core import bound as _bound

TAIL = (1.25, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0, 64.0, 256.0, 4096.0)
GRIDS = {
    "a12": (0.0, 0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 1.0, 1.5, 2.0, 4.0, 16.0),
    "a20": (0.0, 0.0625, 0.125, 0.1875, 0.25, 0.3125, 0.375, 0.4375, 0.5, 0.5625, 0.625, 0.75, 0.875, 1.0,
            1.25, 1.5, 2.0, 3.0, 6.0, 24.0),
    "t8": tuple(np.arange(0, 1.0, 1 / 8).tolist()) + (1.0,) + TAIL,
    "t16": _bound.ADAPTIVE_GAMMAS,   # what the guard runs
    "t4": tuple(np.arange(0, 1.0, 1 / 4).tolist()) + (1.0,) + TAIL,
}


def capture(path, codec):
    from jaxguard import GuardSpec, writer
    from jaxguard.core import guard
    from torch_compat.state import state_records
    got = []
    real = guard.certify_pc

    def spy(K, kidx, mf, vf, mt, vt, pabs, clip, cand, *a, **kw):
        sel = np.asarray(cand)
        got.append((_bound.as_step_row(K, -1).as_float32(np).take(kidx[sel]),
                    *(np.asarray(x, np.float32)[sel] for x in (mf, vf, mt, vt, pabs, clip))))
        return real(K, kidx, mf, vf, mt, vt, pabs, clip, cand, *a, **kw)
    guard.certify_pc = spy
    ck = torch.load(path, weights_only=False)
    _, recs = state_records(ck["optimizer"], dict(ck["model"]), spec=GuardSpec(codec=codec))
    writer.to_bytes(recs, {})
    guard.certify_pc = real
    cat = lambda i: np.concatenate([g[i] for g in got]) if i else _bound.StepRow(   # noqa: E731
        *(np.concatenate([g[0][j] for g in got]) for j in range(12)))
    return cat(0), *(cat(i) for i in range(1, 7))


def timed(fn, reps=3):
    out = fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return out, float(np.median(ts))


def run_fixed(K, m, v, mt, vt, p, c, edges, chunk=1 << 12):
    out = np.empty(m.size, np.float32)
    e = jnp.asarray(edges)
    for s in range(0, m.size, chunk):
        sl = slice(s, s + chunk)
        out[sl] = np.asarray(_bound.batch_bound_pc(K.take(np.arange(m.size)[sl]), m[sl], v[sl], mt[sl], vt[sl], p[sl],
                                                   c[sl], e))
    return out


def run_adaptive(K, m, v, mt, vt, p, c, gammas, chunk=1 << 14):
    out = np.empty(m.size, np.float32)
    for s in range(0, m.size, chunk):
        sl = slice(s, s + chunk)
        out[sl] = np.asarray(_bound.batch_bound_adaptive_pc(K.take(np.arange(m.size)[sl]), m[sl], v[sl], mt[sl], vt[sl],
                                                            p[sl], c[sl], gammas=gammas))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--codec", default="log8-rel")
    ap.add_argument("--limit", type=int, default=1 << 15)
    args = ap.parse_args()
    K, m, v, mt, vt, p, c = capture(args.ckpt, args.codec)
    n = m.size
    if n > args.limit:
        pick = np.random.default_rng(0).choice(n, args.limit, replace=False)
        K, m, v, mt, vt, p, c = K.take(pick), m[pick], v[pick], mt[pick], vt[pick], p[pick], c[pick]
    thr = K.threshold
    print(f"{n} coordinates reached the cell levels; measuring {m.size}")
    rows = []
    full = None
    for lv in range(len(_bound.LEVELS)):
        b, t = timed(lambda: run_fixed(K, m, v, mt, vt, p, c, _bound.unit_edges(lv)))
        ok = (b >= 0) & (b <= thr)
        full = ok if full is None else full | ok
        rows.append((f"level {lv} ({len(_bound.unit_edges(lv)) - 1} cells/sign)", ok.mean(), t / m.size * 1e9,
                     np.median(b[np.isfinite(b)] / thr[np.isfinite(b)])))
    for name, g in GRIDS.items():
        b, t = timed(lambda: run_adaptive(K, m, v, mt, vt, p, c, tuple(float(x) for x in g)))
        ok = (b >= 0) & (b <= thr)
        rows.append((f"adaptive {name} ({len(g)} cells/sign)", ok.mean(), t / m.size * 1e9,
                     np.median(b[np.isfinite(b)] / thr[np.isfinite(b)])))
        print(f"  {name}: certified by adaptive but no fixed level: {int((ok & ~full).sum())}; "
              f"by some level but not adaptive: {int((full & ~ok).sum())}")
    print(f"any level: {full.mean():.4f}")
    print("| partition | certified | ns/coordinate | median bound/threshold |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {100 * r[1]:.2f}% | {r[2]:.0f} | {r[3]:.3f} |")


if __name__ == "__main__":
    main()


def leftovers(path, codec="log8-rel", grid="t16"):
    """Print what the adaptive grid misses that the fixed levels certify."""
    K, m, v, mt, vt, p, c = capture(path, codec)
    thr = K.threshold
    full = np.zeros(m.size, bool)
    for lv in range(len(_bound.LEVELS)):
        b = run_fixed(K, m, v, mt, vt, p, c, _bound.unit_edges(lv))
        full |= (b >= 0) & (b <= thr)
    b = run_adaptive(K, m, v, mt, vt, p, c, tuple(float(x) for x in GRIDS[grid]))
    ok = (b >= 0) & (b <= thr)
    miss = np.flatnonzero(full & ~ok)
    k = _bound.StepRow(*(np.asarray(x) for x in K))
    gs = np.sqrt(np.maximum(k.b2f * np.minimum(v, vt), (k.eps * k.B) ** 2) / k.c2)
    print(f"{miss.size} missed; columns: vt/v, m/sqrt(v), gs/clip, eps*B/sqrt(b2f v), bound/thr")
    for i in miss[:25]:
        print(f"  {vt[i] / v[i]:.4g} {m[i] / np.sqrt(v[i]):.4g} {gs[i] / c[i]:.4g} "
              f"{k.eps[i] * k.B[i] / np.sqrt(k.b2f[i] * v[i]):.4g} {b[i] / thr[i]:.4f}")
