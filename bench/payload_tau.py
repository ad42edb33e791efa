"""Payload and escapes against tau on the reproduction checkpoints, each restore audited.

    python bench/payload_tau.py [--codecs log8-rel,log8-rel-zstd,logrel-ans]
                                [--taus 0.001,0.003,0.01,0.03,0.1] [--seeds 4] [--fractions 0.1,0.5,1.0]
                                [--no-optax]
                                [--cache bench/.cache] [--out bench/results/payload_tau]

The checkpoints of bench/reproduce.py (trained once, cached under --cache): ByteTransformer
(400 steps) and ResidualCNN (300 steps), the first --seeds seeds of each, at --fractions of
training (10/50/100%); and its optax MLP (300 steps, the same seeds as the CNN).  Per checkpoint, tau
and codec: compress at that tau (C = 0.2) through ``torch_compat.compress_checkpoint`` or
``jaxguard.save``, restore through the numpy reader / ``jaxguard.load``, and audit the first
update at that tau with the real ``torch.optim.Adam`` (next-batch gradient + gradient grid)
or the real jitted ``optax.adam`` (bench/logrel_aw.py's ``torch_row``, bench/reproduce.py's
``run_optax``).  Writes <out>.json (every row), <out>.md (per model, tau and codec: payload
% of FP32 and escape % over the checkpoints, worst gap, coordinates over tau) and <out>.png.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402

import logrel_aw  # noqa: E402
import reproduce  # noqa: E402

CODECS = ("log8-rel", "log8-rel-zstd", "logrel-ans")
MODELS = ("transformer", "cnn", "mlp-optax")
STEPS = {"transformer": 400, "cnn": 300, "mlp-optax": 300}


def torch_rows(kind, seeds, fractions, taus, codecs, cache, tmp, log):
    rows = []
    for seed in seeds:
        by_frac, _ = reproduce.checkpoints(kind, seed, STEPS[kind], cache)
        for fraction in fractions:
            ck = by_frac[fraction]
            grads = reproduce.real_gradient(kind, ck)
            for tau in taus:
                for codec in codecs:
                    r = logrel_aw.torch_row(f"{kind} seed{seed} @{fraction:.0%}", ck, grads, codec, tau, tmp)
                    rows.append({"model": kind, "seed": seed, "fraction": fraction, "step": int(ck["step"]),
                                 **{k: r[k] for k in ("codec", "tau", "coordinates", "escapes", "payload_ratio",
                                                      "max_gap_lr", "violations", "audit")}})
                    log(rows[-1])
    return rows


def optax_rows(seeds, fractions, taus, codecs, tmp, log):
    rows = []
    for tau in taus:
        for r in reproduce.run_optax(seeds, STEPS["mlp-optax"], list(codecs), 0, tmp, tau=tau):
            if r["fraction"] not in fractions:
                continue
            rows.append({"model": "mlp-optax", "seed": r["seed"], "fraction": r["fraction"], "step": r["step"],
                         "codec": r["codec"], "tau": tau, "coordinates": r["coordinates"], "escapes": r["escapes"],
                         "payload_ratio": r["payload_ratio"], "max_gap_lr": r["first_update_max_gap_lr"],
                         "violations": r["audit_violations"], "audit": "jitted optax.adam"})
            log(rows[-1])
    return rows


def summarize(rows):
    """{(model, tau, codec): payload % and escape % (mean, min, max), worst gap, over tau}."""
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["tau"], r["codec"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        pay = [100 * r["payload_ratio"] for r in rs]
        esc = [100 * r["escapes"] / r["coordinates"] for r in rs]
        out[key] = {"checkpoints": len(rs), "payload_pct": (float(np.mean(pay)), min(pay), max(pay)),
                    "escape_pct": (float(np.mean(esc)), min(esc), max(esc)),
                    "worst_gap_over_tau": max(r["max_gap_lr"] / r["tau"] for r in rs),
                    "over_tau": sum(r["violations"] for r in rs)}
    return out


def write_md(path, res):
    summ = {tuple(json.loads(k)): v for k, v in res["summary"].items()}
    codecs, taus = res["codecs"], res["taus"]
    coords = {r["model"]: r["coordinates"] for r in res["rows"]}
    L = [f"# Payload against tau on the reproduction checkpoints ({', '.join(codecs)})", "",
         f"`{res['command']}`. Machine: {res['machine']}. Commit {res['commit']}, torch {res['versions']['torch']}, "
         f"jax {res['versions']['jax']}, optax {res['versions']['optax']}. Run took {res['seconds']:.0f} s.", "",
         "Checkpoints: bench/reproduce.py's (ByteTransformer 400 steps, ResidualCNN with BatchNorm 300 steps, "
         "optax MLP 300 steps), seeds "
         + "; ".join(f"{m} {', '.join(map(str, s))} ({coords[m]:,} Adam coordinates)" for m, s in res["seeds"].items())
         + f", at {'/'.join(f'{100 * f:g}' for f in res['fractions'])}% of training. Each compressed at the row's tau (C = 0.2) and its first update audited "
         "at that tau with the real framework (torch.optim.Adam: next-batch gradient + gradient grid; jitted "
         "optax.adam: gradient grid + one random draw).", "",
         "Cells: payload % of FP32, mean over the checkpoints (min-max); escapes % of coordinates, mean (max).", ""]
    for m in res["models"]:
        n = next(v["checkpoints"] for k, v in summ.items() if k[0] == m)
        L += [f"## {m} ({n} checkpoint{'s' if n > 1 else ''})", "",
              "| tau (x lr) | " + " | ".join(f"{c} payload % | escapes %" for c in codecs)
              + " | worst gap / tau | over tau |", "|---:|" + "---:|---:|" * len(codecs) + "---:|---:|"]
        for tau in taus:
            cells, gap, over = [], 0.0, 0
            for c in codecs:
                s = summ[(m, tau, c)]
                p, e = s["payload_pct"], s["escape_pct"]
                cells.append(f"{p[0]:.2f} ({p[1]:.2f}-{p[2]:.2f}) | {e[0]:.3f} ({e[2]:.3f})")
                gap, over = max(gap, s["worst_gap_over_tau"]), over + s["over_tau"]
            L.append(f"| {tau:g} | " + " | ".join(cells) + f" | {gap:.4f} | {over} |")
        L.append("")
    total = sum(v["over_tau"] for v in summ.values())
    L += [f"Coordinates over tau in every audit: {total} ({len(res['rows'])} restores).", ""]
    Path(path).write_text("\n".join(L))


def plot(path, res):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summ = {tuple(json.loads(k)): v for k, v in res["summary"].items()}
    models, codecs, taus = res["models"], res["codecs"], res["taus"]
    fig, axes = plt.subplots(2, len(models), figsize=(4.6 * len(models), 7), squeeze=False, sharex=True)
    for j, m in enumerate(models):
        for c in codecs:
            for i, (metric, scale) in enumerate((("payload_pct", "linear"), ("escape_pct", "symlog"))):
                ys = [summ[(m, t, c)][metric] for t in taus]
                ax = axes[i][j]
                ax.plot(taus, [y[0] for y in ys], marker="o", label=c)
                ax.fill_between(taus, [y[1] for y in ys], [y[2] for y in ys], alpha=0.2)
                ax.set_xscale("log")
                if scale == "symlog":
                    ax.set_yscale("symlog", linthresh=0.01)
                ax.grid(alpha=0.3)
        axes[0][j].set_title(f"{m} (real-framework audit: 0 over tau)" if not any(
            summ[(m, t, c)]["over_tau"] for t in taus for c in codecs) else m, fontsize=9)
        axes[0][j].set_ylabel("moment payload / FP32 (%)")
        axes[1][j].set_ylabel("escapes (% of coordinates)")
        axes[1][j].set_xlabel("tau (fraction of lr)")
    axes[0][0].legend(fontsize=8)
    fig.suptitle("payload and escapes against tau, bench/reproduce.py checkpoints (mean, min-max band)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--taus", default=",".join(map(str, logrel_aw.TAUS)))
    ap.add_argument("--seeds", type=int, default=4, help="the first N seeds of each model (1-4)")
    ap.add_argument("--fractions", default=",".join(map(str, reproduce.FRACTIONS)),
                    help="which of the checkpoints at 10/50/100%% of training")
    ap.add_argument("--no-optax", action="store_true", help="the torch checkpoints only")
    ap.add_argument("--cache", default=str(ROOT / "bench" / ".cache"))
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "payload_tau"))
    ap.add_argument("--machine", default="2-core AMD EPYC, shared with other work")
    a = ap.parse_args(argv)
    codecs = a.codecs.split(",")
    taus = sorted(float(t) for t in a.taus.split(","))
    fractions = sorted(float(f) for f in a.fractions.split(","))
    if not set(fractions) <= set(reproduce.FRACTIONS):
        ap.error(f"--fractions {a.fractions}: choose among {','.join(map(str, reproduce.FRACTIONS))}")
    import jax
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~/.cache"), "jaxguard", "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    import torch
    torch.set_num_threads(1)
    import lm_runs
    models = [m for m in MODELS if not (a.no_optax and m == "mlp-optax")]
    seeds = {m: reproduce.SEEDS["cnn" if m == "mlp-optax" else m][:a.seeds] for m in models}
    t0 = time.perf_counter()
    rows = []
    log = lambda r: print(json.dumps(r), flush=True)  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        for m in models:
            rows += (optax_rows(seeds[m], fractions, taus, codecs, tmp, log) if m == "mlp-optax"
                     else torch_rows(m, seeds[m], fractions, taus, codecs, Path(a.cache), tmp, log))
    command = "python bench/payload_tau.py" + "".join(
        f" {flag}" for flag, default in ((f"--codecs {a.codecs}", a.codecs == ",".join(CODECS)),
                                         (f"--taus {a.taus}", a.taus == ",".join(map(str, logrel_aw.TAUS))),
                                         (f"--seeds {a.seeds}", a.seeds == 4),
                                         (f"--fractions {a.fractions}", fractions == list(reproduce.FRACTIONS)),
                                         ("--no-optax", not a.no_optax))
        if not default)
    res = {**lm_runs.run_context(a.machine), "command": command, "codecs": codecs, "taus": taus, "models": models,
           "fractions": fractions,
           "seeds": seeds, "seconds": time.perf_counter() - t0,
           "summary": {json.dumps(list(k)): v for k, v in summarize(rows).items()}, "rows": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps(res, indent=1))
    write_md(a.out + ".md", res)
    plot(a.out + ".png", res)
    over = sum(r["violations"] for r in rows)
    print(f"{len(rows)} restores, {over} coordinates over tau, {res['seconds']:.0f} s -> {a.out}.md")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
