"""Where the certificate time of a logrel-ans encode goes: every jitted kernel call of the
guard timed (synchronously) and grouped by caller stage (rate pass, width search, final
certificate) and kernel (closed-form tier, level-0 lower bound, cell levels by chunk).

    python bench/experiments/ans_certify_split.py CKPT.pt

One warm-up encode, then one timed encode of `writer.to_bytes` on the checkpoint's records.
"""
from __future__ import annotations

import collections
import sys
import time
import traceback

import jax
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from ans_profile import records  # noqa: E402


def main():
    from jaxguard import writer
    from jaxguard.core import programs
    ckpt = sys.argv[1]
    writer.to_bytes(records(ckpt, "logrel-ans"), {})
    orig = programs.call
    acc = collections.defaultdict(lambda: [0.0, 0, 0])

    def timed(fn, *args, **static):
        t0 = time.perf_counter()
        out = jax.block_until_ready(orig(fn, *args, **static))
        dt = time.perf_counter() - t0
        names = [f.name for f in traceback.extract_stack(limit=40)]
        stage = ("rate" if "optimize" in names else "width" if "choose_and_certify" in names
                 else "final" if "_encode_group" in names else "other")
        n = int(np.shape(args[2])[0]) if len(args) > 2 and np.ndim(args[2]) else 0
        key = (stage, getattr(fn, "__name__", str(fn)), n)
        acc[key][0] += dt
        acc[key][1] += 1
        acc[key][2] += n
        return out

    programs.call = timed
    t0 = time.perf_counter()
    writer.to_bytes(records(ckpt, "logrel-ans"), {})
    total = time.perf_counter() - t0
    print(f"timed encode {total:.2f} s (kernels synchronous)")
    print("| stage | kernel | chunk | calls | coordinates | seconds | share |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for (stage, name, n), (s, c, cnt) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        print(f"| {stage} | {name} | {n} | {c} | {cnt} | {s:.2f} | {100 * s / total:.1f}% |")
    by = collections.defaultdict(float)
    for (stage, _, _), (s, _, _) in acc.items():
        by[stage] += s
    print("per stage:", {k: round(v, 2) for k, v in by.items()})


if __name__ == "__main__":
    main()
