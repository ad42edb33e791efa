"""Where the smaller ladders pay (`certify.SPEED_TIERS_ABOVE` for a group,
`certify.CELLS_TIERS_ABOVE` for a state): the first save of a fresh process, cold (an empty
program cache) and warm (the cache one untimed process of the same ladder and state filled),
and a whole `jaxguard compress`, each group on one ladder whatever its size.

    python bench/experiments/small_group_ladder.py [--sizes 4096,65536,131072,262144,1048576] [--repeats 2]
        [--compress CKPT ...] [--out bench/experiments/results/small_group_ladder.md]

Ladders: ``full`` (every tier), ``no-cells`` (the closed form, then the 28-cell adaptive
partition: a state of at most `certify.CELLS_TIERS_ABOVE` coordinates), ``small`` (no closed
form either: a group of at most `certify.SPEED_TIERS_ABOVE`).
States: ``{"w": linspace(-1, 1, N)}`` after 3 ``optax.adamw`` steps, saved with
``jaxguard.save(..., tx=tx)`` (the README's example at N = 4,096), and bench/first_save.py's
torch state (a 1,001,500-coordinate MLP 3 ``torch.optim.AdamW`` steps in,
``torch_compat.save``); one group each.  Each run is a fresh ``python`` with its own
``XDG_CACHE_HOME``; the save is timed inside the process after the state's set-up (lazy imports
included), with the process's CPU time over the same span.  ``--compress``: ``jaxguard
compress CKPT`` in a fresh process per ladder (warm cache), the encode seconds it reports and
the process's wall time, interleaved.  Time it on a box held alone.
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
import textwrap
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from first_save import OPTAX_STATE, TORCH_STATE  # noqa: E402   (the states bench/first_save.py saves)
LADDERS = ("full", "no-cells", "small")

SETUP = r"""
import json, os, sys, time
ladder = sys.argv[1]
from jaxguard.core import guard
guard.SPEED_TIERS_ABOVE = 1 << 62 if ladder == "small" else -1
guard.CELLS_TIERS_ABOVE = -1 if ladder == "full" else 1 << 62
"""

PROBE = SETUP + r"""
state_kind, out = sys.argv[2], sys.argv[3]
if state_kind == "torch":
    import torch_compat
""" + textwrap.indent(TORCH_STATE, "    ") + r"""
    save = lambda: torch_compat.save(out, opt)
else:
    import jaxguard as jg
""" + textwrap.indent(OPTAX_STATE.replace("COORDINATES", "int(state_kind)"), "    ") + r"""
    save = lambda: jg.save(out, state, params, tx=tx)
t, c = time.perf_counter(), time.process_time()
info = save()
info = info if isinstance(info, dict) else {}
print(json.dumps({"save": time.perf_counter() - t, "cpu": time.process_time() - c,
                  "escapes": info.get("escapes"), "payload": info.get("payload_bytes")}))
"""

COMPRESS = SETUP + r"""
import contextlib, io
from jaxguard.cli.main import main
buf = io.StringIO()
t = time.perf_counter()
with contextlib.redirect_stdout(buf):
    main(["compress", sys.argv[2], "-o", sys.argv[3], "--json"])
r = json.loads(buf.getvalue()[buf.getvalue().index("{"):])
print(json.dumps({"wall": time.perf_counter() - t, "encode": r["encode_seconds"], "escapes": r["escapes"],
                  "payload": r["payload_bytes"]}))
"""


def run(code, args, cache):
    env = dict(os.environ, XDG_CACHE_HOME=cache, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, check=True)
    return json.loads(p.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096,65536,131072,262144")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--compress", nargs="*", default=[])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    states = [s for s in a.sizes.split(",") if s] + ["torch"]
    res, comp = {}, {}
    with tempfile.TemporaryDirectory() as work:
        warm = {lad: os.path.join(work, f"warm-{lad}") for lad in LADDERS}
        out = os.path.join(work, "o.jg")
        for st in states:
            for lad in LADDERS:
                run(PROBE, [lad, st, out], warm[lad])   # fills that ladder's cache for this state
        for ck in a.compress:
            for lad in LADDERS:
                run(COMPRESS, [lad, ck, out], warm[lad])
        for rep in range(a.repeats):
            for st in states:
                for lad in LADDERS:
                    for kind, cache in (("cold", os.path.join(work, f"cold-{rep}-{st}-{lad}")), ("warm", warm[lad])):
                        r = run(PROBE, [lad, st, out], cache)
                        res.setdefault((st, lad, kind), []).append(r)
                        print(st, lad, kind, r, flush=True)
            for ck in a.compress:
                for lad in LADDERS:
                    os.sync()
                    r = run(COMPRESS, [lad, ck, out], warm[lad])
                    comp.setdefault((ck, lad), []).append(r)
                    print(ck, lad, r, flush=True)
    med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
    lines = ["# The smaller ladders against the full one", "",
             f"`python bench/experiments/small_group_ladder.py --sizes {a.sizes} --repeats {a.repeats}"
             + (" --compress CKPT" * len(a.compress)) + "` (this file's command; interleaved runs, medians; "
             f"{time.strftime('%Y-%m-%d')}). Ladders: full (every tier); no-cells (the closed form, then the "
             "28-cell adaptive partition: what a state of at most `certify.CELLS_TIERS_ABOVE` coordinates runs); "
             "small (no closed form either: a group of at most `certify.SPEED_TIERS_ABOVE`), forced on every "
             "group whatever its size.", "",
             "## The first save of a fresh process", "",
             "Seconds of the call (the process's CPU seconds over it). optax: a linspace state of N coordinates "
             "3 adamw steps in, `jaxguard.save(..., tx=tx)`; torch: 1,001,500 coordinates 3 AdamW steps in, "
             "`torch_compat.save`.", "",
             "| state | " + " | ".join(f"cold, {lad}" for lad in LADDERS) + " | "
             + " | ".join(f"warm, {lad}" for lad in LADDERS) + " | escapes (each ladder) |",
             "|---|" + "---:|" * (2 * len(LADDERS) + 1)]
    for st in states:
        cells = [f"{med(res[(st, lad, kind)], 'save'):.2f} s ({med(res[(st, lad, kind)], 'cpu'):.2f})"
                 for kind in ("cold", "warm") for lad in LADDERS]
        esc = " / ".join(str(res[(st, lad, "warm")][0]["escapes"]) for lad in LADDERS)
        name = "torch 1M AdamW" if st == "torch" else f"optax {int(st):,}"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {esc} |")
    if comp:
        lines += ["", "## A whole compress (warm program cache)", "",
                  "| checkpoint | " + " | ".join(f"encode s, {lad}" for lad in LADDERS) + " | "
                  + " | ".join(f"process s, {lad}" for lad in LADDERS) + " | escapes | payload bytes |",
                  "|---|" + "---:|" * (2 * len(LADDERS) + 2)]
        for ck in a.compress:
            rows = [comp[(ck, lad)] for lad in LADDERS]
            lines.append(f"| {os.path.basename(ck)} | " + " | ".join(f"{med(r, 'encode'):.2f}" for r in rows) + " | "
                         + " | ".join(f"{med(r, 'wall'):.2f}" for r in rows) + " | "
                         + " / ".join(f"{r[0]['escapes']:,}" for r in rows) + " | "
                         + " / ".join(f"{r[0]['payload']:,}" for r in rows) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if a.out:
        pathlib.Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
