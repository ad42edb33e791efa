"""Integrity-hash throughput on float32 slabs, as the container writer feeds them.

    python bench/hash_speed.py [--gib 1] [--slab-mib 16] [--repeats 3] [--out bench/results/hash_speed]

Hashes ``--gib`` GiB of float32 (a normal draw, like decoded moments) fed in slabs of
``--slab-mib`` MiB (and of 1 MiB) with each candidate: hashlib SHA-256 (OpenSSL; SHA-NI
where the CPU has it), hashlib BLAKE2b, BLAKE3 (the `blake3` wheel, one thread and
``max_threads=2``) and xxHash's XXH3-128 (not cryptographic).  Prints and writes the median
seconds and GB/s of each.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import time

import numpy as np


def candidates():
    import blake3
    import xxhash
    return {
        "sha256 (hashlib/OpenSSL)": hashlib.sha256,
        "blake2b (hashlib)": hashlib.blake2b,
        "blake3 (1 thread)": blake3.blake3,
        "blake3 (max_threads=2)": lambda: blake3.blake3(max_threads=2),
        "xxh3_128 (xxhash, not cryptographic)": xxhash.xxh3_128,
    }


def time_one(make, slabs, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        h = make()
        for s in slabs:
            h.update(s)
        h.digest()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--slab-mib", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    a = ap.parse_args(argv)
    n = int(a.gib * (1 << 30)) // 4
    data = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    rows = []
    for slab_mib in sorted({a.slab_mib, 1}):
        step = slab_mib * (1 << 20) // 4
        slabs = [memoryview(data[i:i + step]).cast("B") for i in range(0, n, step)]
        for name, make in candidates().items():
            sec = time_one(make, slabs, a.repeats)
            rows.append({"hash": name, "slab_mib": slab_mib, "seconds": round(sec, 4),
                         "gb_per_s": round(data.nbytes / sec / 1e9, 3)})
            print(f"{name:40s} slab {slab_mib:3d} MiB  {sec:7.3f} s  {data.nbytes / sec / 1e9:6.2f} GB/s", flush=True)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared box"
    if a.out:
        with open(a.out + ".json", "w") as fh:
            json.dump({"bytes": data.nbytes, "repeats": a.repeats, "machine": machine, "rows": rows}, fh, indent=1)
        with open(a.out + ".md", "w") as fh:
            fh.write(f"# hash_speed\n\n`python bench/hash_speed.py --gib {a.gib} --slab-mib {a.slab_mib} "
                     f"--repeats {a.repeats}`: {data.nbytes:,} bytes of float32, median of {a.repeats}, "
                     f"run alone through the box's quiet lock ({machine}).\n\n"
                     "| hash | slab | seconds | GB/s |\n|---|---:|---:|---:|\n")
            for r in rows:
                fh.write(f"| {r['hash']} | {r['slab_mib']} MiB | {r['seconds']:.3f} | {r['gb_per_s']:.2f} |\n")


if __name__ == "__main__":
    main()
