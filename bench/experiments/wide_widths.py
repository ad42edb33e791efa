"""logrel-ans before / after the 9..12-bit per-block widths (issue 17, H17-wide).

    PYTHONPATH=/work/main nice python bench/experiments/wide_widths.py --label before   # main's jaxguard
    PYTHONPATH=$PWD      nice python bench/experiments/wide_widths.py --label after    # this tree's
    python bench/experiments/wide_widths.py --report      # bench/experiments/results/wide_widths.md from both JSONs

Checkpoints: the optax MLP of bench/reproduce.py run_optax (64-128-10 on sklearn digits,
optax.adam(1e-3), 300 steps, seeds 701-704, checkpoints at 10/50/100%: 12 checkpoints;
first-update audit with the real jitted optax.adam, jaxguard.optax_adapter.audit), and the
CNN and ByteTransformer checkpoints of bench/logrel_aw.py (seed 701, 20 steps, 10/50/100%;
audit with the real torch.optim.Adam, next-batch gradient + gradient grid; encode seconds
the median of 2 after a warm-up).  tau = 0.01, C = 0.2.

The jaxguard that runs is the one on PYTHONPATH: it is imported before bench/reproduce.py
(which puts this tree first on sys.path), and the JSON records its path.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jaxguard  # noqa: F401  (first: the PYTHONPATH copy, before reproduce.py edits sys.path)
import torch_compat  # noqa: F401
import torch_compat.models  # noqa: F401
import torch_compat.state  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(1, str(ROOT / "bench"))
OUT = ROOT / "bench" / "experiments" / "results"
CODEC = "logrel-ans"


def run(label, cache):
    import torch

    import logrel_aw
    import reproduce
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in reproduce.run_optax([701, 702, 703, 704], 300, [CODEC], 0, tmp):
            rows.append({"checkpoint": f"mlp-optax seed{r['seed']} @{r['fraction']:.0%}", "coordinates": r["coordinates"],
                         "escapes": r["escapes"], "payload_ratio": r["payload_ratio"],
                         "violations": r["audit_violations"], "max_gap_lr": r["first_update_max_gap_lr"],
                         "audit": "jitted optax.adam", "encode_seconds": r["encode_seconds"]})
            print(json.dumps(rows[-1]), flush=True)
        for kind in ("transformer", "cnn"):
            by_frac, _ = reproduce.checkpoints(kind, 701, 20, Path(cache))
            for f in reproduce.FRACTIONS:
                ck = by_frac[f]
                r = logrel_aw.torch_row(f"{kind} seed701 20 steps @{f:.0%}", ck, reproduce.real_gradient(kind, ck),
                                        CODEC, reproduce.TAU, tmp, timing=True)
                rows.append({k: r[k] for k in ("checkpoint", "coordinates", "escapes", "payload_ratio", "violations",
                                               "max_gap_lr", "audit", "encode_seconds")})
                print(json.dumps(rows[-1]), flush=True)
    from jaxguard.core import adaptive
    res = {"label": label, "jaxguard": os.path.dirname(jaxguard.__file__), "rows": rows,
           "width_pairs": adaptive.WIDTH_PAIRS, "wide_pairs": getattr(adaptive, "WIDE_PAIRS", ()),
           "machine": reproduce.machine_info(), "loadavg": os.getloadavg(), "seconds": time.perf_counter() - t0}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"wide_widths_{label}.json").write_text(json.dumps(res, indent=1))


def report():
    before, after = (json.loads((OUT / f"wide_widths_{x}.json").read_text()) for x in ("before", "after"))
    b = {r["checkpoint"]: r for r in before["rows"]}
    L = ["# logrel-ans with 9..12-bit block widths: before / after (bench/experiments/wide_widths.py)", "",
         f"before: {before['jaxguard']} (widths 4..8); after: {after['jaxguard']} (then {after['wide_pairs']} on "
         "the blocks that still escape).  tau = 0.01, C = 0.2.  Audit: the real jitted optax.adam update (MLP) or "
         "the real torch.optim.Adam (next-batch gradient + gradient grid).  Payload: moment payload / FP32 moments.  "
         f"Machine: {after['machine']['platform']}, {after['machine']['cpu_count']} CPUs shared with other jobs "
         f"(load average {before['loadavg'][0]:.1f} / {after['loadavg'][0]:.1f}): seconds are noisy; the MLP's "
         "encode seconds include the first call's compilation.", "",
         "| checkpoint | coords | payload % before | after | escapes before | after | over tau before | after "
         "| encode s before | after |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in after["rows"]:
        o = b[r["checkpoint"]]
        L.append(f"| {r['checkpoint']} | {r['coordinates']:,} | {100 * o['payload_ratio']:.2f} | "
                 f"{100 * r['payload_ratio']:.2f} | {o['escapes']} | {r['escapes']} | {o['violations']} | "
                 f"{r['violations']} | {o['encode_seconds']:.2f} | {r['encode_seconds']:.2f} |")
    mlp = [r for r in after["rows"] if r["checkpoint"].startswith("mlp")]
    mlp_b = [b[r["checkpoint"]] for r in mlp]
    L += ["", f"MLP (12 checkpoints): payload {100 * min(x['payload_ratio'] for x in mlp_b):.2f}-"
          f"{100 * max(x['payload_ratio'] for x in mlp_b):.2f}% -> {100 * min(x['payload_ratio'] for x in mlp):.2f}-"
          f"{100 * max(x['payload_ratio'] for x in mlp):.2f}%; escapes {sum(x['escapes'] for x in mlp_b)} -> "
          f"{sum(x['escapes'] for x in mlp)}; audit violations {sum(x['violations'] for x in mlp_b)} -> "
          f"{sum(x['violations'] for x in mlp)}.  Encode seconds, median of the MLP checkpoints after the first "
          f"(compilation): {statistics.median(x['encode_seconds'] for x in mlp_b[1:]):.2f} -> "
          f"{statistics.median(x['encode_seconds'] for x in mlp[1:]):.2f} (the wide pairs run on most MLP blocks); "
          "transformer and CNN: see the table (same checkpoints, no worse payload).", ""]
    (OUT / "wide_widths.md").write_text("\n".join(L))
    print("\n".join(L))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", choices=("before", "after"))
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--cache", default=str(ROOT / "bench" / ".cache"))
    a = ap.parse_args(argv)
    if a.report:
        report()
    else:
        run(a.label, a.cache)


if __name__ == "__main__":
    main()
