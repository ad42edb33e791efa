"""Escape rate and payload on ordinary trained state, for before/after comparisons of
changes to the bound (issue 10: the float32-edge checks must cost nothing here).

Usage:
    PYTHONPATH=$PWD python bench/experiments/edge_cost.py --out bench/experiments/results/edge_cost_after.json [--cache /tmp/c]
    python bench/experiments/edge_cost.py --compare BEFORE.json AFTER.json --md bench/experiments/results/edge_cost.md

Checkpoints (deterministic, cached with --cache): the demo's ByteTransformer after 150
torch Adam steps (`jaxguard demo --full`), the same model with AdamW (wd 0.01) after 60 steps,
the CNN after 100 steps (`bench/reproduce.py --tiny`), and an optax.adam / adamw MLP state
after 40 steps.  Every row of `jaxguard demo --full` is compressed (no audit: that is the
demo's job); the figures are escapes and payload ratio.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import numpy as np
import torch

ROWS = (("log8", "separate", "mixed"), ("log8", "shared", "linear"), ("log8", "shared", "mixed"),
        ("log8-rel", "shared", "mixed"), ("bf16", "shared", "mixed"), ("block8", "shared", "mixed"))


def _torch_ckpts(cache):
    from torch_compat import models
    out = {}
    for name, kind, steps, adamw in (("transformer-adam-150", "transformer", 150, False),
                                     ("transformer-adamw-60", "transformer", 60, True),
                                     ("cnn-adam-100", "cnn", 100, False)):
        path = os.path.join(cache, name + ".pt") if cache else None
        if path and os.path.exists(path):
            out[name] = torch.load(path, weights_only=False)
            continue
        ckpts, _, _ = models.train(kind, seed=0, steps=steps, fractions=(1.0,), weight_decay=0.01 if adamw else 0.0,
                                  adamw=adamw)
        out[name] = ckpts[1.0]
        if path:
            torch.save(out[name], path)
    return out


def _optax_states():
    import jax
    import jax.numpy as jnp
    import optax
    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    params = {"w1": jax.random.normal(k1, (64, 256)) * 0.1, "b1": jnp.zeros(256),
              "w2": jax.random.normal(k2, (256, 10)) * 0.1}
    x = jax.random.normal(k3, (512, 64))
    y = jnp.argmax(x[:, :10], axis=1)

    def loss(p, xb, yb):
        h = jnp.tanh(xb @ p["w1"] + p["b1"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"], yb).mean()

    out = {}
    for name, tx, wd in (("optax-adam-mlp-40", optax.adam(1e-3), None),
                         ("optax-adamw-mlp-40", optax.adamw(1e-3, weight_decay=1e-2), 1e-2)):
        p, st = params, tx.init(params)
        for i in range(40):
            sl = slice((i * 64) % 512, (i * 64) % 512 + 64)
            g = jax.grad(loss)(p, x[sl], y[sl])
            u, st = tx.update(g, st, p)
            p = optax.apply_updates(p, u)
        out[name] = (st, p, wd)
    return out


def compare(before_path, after_path, md_path):
    """Markdown table of two runs, row by row, with the differences in points."""
    before, after = (json.load(open(p)) for p in (before_path, after_path))
    key = lambda r: (r["checkpoint"], r["codec"], r["bound"], r["partition"])  # noqa: E731
    b = {key(r): r for r in before["rows"]}
    lines = [f"# Escapes and payload on ordinary trained state, before and after issue 10", "",
             f"Before: commit {before['commit'][:7]}; after: commit {after['commit'][:7]}"
             f"{' + working tree' if after.get('jaxguard_dirty') else ''}; {after['machine']}.", "",
             "| checkpoint | codec | bound | partition | coordinates | escapes before | after | escape rate before % "
             "| after % | diff (points) | payload before % | after % | diff (points) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    worst = 0.0
    for r in after["rows"]:
        o = b.get(key(r))
        if o is None:
            continue
        de = r["escape_rate_pct"] - o["escape_rate_pct"]
        dp = r["payload_ratio_pct"] - o["payload_ratio_pct"]
        worst = max(worst, abs(de), abs(dp))
        lines.append(f"| {r['checkpoint']} | {r['codec']} | {r['bound']} | {r['partition']} | {r['coordinates']:,} | "
                     f"{o['escapes']:,} | {r['escapes']:,} | {o['escape_rate_pct']:.4f} | {r['escape_rate_pct']:.4f} | "
                     f"{de:+.4f} | {o['payload_ratio_pct']:.4f} | {r['payload_ratio_pct']:.4f} | {dp:+.4f} |")
    lines += ["", f"Largest change: {worst:.4f} points (acceptance: within 0.05)."]
    with open(md_path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--cache", default=None)
    ap.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    ap.add_argument("--md")
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare, args.md)
    if args.cache:
        os.makedirs(args.cache, exist_ok=True)
    import jaxguard
    import torch_compat
    from jaxguard import GuardSpec
    from jaxguard import optax_adapter
    rows = []
    for name, ckpt in _torch_ckpts(args.cache).items():
        for codec, bound, partition in ROWS:
            t0 = time.perf_counter()
            _, s = torch_compat.compress_checkpoint(ckpt, spec=GuardSpec(codec=codec, bound=bound, partition=partition))
            rows.append({"checkpoint": name, "codec": codec, "bound": bound, "partition": partition,
                         "coordinates": s["coordinates"], "escapes": s["escapes"],
                         "escape_rate_pct": 100 * s["escape_rate"], "payload_ratio_pct": 100 * s["payload_ratio"],
                         "seconds": round(time.perf_counter() - t0, 2)})
            print(json.dumps(rows[-1]), flush=True)
    for name, (st, p, wd) in _optax_states().items():
        for codec in ("log8-rel", "log8"):
            t0 = time.perf_counter()
            _, s = optax_adapter.to_bytes(st, p, lr=1e-3, codec=codec, weight_decay=wd)
            rows.append({"checkpoint": name, "codec": codec, "bound": "shared", "partition": "mixed",
                         "coordinates": s["coordinates"], "escapes": s["escapes"],
                         "escape_rate_pct": 100 * s["escape_rate"], "payload_ratio_pct": 100 * s["payload_ratio"],
                         "seconds": round(time.perf_counter() - t0, 2)})
            print(json.dumps(rows[-1]), flush=True)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "jaxguard"], capture_output=True, text=True).stdout)
    rep = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared with 4 other "
                      "engineers: contended; timings indicative only)",
           "commit": commit, "jaxguard_dirty": dirty, "jaxguard_file": jaxguard.__file__,
           "torch": torch.__version__, "python": sys.version.split()[0], "rows": rows}
    with open(args.out, "w") as f:
        json.dump(rep, f, indent=1)


if __name__ == "__main__":
    main()
