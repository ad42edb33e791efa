"""In-process certification throughput of log8-rel (the default codec), per stage, 1 core vs 2.

    python bench/cert_speed.py [--sizes 1,4,16,64] [--cores 1,2] [--before DIR] [--out bench/results/cert_speed]

The state is trained, not drawn: the ByteTransformer of bench/codec_speed.py (867,328 Adam
coordinates, 60 steps of the real ``torch.optim.Adam``), tiled to each size by referencing the
same tensors again (no copies, so the process's memory does not grow with the size), encoded by
`jaxguard.writer.container_entries` (slabs of `writer.SLAB` coordinates, as `jaxguard compress` does) with
default tau/C, then SHA-256 of each entry's certified values (what the container hashes).

Each measurement is a child process pinned with ``taskset`` to 1 or 2 cores, after one warm-up
encode of the same size (compilations); with ``--before DIR`` (a `git archive` of an earlier commit) the same
children run that code too, interleaved with this checkout's (before, after, before, after...),
so the load of a shared machine hits both alike.  The per-stage timer wraps the guard's pieces
that exist in the code it runs (summed over the encoding threads) (`guard._propose_chunked`, `_group_constants`, `fast_accept`,
`certify_pc`, ...); "host rest" is `encode_many` minus them (laying slabs out, escapes, arrays).
Also checked in every child: the escapes and codes are the same as the first child's (a hash of
every entry's arrays), so a faster path that changed a byte fails the bench.

Writes JSON, Markdown and a PNG (coordinates/s against size, 1 and 2 cores) next to --out.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASE = os.path.join(os.environ.get("TMPDIR", "/tmp"), "jaxguard-certspeed-base.pt")
STAGES = ("_propose_chunked", "_group_constants", "fast_accept", "certify_pc", "payload_bytes")


def _base():
    import torch
    if not os.path.exists(BASE):
        sys.path.insert(0, os.path.join(ROOT, "bench"))
        from codec_speed import train_checkpoint
        ck = train_checkpoint(60)
        torch.save(ck, BASE + ".tmp")
        os.replace(BASE + ".tmp", BASE)
    return torch.load(BASE)


def _tiled(base, r):
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    from codec_speed import tiled
    return tiled(base, r)


def child(sizes_m):
    import resource

    import numpy as np

    import torch_compat.state as S
    from jaxguard import writer
    from jaxguard.core import guard
    from jaxguard.core.config import GuardSpec
    timers: dict = {}

    def wrap(mod, name):
        fn = getattr(mod, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                timers[name] = timers.get(name, 0.0) + time.perf_counter() - t
        setattr(mod, name, timed)

    for name in STAGES:
        if hasattr(guard, name):
            wrap(guard, name)
    wrap(guard, "encode_many")
    base = _base()
    per = sum(st["exp_avg"].numel() for st in base["optimizer"]["state"].values())

    def run(r):
        timers.clear()
        ck = _tiled(base, r)
        totals = writer.new_totals()
        _, records = S.state_records(ck["optimizer"], ck["model"], spec=GuardSpec(codec="log8-rel"))
        digest = hashlib.sha256()
        t_sha = t_check = 0.0
        t0 = time.perf_counter()
        for e in writer.container_entries(records, totals):
            if isinstance(e, writer.Moments):
                t = time.perf_counter()
                for x in e.encoded.decoded:
                    hashlib.sha256(memoryview(x)).digest()
                t_sha += time.perf_counter() - t
                t = time.perf_counter()
                for k in sorted(e.encoded.arrays):   # the bytes (codes, params, escapes): not timed
                    digest.update(k.encode() + memoryview(np.ascontiguousarray(e.encoded.arrays[k])).cast("B"))
                t_check += time.perf_counter() - t
        sec = time.perf_counter() - t0 - t_check
        stages = {k: v for k, v in timers.items() if k != "encode_many"}
        stages["host rest (encode_many - stages)"] = timers.get("encode_many", 0.0) - sum(stages.values())
        stages["writer.container_entries outside encode_many"] = sec - t_sha - timers.get("encode_many", 0.0)
        stages["sha256 of certified values"] = t_sha
        return sec, totals, stages, digest.hexdigest()

    rows = []
    for m in sizes_m:
        r = max(1, round(m * 1e6 / per))
        run(r)   # warm-up: compiles this size's slab shapes (the last slab's is its own)
        sec, totals, stages, dig = run(r)
        n = totals["coordinates"]
        rows.append({"coordinates": n, "seconds": sec, "coords_per_s": n / sec, "escapes": totals["escapes"],
                     "exact": totals["exact"], "payload_bytes": totals["payload_bytes"], "stages": stages,
                     "bytes_sha256": dig,
                     "maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
    print(json.dumps(rows))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,4,16,64", help="millions of coordinates")
    ap.add_argument("--cores", default="1,2")
    ap.add_argument("--before", default=None, help="a checkout of earlier code, run interleaved")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "cert_speed"))
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    sizes = [float(s) for s in a.sizes.split(",") if s]
    if a.child is not None:
        return child(sizes)
    _base()   # trained once, outside the timed children
    codes = [("after", ROOT)] + ([("before", os.path.abspath(a.before))] if a.before else [])
    load0 = os.getloadavg()
    results = []
    for rep in range(a.repeats):
        for ncores in [int(c) for c in a.cores.split(",")]:
            for label, root in reversed(codes):
                cpus = ",".join(str(i) for i in range(ncores))
                # one encode thread per pinned core (the library's default leaves one to the writer)
                env = {**os.environ, "PYTHONPATH": root, "JAXGUARD_ENCODE_THREADS": str(ncores)}
                t = time.perf_counter()
                out = subprocess.run(["taskset", "-c", cpus, sys.executable, os.path.join(ROOT, "bench", "cert_speed.py"),
                                      "--child", "1", "--sizes", a.sizes], env=env, cwd=root, capture_output=True,
                                     text=True)
                if out.returncode:
                    sys.exit(f"child failed ({label}, {ncores} cores):\n{out.stderr[-3000:]}")
                rows = json.loads(out.stdout.strip().splitlines()[-1])
                results.append({"code": label, "cores": ncores, "repeat": rep, "rows": rows,
                                "process_seconds": time.perf_counter() - t})
                for r in rows:
                    print(f"{label:6s} {ncores} core(s) {r['coordinates']:>12,}: {r['seconds']:7.2f} s "
                          f"{r['coords_per_s'] / 1e6:6.2f} M/s  rss {r['maxrss_mib']:.0f} MiB  "
                          + "  ".join(f"{k} {v:.2f}" for k, v in r["stages"].items()), flush=True)
    same = len({tuple(r["bytes_sha256"] for r in res["rows"]) for res in results}) == 1
    res = {"machine": f"{platform.machine()}, {os.cpu_count()} cores (2-core AMD EPYC, shared with three other "
                      "engineers' tests: loaded)", "load_avg_start": load0, "load_avg_end": os.getloadavg(),
           "python": sys.version.split()[0], "bytes_identical_across_runs": same, "results": results}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as fh:
        json.dump(res, fh, indent=1)
    _plot(res, a.out + ".png")
    print("bytes identical across all runs:", same)
    if not same:
        sys.exit("the encoded bytes differ between runs")


def _plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in res["results"]:
        if r["repeat"]:
            continue
        x = [row["coordinates"] for row in r["rows"]]
        y = [row["coords_per_s"] / 1e6 for row in r["rows"]]
        ax.plot(x, y, "o-" if r["code"] == "after" else "s--", label=f"{r['code']}, {r['cores']} core(s)")
    ax.set_xscale("log")
    ax.set_xlabel("Adam coordinates")
    ax.set_ylabel("certified M coordinates / s (log8-rel)")
    ax.axhline(30, color="grey", lw=0.5)
    ax.set_title("in-process certification, 2-core AMD EPYC (loaded)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
