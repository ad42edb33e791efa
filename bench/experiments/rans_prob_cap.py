"""What the rANS decode tables of a logrel-ans container cost, and what capping P would save.

Every rANS model has 2**P slots (P in 8..15, chosen per model for the fewest coded bits), and
the decoder builds a slot table for each.  This reads a logrel-ans container, decodes its
``mv_rans`` sections, re-encodes the same symbols with P capped (per model: no cap, log2 of
its symbols + 1, 12) and reports the bytes, the encode time and the decode time
(`rans.decode_streams_many`, best of 3), checking the round trip.

    python bench/experiments/rans_prob_cap.py CONTAINER.jg [--out bench/experiments/results/rans_prob_cap.md]

CONTAINER.jg: e.g. ``jaxguard compress SRC -o C.jg --codec logrel-ans`` of bench/codec_speed.py's
16.5M-coordinate checkpoint.
"""
from __future__ import annotations

import argparse
import math
import pathlib
import platform
import time

import numpy as np

from jaxguard.format import reader, rans

CAPS = (("none (shipped)", None), ("log2(symbols) + 1", lambda n, w: max(w, math.ceil(math.log2(max(n, 2))) + 1)),
        ("12", lambda n, w: max(w, 12)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("container")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "results" / "rans_prob_cap.md"))
    args = ap.parse_args()
    data = pathlib.Path(args.container).read_bytes()
    header, payload = reader.parse(data)
    items = []
    for e in header["entries"]:
        s = e.get("sections") if e.get("kind") == "moments" else None
        if isinstance(s, dict) and "mv_rans" in s:
            _, n = reader.shape_size(e)
            items.append(reader._rans_item(e["name"], s, payload, n, max(1, -(-n // reader.BLOCK))))
    dec = rans.decode_streams_many(items, "mv", lane_tails=True)
    raw = 8 * sum(n for _, _, n in items)
    ps = np.array([p for b, ab, n in items for mods in rans._parse(b, ab, n, None, "x", True)[3]
                   for p, _ in mods.values()])
    real_fit = rans.fit_compact_model
    rows = []
    for name, cap in CAPS:
        def fit(hist, w, cands, cap=cap):
            if cap is not None:
                c = cap(int(hist.sum()), w)
                cands = [p for p in cands if p <= c] or [min(cands)]
            return real_fit(hist, w, cands)
        rans.fit_compact_model = fit
        try:
            t = time.perf_counter()
            bufs = rans.encode_streams_many([(sym, ab, n, None, tails) for (_, ab, n), (sym, tails) in zip(items, dec)],
                                    compact_models=True, lane_tails=True)
            t_enc = time.perf_counter() - t
        finally:
            rans.fit_compact_model = real_fit
        new = [(b, ab, n) for b, (_, ab, n) in zip(bufs, items)]
        t_dec = []
        for _ in range(3):
            t = time.perf_counter()
            out = rans.decode_streams_many(new, "mv", lane_tails=True)
            t_dec.append(time.perf_counter() - t)
        same = all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(out, dec))
        slots = sum(1 << p for b in new for mods in rans._parse(*b, None, "x", True)[3] for p, _ in mods.values())
        rows.append((name, sum(len(b) for b in bufs), slots, t_enc, min(t_dec), same))
        print(rows[-1], flush=True)
    base = rows[0][1]
    lines = [f"# rANS decode tables and P (issue 26)", "",
             f"`python bench/experiments/rans_prob_cap.py {pathlib.Path(args.container).name}`: {len(items)} tensors, "
             f"{raw // 8:,} coordinates, {ps.size} models (P = 15 for {int((ps == 15).sum())}); "
             f"{platform.processor() or platform.machine()}, one run each.", "",
             "| P cap | rANS bytes, % of FP32 | vs shipped, points | table slots | encode s | decode s (best of 3) | "
             "round trip |", "|---|---:|---:|---:|---:|---:|---|"]
    lines += [f"| {n} | {100 * b / raw:.4f} | {100 * (b - base) / raw:+.4f} | {sl:,} | {te:.2f} | {td:.3f} | {ok} |"
              for n, b, sl, te, td, ok in rows]
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
