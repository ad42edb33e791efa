"""Whole-process compress / restore of one torch checkpoint: logrel-ans of an older tree
(--old, a source tree such as `git archive REV`) beside this tree's, and log8-rel, all
interleaved round by round (a shared machine: compare within the run), medians.

    python bench/ans_process.py CKPT.pt --old /tmp/old_tree [--rounds 3] [--work DIR]

Each run is ``python -m jaxguard compress|restore`` with PYTHONPATH set to the tree; one
warm-up compress per (tree, codec) first (XLA and program caches).
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(tree, *argv):
    env = dict(os.environ, PYTHONPATH=tree)
    t0 = time.perf_counter()
    # cwd = the tree: `python -m` puts the working directory ahead of PYTHONPATH
    r = subprocess.run([sys.executable, "-m", "jaxguard", *argv], env=env, cwd=tree, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"{tree} {argv}: {r.stderr[-2000:]}")
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--old", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", default=None)
    args = ap.parse_args()
    work = os.path.abspath(args.work or tempfile.mkdtemp())
    os.makedirs(work, exist_ok=True)
    args.old = os.path.abspath(args.old)
    cases = {"logrel-ans (old)": (args.old, "logrel-ans"), "logrel-ans (new)": (ROOT, "logrel-ans"),
             "log8-rel": (ROOT, "log8-rel")}
    ckpt = os.path.abspath(args.ckpt)
    for name, (tree, codec) in cases.items():
        out = os.path.join(work, name.replace(" ", "_").replace("(", "").replace(")", "") + ".jg")
        run(tree, "compress", ckpt, "-o", out, "--codec", codec)
    times = {name: ([], []) for name in cases}
    for r in range(args.rounds):
        for name, (tree, codec) in cases.items():
            out = os.path.join(work, name.replace(" ", "_").replace("(", "").replace(")", "") + ".jg")
            times[name][0].append(run(tree, "compress", ckpt, "-o", out, "--codec", codec))
            times[name][1].append(run(tree, "restore", out, "-o", out + ".pt"))
            print(r, name, times[name][0][-1], times[name][1][-1], os.path.getsize(out), flush=True)
    base_c = statistics.median(times["log8-rel"][0])
    base_r = statistics.median(times["log8-rel"][1])
    print("| codec | compress s (median) | / log8-rel | restore s (median) | / log8-rel |")
    print("|---|---:|---:|---:|---:|")
    for name, (c, r) in times.items():
        mc, mr = statistics.median(c), statistics.median(r)
        print(f"| {name} | {mc:.2f} | {mc / base_c:.2f} | {mr:.2f} | {mr / base_r:.2f} |")


if __name__ == "__main__":
    main()
