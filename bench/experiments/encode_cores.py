"""Does the in-process encode use the cores it is given?  One core against all of them,
with XLA's intra-op pool as jax starts it and with a pool of one thread (issue 25).

    python bench/experiments/encode_cores.py [--size 60] [--repeats 3] [--out bench/experiments/results/encode_cores.md]

The bench's trained state (the ByteTransformer of bench/codec_speed.py, tiled to ``--size``
million coordinates, log8-rel) is encoded with `writer.container_entries` in a fresh process per mode,
with jax's synchronous CPU dispatch as `jaxguard compress` runs it: a first pass compiles,
then ``--repeats`` passes are timed (wall and the process's CPU).  Modes:

* one core: ``taskset -c`` one CPU (one encode thread);
* all cores, XLA's pool: the encode threads `writer.encode_threads` picks, and the
  intra-op pool jax starts with (a thread a CPU), which splits large fusions over the cores;
* all cores, one-thread pool: the same threads, the backend started by
  `jaxguard.cli.main.start_cpu_backend_one_thread_pool` (what `jaxguard compress` does
  when it runs two or more encode threads);
* one encode thread, XLA's pool or a one-thread pool: ``JAXGUARD_ENCODE_THREADS=1`` on all
  cores.

Every mode must give the same bytes (SHA-256 over every encoding's arrays).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

MODES = {
    "one core": ({}, True, False),
    "all cores, XLA's pool": ({}, False, False),
    "all cores, one-thread pool": ({}, False, True),
    "one encode thread, XLA's pool": ({"JAXGUARD_ENCODE_THREADS": "1"}, False, False),
    "one encode thread, one-thread pool": ({"JAXGUARD_ENCODE_THREADS": "1"}, False, True),
}


def _run(src, size, repeats, one_pool):
    """In this process: encode the tiled state `repeats` + 1 times; print a JSON line."""
    import jax
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    pool1 = False
    if one_pool:
        from jaxguard.cli.main import start_cpu_backend_one_thread_pool
        pool1 = start_cpu_backend_one_thread_pool()
    import torch

    import codec_speed
    import torch_compat.state as S
    from jaxguard import writer
    from jaxguard.audit import new_totals
    from jaxguard.core.config import GuardSpec
    base = torch.load(src, weights_only=False)
    per = sum(st["exp_avg"].numel() for st in base["optimizer"]["state"].values())
    ck = codec_speed.tiled(base, max(1, round(size * 1e6 / per)))
    walls, cpus, digest, n = [], [], None, 0
    for rep in range(repeats + 1):
        _, records = S.state_records(ck["optimizer"], ck["model"], spec=GuardSpec(codec="log8-rel"))
        h = hashlib.sha256()
        t, c0 = time.perf_counter(), os.times()
        totals = new_totals()
        for e in writer.container_entries(records, totals):
            if isinstance(e, writer.Moments):
                for k in sorted(e.encoded.arrays):
                    h.update(memoryview(e.encoded.arrays[k]).cast("B") if e.encoded.arrays[k].size else b"")
        wall, c1 = time.perf_counter() - t, os.times()
        if rep:   # the first pass compiles
            walls.append(wall)
            cpus.append(c1.user - c0.user + c1.system - c0.system)
        digest, n = h.hexdigest(), totals["coordinates"]
    print(json.dumps({"coordinates": n, "walls": walls, "cpus": cpus, "sha256": digest, "one_thread_pool": pool1,
                      "threads": writer.encode_threads(n), "affinity": len(os.sched_getaffinity(0))}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--src", default=None, help="a torch checkpoint (default: the bench's ByteTransformer, trained "
                                                "and cached under bench/.cache)")
    ap.add_argument("--size", type=float, default=60, help="million coordinates")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--one-pool", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.run:
        return _run(a.run, a.size, a.repeats, a.one_pool)
    src = a.src
    if src is None:
        import torch

        import codec_speed
        src = ROOT / "bench" / ".cache" / "codec_speed_base60.pt"
        if not src.exists():
            src.parent.mkdir(parents=True, exist_ok=True)
            torch.save(codec_speed.train_checkpoint(60), src)
    cpu0 = str(min(os.sched_getaffinity(0)))
    rows = {}
    for mode, (env, one_core, one_pool) in MODES.items():
        cmd = [sys.executable, __file__, "--run", str(src), "--size", str(a.size), "--repeats", str(a.repeats)]
        cmd = (["taskset", "-c", cpu0] if one_core else []) + cmd + (["--one-pool"] if one_pool else [])
        res = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, cwd=ROOT)
        if res.returncode:
            sys.exit(f"{mode}: exit {res.returncode}\n{res.stderr[-3000:]}")
        rows[mode] = json.loads(res.stdout.strip().splitlines()[-1])
        r = rows[mode]
        print(mode, f"{statistics.median(r['walls']):.2f} s", r["walls"], r["cpus"], flush=True)
    one = statistics.median(rows["one core"]["walls"])
    same = len({r["sha256"] for r in rows.values()}) == 1
    n = rows["one core"]["coordinates"]
    lines = ["# In-process encode: one core against all of them, and XLA's intra-op pool", "",
             f"Machine: {platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} CPUs. "
             f"`python bench/experiments/encode_cores.py --size {a.size:g} --repeats {a.repeats}`: the bench's "
             f"ByteTransformer state tiled to {n:,} coordinates, log8-rel, `writer.container_entries` in a fresh process per "
             "mode with jax's synchronous CPU dispatch (as `jaxguard compress`); first pass not timed.", "",
             "| mode | encode threads | one-thread pool | wall s (median) | each pass | CPU s each pass | M coords/s "
             "| x one core |", "|---|---:|---|---:|---|---|---:|---:|"]
    for mode, r in rows.items():
        w = statistics.median(r["walls"])
        lines.append(f"| {mode} | {r['threads']} | {'yes' if r['one_thread_pool'] else 'no'} | {w:.2f} | "
                     f"{' / '.join(f'{x:.2f}' for x in r['walls'])} | {' / '.join(f'{x:.2f}' for x in r['cpus'])} | "
                     f"{n / w / 1e6:.1f} | {one / w:.2f}x |")
    lines += ["", f"Same bytes in every mode: {'yes' if same else '**no**'} (SHA-256 over every encoding's arrays)."]
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
