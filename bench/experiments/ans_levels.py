"""logrel-ans payload and encode time against the certificate depth of its searches: the rate
pass's moves (`rate.MOVE_MAX_LEVEL`) and the width search (`rate.SEARCH_MAX_LEVEL`).
The final certificate of every stored code is the full one in every variant.

    python bench/experiments/ans_levels.py CKPT.pt [--variants none:none,3:none,3:3,2:none] [--rounds 1]

One warm-up encode, then the variants interleaved --rounds times (a shared machine:
compare within a run).  Prints payload (% of FP32), escapes and median encode seconds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ans_profile import records  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--variants", default="none:none,3:none,3:3,2:none")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    from jaxguard import writer
    from jaxguard.core import rate
    lvl = lambda s: None if s.lower() == "none" else int(s)   # noqa: E731
    variants = [tuple(map(lvl, v.split(":"))) for v in args.variants.split(",")]
    writer.to_bytes(records(args.ckpt, "logrel-ans"), {})
    res = {v: [] for v in variants}
    for _ in range(args.rounds):
        for v in variants:
            rate.MOVE_MAX_LEVEL, rate.SEARCH_MAX_LEVEL = v
            t0 = time.perf_counter()
            _, s = writer.to_bytes(records(args.ckpt, "logrel-ans"), {})
            res[v].append((time.perf_counter() - t0, s["payload_bytes"], s["raw_fp32_bytes"], s["escapes"]))
            print(v, res[v][-1], flush=True)
    print("| rate moves up to level | width search up to level | payload % of FP32 | escapes | encode s (median) |")
    print("|---|---|---:|---:|---:|")
    for v, rs in res.items():
        t = statistics.median(r[0] for r in rs)
        print(f"| {v[0]} | {v[1]} | {100 * rs[0][1] / rs[0][2]:.2f} | {rs[0][3]} | {t:.1f} |")


if __name__ == "__main__":
    main()
