"""Where logrel-ans's payload comes from, and what each certificate tier costs (issue 26).

logrel-ans chooses per-block widths (the width search) and then moves codes to certified
neighbours of fewer rANS bits (the rate pass); both ask the guard's certificate, and the
certificate runs in tiers (`jaxguard.core.certify.certify_pc`): the closed form, the
closed form on the coordinate's own cells (`fastbound.fast_cells_bound`), then the cell
bound on 8, 20 and 28 adaptive cells.  This encodes fixed checkpoints with the search and
the rate pass each limited to a prefix of those tiers ("closed": the closed form only;
"cells": and the cells tier; "full": every tier up to the adaptive partitions, what
logrel-ans does) or the rate pass off ("none"), and reports payload, escapes and encode
time; the final certificate of the stored codes is always the full one, so every row keeps
the guarantee, only the codes differ.  It then reports, on the rate pass's candidate moves
that the cells tier refuses, how far the cells tier and the adaptive cell bound are from
the threshold (which part of the cells tier's bound is loose), and what a zlib
(DEFLATE, Python's standard library) stage over the same codes would store instead of rANS.

    python bench/experiments/ans_frontier.py [--out bench/experiments/results/ans_frontier.md]

Checkpoints: bench/codec_speed.py's ByteTransformer (60 Adam steps, 867,328 coordinates,
built and cached under bench/.cache), and the reproduction's transformer and CNN of its
first seed at 10/50/100% (bench/reproduce.py, cached there too).  One encode thread, warm
programs; times are one run each on whatever machine runs it (the md names it).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import platform
import sys
import time
import zlib

os.environ.setdefault("JAXGUARD_ENCODE_THREADS", "1")
import numpy as np  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "bench" / "experiments"))

VARIANTS = (("full", "full"), ("cells", "full"), ("closed", "full"), ("full", "cells"), ("full", "closed"),
            ("cells", "cells"), ("closed", "closed"), ("full", "none"), ("cells", "none"), ("closed", "none"))


def _tiered(real_certify_pc, mode):
    """certify_pc limited to the tiers `mode` names, for the calls with max_level == -1 (the
    width search's and the rate pass's; the final certificate passes no max_level)."""
    from fast_cells_escapes import _refuse_all
    from jaxguard.core import bound as _bound
    from jaxguard.core import certify, fastbound

    def cpc(K, gidx, m, v, mt, vt, pabs, clip, idx, bnd, part, progress=False, fast=True, max_level=None,
            adaptive=True, reject_first=False):
        which = mode()
        if max_level == -1 and which == "closed":
            lv = np.full(idx.shape[0], -1, np.int8)
            lv[certify.fast_accept(K, gidx[idx], m[idx], v[idx], mt[idx], vt[idx], pabs[idx], clip[idx])] = \
                certify.FAST_TIER
            return lv
        if max_level == -1 and which == "cells":   # the signed cells tier (added later) off too
            saved, _bound.ADAPTIVE_PARTITIONS = _bound.ADAPTIVE_PARTITIONS, ()
            signed, fastbound.batch_signed_cells_pc = fastbound.batch_signed_cells_pc, _refuse_all
            try:
                return real_certify_pc(K, gidx, m, v, mt, vt, pabs, clip, idx, bnd, part, progress, fast, max_level,
                                       adaptive, reject_first)
            finally:
                _bound.ADAPTIVE_PARTITIONS = saved
                fastbound.batch_signed_cells_pc = signed
        return real_certify_pc(K, gidx, m, v, mt, vt, pabs, clip, idx, bnd, part, progress, fast, max_level, adaptive,
                               reject_first)
    return cpc


def checkpoints(cache):
    import torch
    import codec_speed
    import reproduce
    sets = []
    base = cache / "frontier_base60.pt"
    if not base.exists():
        cache.mkdir(parents=True, exist_ok=True)
        torch.save(codec_speed.train_checkpoint(60), base)
    sets.append(("ByteTransformer 60 steps", torch.load(base, weights_only=False)))
    for kind, steps in (("transformer", 400), ("cnn", 300)):
        seed = reproduce.SEEDS[kind][0]
        ckpts, _ = reproduce.checkpoints(kind, seed, steps, cache)
        for frac, ck in sorted(ckpts.items()):
            sets.append((f"{kind} seed {seed} @{frac:g}", ck))
    return sets


def zlib_codes_bytes(encs):
    """Bytes of the encodings' m and v codes as DEFLATE streams (best of Huffman-only, RLE and
    level 6, per tensor; codes wider than 8 bits as two byte planes), for comparison with rANS."""
    from jaxguard.format import packed
    total = 0
    for e in encs:
        a = e.arrays
        bm, bv = packed.split_widths(a["widths"])
        planes = []
        for q, wide in ((a["m_codes"].astype(np.int64), bm.max(initial=0) > 8),
                        (a["v_codes"].astype(np.int64), bv.max(initial=0) > 8)):
            planes.append((q & 0xFF).astype(np.uint8).tobytes())
            if wide:
                planes.append(((q >> 8) & 0xFF).astype(np.uint8).tobytes())
        for p in planes:
            best = None
            for level, strategy in ((1, zlib.Z_HUFFMAN_ONLY), (1, zlib.Z_RLE), (6, zlib.Z_DEFAULT_STRATEGY)):
                c = zlib.compressobj(level, zlib.DEFLATED, -15, 9, strategy)
                n = len(c.compress(p) + c.flush())
                best = n if best is None else min(best, n)
            total += best
    return total


def capture_refused(items, encode_many, limit=200_000):
    """Rows the cells tier refuses during one encode of `items` (its first `limit`):
    ``(StepRow of arrays, m, v, mt, vt, pabs, clip)``."""
    from jaxguard.core import bound as _bound
    from jaxguard.core import fastbound
    real = fastbound.batch_fast_cells_pc
    cap = []

    def capture(k, m, v, mt, vt, pabs, clip, **kw):
        out = np.asarray(real(k, m, v, mt, vt, pabs, clip, **kw))
        bad = ~(out <= np.asarray(k.threshold))
        if bad.any() and sum(c[1].size for c in cap) < limit:
            cap.append((_bound.StepRow(*(np.asarray(x)[bad] for x in k)),) + tuple(
                np.asarray(x)[bad] for x in (m, v, mt, vt, pabs, clip)))
        return out
    fastbound.batch_fast_cells_pc = capture
    try:
        encode_many(items)
    finally:
        fastbound.batch_fast_cells_pc = real
    K = _bound.StepRow(*(np.concatenate([c[0][i] for c in cap]) for i in range(len(_bound.StepRow._fields))))
    return (K,) + tuple(np.concatenate([c[j] for c in cap]) for j in range(1, 7))


def cells_tier_parts(K, m, v, mt, vt, pabs, clip):
    """The cells tier on each row's own partition: (stage 1, total, usable, the unit edges),
    host arrays."""
    import jax
    from jaxguard.core import fastbound

    @jax.jit
    def parts(k, m, v, mt, vt, pabs, clip):
        edges = fastbound.adaptive_edge_list(k, v, vt, clip, fastbound.FAST_CELLS_GAMMAS)
        ideal, u1 = fastbound.fast_cells_bound(k, m, v, mt, vt, pabs, clip, edges, no_radius=True)
        total, u2 = fastbound.fast_cells_bound(k, m, v, mt, vt, pabs, clip, edges)
        return ideal, total, u1 & u2, edges
    ideal, total, usable, edges = parts(K, m, v, mt, vt, pabs, clip)
    return np.asarray(ideal), np.asarray(total), np.asarray(usable), [np.asarray(e) for e in edges]


def looseness(items, encode_many):
    """Rows the cells tier refuses during one encode: the cells tier's bound, its stage-1 and
    stage-2 parts, and the 28-cell adaptive cell bound, as multiples of the threshold."""
    from jaxguard.core import bound as _bound
    K, m, v, mt, vt, pabs, clip = capture_refused(items, encode_many)
    ideal, total, usable, _ = cells_tier_parts(K, m, v, mt, vt, pabs, clip)
    adaptive = np.asarray(_bound.batch_bound_adaptive_pc(K, m, v, mt, vt, pabs, clip))
    thr = K.threshold
    ok = (adaptive >= 0) & (adaptive <= thr)
    rows = []
    for name, sel in (("all", usable), ("the adaptive bound certifies", usable & ok),
                      ("the adaptive bound refuses", usable & ~ok)):
        q = lambda x: np.percentile(x[sel] / thr[sel], [10, 50, 90])   # noqa: E731
        rows.append((name, int(sel.sum()), q(total), q(ideal), q(total - ideal), q(adaptive)))
    return m.size, float(ok[usable].mean()), rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "experiments" / "results" / "ans_frontier.md"))
    ap.add_argument("--cache", default=str(ROOT / "bench" / ".cache"))
    args = ap.parse_args()
    from fast_cells_escapes import _items
    from jaxguard.core import guard, rate
    sets = [(name, _items(ck, "logrel-ans")) for name, ck in checkpoints(pathlib.Path(args.cache))]
    state = {"search": "full", "move": "full", "in_rate": False}
    guard.certify_pc = _tiered(guard.certify_pc, lambda: state["move" if state["in_rate"] else "search"])
    real_optimize = rate.optimize

    def optimize(*a, **k):
        if state["move"] == "none":
            k["rounds"] = 0
        state["in_rate"] = True
        try:
            return real_optimize(*a, **k)
        finally:
            state["in_rate"] = False
    rate.optimize = optimize
    for _, items in sets:      # compile every program once
        guard.encode_many(items)
    table, zrows = [], []
    t_start = time.time()
    for search, move in VARIANTS:
        state["search"], state["move"] = search, move
        for name, items in sets:
            t0 = time.perf_counter()
            encs = guard.encode_many(items)
            dt = time.perf_counter() - t0
            raw = sum(e.stats["raw_fp32_bytes"] for e in encs)
            pay = sum(e.stats["payload_bytes"] for e in encs)
            esc = sum(e.stats["escapes"] for e in encs)
            table.append((search, move, name, 100 * pay / raw, esc, dt))
            print(table[-1], flush=True)
            if (search, move) == ("full", "full"):
                side = sum(e.arrays["m_params"].nbytes + e.arrays["v_params"].nbytes + e.arrays["widths"].nbytes
                           + 8 * e.arrays["escape_index"].size for e in encs)
                zrows.append((name, 100 * (pay - side) / raw, 100 * zlib_codes_bytes(encs) / raw))
    state["search"] = state["move"] = "full"
    n_cap, share, loose = looseness(sets[0][1], guard.encode_many)
    lines = ["# logrel-ans: payload and encode time by certificate tier (issue 26)", "",
             f"`python bench/experiments/ans_frontier.py` ({time.time() - t_start:.0f} s; "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, one encode thread, warm "
             "programs, one run per cell).  Search / moves: the tiers the width search and the rate pass may "
             "certify with (full: up to the adaptive partitions, logrel-ans as shipped; cells: the closed form and "
             "the cells tier; closed: the closed form; none: no rate pass).  The stored codes are always "
             "certified again in full, so every row keeps the guarantee.", "",
             "| search | moves | checkpoint | payload % of FP32 | escapes | encode s |", "|---|---|---|---:|---:|---:|"]
    lines += [f"| {s} | {m} | {n} | {p:.3f} | {e} | {t:.2f} |" for s, m, n, p, e, t in table]
    lines += ["", "## The code streams: rANS (as stored) against DEFLATE (zlib, best of three strategies)", "",
              "| checkpoint | codes as rANS, % of FP32 | codes as DEFLATE | difference (points) |",
              "|---|---:|---:|---:|"]
    lines += [f"| {n} | {r:.3f} | {z:.3f} | {z - r:+.3f} |" for n, r, z in zrows]
    lines += ["", f"## The cells tier at the rate pass's margin ({sets[0][0]})", "",
              f"{n_cap:,} rows the cells tier refused during one encode (the first {n_cap:,} captured); the 28-cell "
              f"adaptive cell bound certifies {100 * share:.1f}% of them.  Percentiles 10 / 50 / 90 of each quantity "
              "over the threshold:", "",
              "| rows | n | cells tier total | its stage 1 (ideal) | its stage 2 (native) | adaptive cell bound |",
              "|---|---:|---|---|---|---|"]
    fmt = lambda x: " / ".join(f"{y:.3f}" for y in x)   # noqa: E731
    lines += [f"| {n} | {c:,} | {fmt(a)} | {fmt(b)} | {fmt(d)} | {fmt(e)} |" for n, c, a, b, d, e in loose]
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
