"""Where a small group's ladder (`certify.SPEED_TIERS_ABOVE`) pays: the first `jaxguard.save`
of a fresh process, cold (an empty program cache) and warm (the cache one untimed process of
the same ladder and size filled), for optax states of several sizes, each group on the full
ladder and on a small group's ladder, whatever its size.

    python bench/experiments/small_group_ladder.py [--sizes 4096,65536,262144,1048576] [--repeats 2]
        [--out bench/experiments/results/small_group_ladder.md]

The state: ``{"w": linspace(-1, 1, N)}`` after 3 ``optax.adamw`` steps (the README's example
at N = 4,096), one group.  Each run is a fresh ``python`` with its own ``XDG_CACHE_HOME``;
the save is timed inside the process after the state's set-up (lazy imports included), with
the process's CPU time over the same span.  Runs interleave the two ladders.  Time it on a
box held alone.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]

PROBE = r"""
import json, os, sys, time
ladder, n = sys.argv[1], int(sys.argv[2])
import jaxguard as jg
from jaxguard.core import guard
guard.SPEED_TIERS_ABOVE = -1 if ladder == "full" else 1 << 62
import jax, jax.numpy as jnp, optax
params = {"w": jnp.linspace(-1.0, 1.0, n)}
tx = optax.adamw(1e-3, weight_decay=1e-2)
state = tx.init(params)
for step in range(3):
    grads = {"w": jnp.sin(params["w"] * (step + 1)) * 0.1}
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
jax.block_until_ready(state)
t, c = time.perf_counter(), time.process_time()
info = jg.save(sys.argv[3], state, params, tx=tx)
print(json.dumps({"save": time.perf_counter() - t, "cpu": time.process_time() - c, "escapes": info["escapes"],
                  "payload": info["payload_bytes"]}))
"""


def run(ladder, n, cache, out):
    env = dict(os.environ, XDG_CACHE_HOME=cache, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", PROBE, ladder, str(n), out], env=env, capture_output=True, text=True,
                       check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,65536,262144,1048576")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    res = {}
    with tempfile.TemporaryDirectory() as work:
        warm = {lad: os.path.join(work, f"warm-{lad}") for lad in ("full", "small")}
        for n in sizes:
            for lad in ("full", "small"):
                run(lad, n, warm[lad], os.path.join(work, "w.jg"))   # fills that ladder's cache for size n
        for rep in range(a.repeats):
            for n in sizes:
                for lad in ("full", "small"):
                    cold = os.path.join(work, f"cold-{rep}-{n}-{lad}")
                    for kind, cache in (("cold", cold), ("warm", warm[lad])):
                        r = run(lad, n, cache, os.path.join(work, "o.jg"))
                        res.setdefault((n, lad, kind), []).append(r)
                        print(n, lad, kind, r, flush=True)
    lines = ["# A small group's ladder against the full one: the first save of a fresh process", "",
             "`python bench/experiments/small_group_ladder.py` (this file's command; "
             f"{a.repeats} interleaved runs, medians): the first `jaxguard.save` of an optax adamw state of N "
             "coordinates (one group), every group on the full ladder or on a small group's ladder "
             "(`certify.SPEED_TIERS_ABOVE`). Seconds of the call, then the process's CPU seconds over it.", "",
             "| N | cold, full | cold, small | warm, full | warm, small | escapes full / small | payload bytes full / small |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    med = lambda n, lad, kind, k: statistics.median(r[k] for r in res[(n, lad, kind)])  # noqa: E731
    for n in sizes:
        cells = [f"{med(n, lad, kind, 'save'):.2f} s ({med(n, lad, kind, 'cpu'):.2f})"
                 for kind in ("cold", "warm") for lad in ("full", "small")]
        esc = [res[(n, lad, "warm")][0]["escapes"] for lad in ("full", "small")]
        pay = [res[(n, lad, "warm")][0]["payload"] for lad in ("full", "small")]
        lines.append(f"| {n:,} | " + " | ".join(cells) + f" | {esc[0]:,} / {esc[1]:,} | {pay[0]:,} / {pay[1]:,} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
