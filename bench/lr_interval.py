"""What an lr known as a range costs, and per-group rates of optax.multi_transform (issue 55).

Usage:
    PYTHONPATH=$PWD python bench/lr_interval.py                      # results/lr_interval.{json,md}
    PYTHONPATH=$PWD python bench/lr_interval.py --seeds 1 --out /tmp/li   # one seed a model (quick)

1. On the reproduction checkpoints (bench/reproduce.py: ByteTransformer and ResidualCNN,
   Adam at lr 1e-3, checkpoints at 10/50/100% of training, trained once into
   bench/.cache), `torch_compat.compress_checkpoint` certifies every moment for the exact
   next lr (1e-3, the param groups'), for the exact lr 1e-3/r, and for the interval
   ``lr=(1e-3/r, 1e-3)`` with r = 10, 100, 1000: coordinates, escapes and payload / FP32.
   Each interval file is audited with the real ``torch.optim.Adam`` at lo, sqrt(lo hi)
   and hi (`torch_compat.audit(..., lr=(lo, hi))`: 45 gradients each, every gap in its own
   lr), never through jaxguard's constants.
2. optax.multi_transform with two AdamW groups (the hidden layer at 1e-3, the output
   layer at 1e-6) on the digits MLP of bench/reproduce.py, trained 300 steps: saved with
   ``tx=`` (each coordinate certified at its own group's rate) against the two ways one
   lr could be given (1e-3 for all: the slow group is not covered; 1e-6 for all: escapes);
   per group the worst gap of the real jitted ``tx.update`` in that group's lr, escapes and
   container bytes.

No timings: only bytes, escapes and audit gaps (the machine does not change them).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

RATIOS = (10, 100, 1000)
HI = 1e-3
TAU, CLIP = 0.01, 0.2


def reproduction_rows(seeds, cache):
    import torch
    import torch_compat
    import reproduce
    torch.set_num_threads(1)
    rows = []
    for kind, steps in (("transformer", 400), ("cnn", 300)):
        for seed in reproduce.SEEDS[kind][:seeds]:
            ckpts, _ = reproduce.checkpoints(kind, seed, steps, cache)
            for frac, ckpt in sorted(ckpts.items()):
                cases = [("exact", HI, None)] + [(f"exact 1e-3/{r}", HI / r, None) for r in RATIOS] + \
                        [(f"interval x{r}", (HI / r, HI), r) for r in RATIOS]
                for label, lr, ratio in cases:
                    data, s = torch_compat.compress_checkpoint(ckpt, tau=TAU, clip=CLIP, lr=lr)
                    row = {"model": kind, "seed": seed, "fraction": frac, "step": int(ckpt["step"]), "case": label,
                           "lr": list(lr) if isinstance(lr, tuple) else lr, "coordinates": s["coordinates"],
                           "escapes": s["escapes"], "escape_rate": s["escape_rate"],
                           "payload_ratio": s["payload_ratio"], "container_bytes": s["container_bytes"]}
                    if ratio is not None:
                        path = ROOT / "bench" / ".cache" / "lr_interval.jg"
                        path.write_bytes(data)
                        restored, _ = torch_compat.restore_tree(str(path))
                        a = torch_compat.audit(ckpt, restored, tau=TAU, clip=CLIP, lr=lr)
                        row.update(audit_max_gap_lr=a["max_gap_lr"], audit_violations=a["violations"],
                                   audit_rates=[HI / ratio, math.sqrt(HI * HI / ratio), HI])
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def multi_transform_rows(steps=300, seed=0):
    import jax
    import jax.numpy as jnp
    import optax
    from sklearn.datasets import load_digits
    import jaxguard as jg
    from jaxguard.audit import AuditTally, gradient_grid
    from jaxguard.format import container
    from jaxguard.optax_state import flat_by_dotted
    rates = {"h": 1e-3, "out": 1e-6}
    d = load_digits()
    x = np.asarray(d.data, np.float32) / 16.0
    y = np.asarray(d.target, np.int32)
    tx = optax.multi_transform({"fast": optax.adamw(rates["h"]), "slow": optax.adamw(rates["out"])},
                               {"h": "fast", "out": "slow"})
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    params = {"h": {"kernel": jax.random.normal(k1, (64, 128)) * 0.125, "bias": jnp.zeros(128)},
              "out": {"kernel": jax.random.normal(k2, (128, 10)) * 0.09, "bias": jnp.zeros(10)}}
    st = tx.init(params)

    def loss(p, xb, yb):
        h = jax.nn.relu(xb @ p["h"]["kernel"] + p["h"]["bias"])
        return optax.softmax_cross_entropy_with_integer_labels(h @ p["out"]["kernel"] + p["out"]["bias"], yb).mean()

    @jax.jit
    def step(p, st, xb, yb):
        u, st = tx.update(jax.grad(loss)(p, xb, yb), st, p)
        return optax.apply_updates(p, u), st

    rng = np.random.default_rng(seed)
    for _ in range(steps):
        i = rng.integers(0, len(x), 64)
        params, st = step(params, st, jnp.asarray(x[i]), jnp.asarray(y[i]))

    @jax.jit
    def first(state, g):
        return optax.apply_updates(params, tx.update(g, state, params)[0])

    def audit(restored):
        tallies = {grp: AuditTally(TAU) for grp in rates}
        leaves, tdef = jax.tree_util.tree_flatten(params)
        keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
        grads = [jax.tree.map(lambda p, g=g: jnp.full(p.shape, g, jnp.float32), params) for g in gradient_grid(CLIP)]
        grads.append(jax.tree_util.tree_unflatten(tdef, [jax.random.uniform(k, p.shape, jnp.float32, -CLIP, CLIP)
                                                         for k, p in zip(keys, leaves)]))
        for g in grads:
            a, b = flat_by_dotted(first(st, g)), flat_by_dotted(first(restored, g))
            for name in a:
                grp = name.split(".")[0]
                tallies[grp].add(name, a[name], b[name], float(np.float32(rates[grp])))
        return {grp: t.summary(len(grads)).to_json() for grp, t in tallies.items()}

    path = str(ROOT / "bench" / ".cache" / "multi.jg")
    rows = []
    for label, kw in (("tx= (each group at its own rate)", {"tx": tx}),
                      ("lr= pytree prefix {h: 1e-3, out: 1e-6}", {"lr": rates, "weight_decay": 1e-4}),
                      ("lr=1e-3 for all", {"lr": 1e-3, "weight_decay": 1e-4}),
                      ("lr=1e-6 for all", {"lr": 1e-6, "weight_decay": 1e-4})):
        s = jg.save(path, st, params, tau=TAU, clip=CLIP, **kw)
        header = container.read(path, verify_decoded=False)[0]
        per = {}
        for e in header["entries"]:
            if e["kind"] == "moments":
                grp = e["config"]["param"].split(".")[0]
                p = per.setdefault(grp, {"coordinates": 0, "escapes": 0, "payload_bytes": 0})
                for k in p:
                    p[k] += e["stats"][k]
        res = audit(jg.load(path, tx.init(params)))
        row = {"case": label, "coordinates": s["coordinates"], "escapes": s["escapes"],
               "payload_ratio": s["payload_ratio"], "container_bytes": s["container_bytes"],
               "raw_state_bytes": s["raw_state_bytes"],
               "groups": {grp: {**per[grp], "lr": rates[grp], "worst_gap_lr": res[grp]["max_gap_lr"],
                                "worst_gap_over_tau": res[grp]["max_gap_lr"] / TAU,
                                "violations": res[grp]["violations"]} for grp in rates}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def summarize(rows):
    """Per model and case: the sums over checkpoints."""
    out = {}
    for r in rows:
        s = out.setdefault((r["model"], r["case"]), {"checkpoints": 0, "coordinates": 0, "escapes": 0, "payload": 0.0,
                                                      "violations": 0, "worst_gap_lr": 0.0, "audited": False})
        s["checkpoints"] += 1
        s["coordinates"] += r["coordinates"]
        s["escapes"] += r["escapes"]
        s["payload"] += r["payload_ratio"] * 8 * r["coordinates"]
        if "audit_violations" in r:
            s["audited"] = True
            s["violations"] += r["audit_violations"]
            s["worst_gap_lr"] = max(s["worst_gap_lr"], r["audit_max_gap_lr"])
    return out


def write(out: Path, rep, summary):
    """``out``.json (`rep`) and ``out``.md (tables of `summary` and the multi_transform rows)."""
    out.with_suffix(".json").write_text(json.dumps(rep, indent=1))
    L = ["# An lr known as a range (bench/lr_interval.py)", "",
         f"Commit {rep['commit']}; {rep['machine']}; torch {rep['versions']['torch']}, jax {rep['versions']['jax']}, "
         f"optax {rep['versions']['optax']}. tau {TAU}, C {CLIP}, codec log8-rel (the default). Command: "
         f"`{rep['command']}`.", "",
         "## Payload and escapes of `lr=(1e-3/r, 1e-3)` against an exact lr, reproduction checkpoints", "",
         f"{rep['checkpoints']} checkpoints (ByteTransformer and ResidualCNN, {rep['seeds']} seeds a model, 10/50/100% of "
         "training; Adam at lr 1e-3, whose param groups hold 1e-3 as the next rate). Intervals audited with the "
         "real `torch.optim.Adam` at lo, sqrt(lo hi) and hi (45 gradients each, gaps in each step's own lr).", "",
         "| model | certified for | coordinates | escapes | escape % | payload / FP32 % | real audit: worst gap (lr) "
         "| over tau |", "|---|---|---|---|---|---|---|---|"]
    for (model, case), s in summary.items():
        aud = (f"{s['worst_gap_lr']:.5f} | {s['violations']}" if s["audited"] else "- | -")
        L.append(f"| {model} | {case} | {s['coordinates']:,} | {s['escapes']:,} | "
                 f"{100 * s['escapes'] / s['coordinates']:.3f} | {100 * s['payload'] / (8 * s['coordinates']):.2f} | "
                 f"{aud} |")
    L += ["", "## optax.multi_transform: two AdamW groups at 1e-3 (`h`) and 1e-6 (`out`), digits MLP", "",
          "Worst gap of the real jitted `tx.update` after restoring, in each group's own lr (tau = 0.01), 44 grid "
          "gradients and one random draw.", "",
          "| certified with | group | lr | coordinates | escapes | payload / FP32 % | worst gap / tau | over tau | "
          "container bytes (raw state) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rep["multi_transform"]:
        for grp, g in r["groups"].items():
            L.append(f"| {r['case']} | {grp} | {g['lr']:g} | {g['coordinates']:,} | {g['escapes']:,} | "
                     f"{100 * g['payload_bytes'] / (8 * g['coordinates']):.2f} | {g['worst_gap_over_tau']:.3f} | "
                     f"{g['violations']} | {r['container_bytes']:,} ({r['raw_state_bytes']:,}) |")
    out.with_suffix(".md").write_text("\n".join(L) + "\n")
    print("\n".join(L))


def render(json_path):
    """Write the Markdown again from a run's JSON (no recomputation)."""
    rep = json.loads(Path(json_path).read_text())
    write(Path(json_path).with_suffix(""), rep, summarize(rep["rows"]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=4, help="seeds a model (of bench/reproduce.py's four)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "lr_interval"))
    ap.add_argument("--cache", default=str(ROOT / "bench" / ".cache"))
    args = ap.parse_args()
    import jax
    import optax
    import torch
    rows = reproduction_rows(args.seeds, Path(args.cache))
    multi = multi_transform_rows()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    rep = {"commit": commit, "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared 2-core box)",
           "versions": {"torch": torch.__version__, "jax": jax.__version__, "optax": optax.__version__},
           "command": "python bench/lr_interval.py" + (f" --seeds {args.seeds}" if args.seeds != 4 else ""),
           "seeds": args.seeds, "checkpoints": len({(r["model"], r["seed"], r["fraction"]) for r in rows}),
           "rows": rows, "summary": {f"{m}|{c}": s for (m, c), s in summarize(rows).items()},
           "multi_transform": multi}
    write(Path(args.out), rep, summarize(rows))


if __name__ == "__main__":
    main()
