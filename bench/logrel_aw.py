"""logrel-aw against log8 and log8-rel: payload, escapes, real-framework audit, tau sweep, speed.

    nice python bench/logrel_aw.py [--steps 20] [--out bench/results] [--cache bench/.cache]
    nice python bench/logrel_aw.py --codecs log8-rel,logrel-aw,logrel-ans \
        --sweep-codecs log8-rel,logrel-ans --name logrel_ans        # issue 17, the rANS codec

Checkpoints: the `bench/reproduce.py --tiny` conditions for both models (seed 701, 20
steps, checkpoints at 10/50/100%: the cached trained checkpoints of reproduce.py), the
demo checkpoint (`jaxguard demo --full`: ByteTransformer, seed 0, 150 steps) and the optax MLP of
reproduce.py (seed 701, 20 steps).  Per checkpoint and codec: compress through
``torch_compat.compress_checkpoint`` (tau = 0.01, C = 0.2), restore through the numpy
reader, audit with the real ``torch.optim.Adam`` (next-batch gradient + gradient grid) or
the real jitted optax update.  Then payload vs tau (0.001 .. 0.1) on the demo checkpoint
for log8-rel and logrel-aw (audited too), and encode / restore seconds (encode: median of
2 after one untimed warm-up; restore: median of 5).

Writes <out>/NAME.json, NAME.md and NAME_tau.png (NAME: --name, default logrel_aw).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

CODECS = ("log8", "log8-rel", "logrel-aw")
TAUS = (0.001, 0.003, 0.01, 0.03, 0.1)
TAU, CLIP = 0.01, 0.2


def _median_s(fn, reps):
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), out


def torch_row(label, ckpt, grads, codec, tau, tmpdir, timing=False):
    import torch_compat
    from jaxguard.format.container import atomic_write
    from jaxguard.audit import gradient_grid
    if timing:
        torch_compat.compress_checkpoint(ckpt, tau=tau, clip=CLIP, codec=codec)   # warm-up (jit)
    enc_s, (data, s) = _median_s(lambda: torch_compat.compress_checkpoint(ckpt, tau=tau, clip=CLIP, codec=codec),
                                 2 if timing else 1)
    path = os.path.join(tmpdir, f"{codec}.jg")
    atomic_write(path, data)
    res_s, (restored, _) = _median_s(lambda: torch_compat.restore_tree(path), 5 if timing else 1)
    a = torch_compat.audit(ckpt, restored, tau=tau, clip=CLIP, grads=grads, grid=gradient_grid(CLIP))
    return {"checkpoint": label, "codec": codec, "tau": tau, "coordinates": s["coordinates"],
            "escapes": s["escapes"], "payload_ratio": s["payload_ratio"], "container_bytes": s["container_bytes"],
            "max_gap_lr": a["max_gap_lr"], "violations": a["violations"], "audit": "torch.optim.Adam",
            "encode_seconds": enc_s, "restore_seconds": res_s}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--cache", default=str(ROOT / "bench" / ".cache"))
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--codecs", default=",".join(CODECS), help="comma list of codecs compared")
    ap.add_argument("--sweep-codecs", default="log8-rel,logrel-aw", help="codecs of the tau sweep")
    ap.add_argument("--name", default="logrel_aw", help="output file stem")
    a = ap.parse_args(argv)
    codecs, sweep_codecs = tuple(a.codecs.split(",")), tuple(a.sweep_codecs.split(","))
    import jax
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~/.cache"), "jaxguard", "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    torch.set_num_threads(1)
    import reproduce
    from torch_compat import models
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_run = time.perf_counter()
    load0 = os.getloadavg()
    ckpts = []
    for kind in ("cnn", "transformer"):
        by_frac, _ = reproduce.checkpoints(kind, 701, a.steps, Path(a.cache))
        for f in reproduce.FRACTIONS:
            ckpts.append((f"{kind} seed701 {a.steps} steps @{f:.0%}", kind, by_frac[f]))
    demo, _, sample = models.train("transformer", seed=0, steps=150, fractions=(1.0,))
    ckpts.append(("demo transformer seed0 150 steps", "transformer", demo[1.0]))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, kind, ck in ckpts:
            grads = reproduce.real_gradient(kind, ck)
            for codec in codecs:
                r = torch_row(label, ck, grads, codec, TAU, tmp, timing=label.startswith("demo"))
                rows.append(r)
                print(json.dumps(r), flush=True)
        orows = reproduce.run_optax([701], a.steps, list(codecs), 0, tmp)
        for r in orows:
            rows.append({"checkpoint": f"mlp-optax seed701 {a.steps} steps @{r['fraction']:.0%}", "codec": r["codec"],
                         "tau": TAU, "coordinates": r["coordinates"], "escapes": r["escapes"],
                         "payload_ratio": r["payload_ratio"], "max_gap_lr": r["first_update_max_gap_lr"],
                         "violations": r["audit_violations"], "audit": "jitted optax.adam",
                         "encode_seconds": r["encode_seconds"], "restore_seconds": None})
            print(json.dumps(rows[-1]), flush=True)
        sweep = []
        if not a.no_sweep:
            label, kind, ck = ckpts[-1]
            grads = reproduce.real_gradient(kind, ck)
            for tau in TAUS:
                for codec in sweep_codecs:
                    r = torch_row(label, ck, grads, codec, tau, tmp)
                    sweep.append(r)
                    print(json.dumps(r), flush=True)
    result = {"codecs": codecs, "sweep_codecs": sweep_codecs, "name": a.name,
              "rows": rows, "sweep": sweep, "machine": reproduce.machine_info(), "loadavg_start": load0,
              "loadavg_end": os.getloadavg(), "seconds": time.perf_counter() - t_run,
              "width_pairs": __import__("jaxguard.core.adaptive", fromlist=["x"]).WIDTH_PAIRS}
    (out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
    write_md(out / f"{a.name}.md", result)
    if sweep:
        plot(out / f"{a.name}_tau.png", sweep, sweep_codecs)


def write_md(path, res):
    rows = res["rows"]
    codecs, sweep_codecs = tuple(res.get("codecs", CODECS)), tuple(res.get("sweep_codecs", ("log8-rel", "logrel-aw")))
    L = [f"# {codecs[-1]} vs {' / '.join(codecs[:-1])} (bench/logrel_aw.py --name {res.get('name', 'logrel_aw')})", "",
         f"Machine: {res['machine']['platform']}, {res['machine']['cpu_count']} CPUs, shared with other jobs "
         f"(load average {res['loadavg_start'][0]:.1f} at start, {res['loadavg_end'][0]:.1f} at end): seconds are "
         "inflated and noisy.  tau = 0.01, C = 0.2.  Audit: real torch.optim.Adam (next-batch gradient + "
         "gradient grid) or the real jitted optax.adam update.", "",
         "| checkpoint | coords | " + " | ".join(f"{c} payload % / escapes / over tau" for c in codecs) + " |",
         "|---|---|" + "---|" * len(codecs)]
    for ck in dict.fromkeys(r["checkpoint"] for r in rows):
        rs = {r["codec"]: r for r in rows if r["checkpoint"] == ck}
        cells = [f"{100 * rs[c]['payload_ratio']:.2f} / {rs[c]['escapes']} / {rs[c]['violations']}" for c in codecs]
        L.append(f"| {ck} | {rs[codecs[0]]['coordinates']:,} | " + " | ".join(cells) + " |")
    t = [r for r in rows if r["checkpoint"].startswith("demo")]
    if t:
        L += ["", "## Speed (demo checkpoint; encode: median of 2 after a warm-up, restore: median of 5)", "",
              "| codec | encode s | restore s |", "|---|---|---|"]
        L += [f"| {r['codec']} | {r['encode_seconds']:.2f} | {r['restore_seconds']:.3f} |" for r in t]
    if res["sweep"]:
        L += ["", "## Payload vs tau (demo checkpoint)", "", "| tau | " + " | ".join(
              f"{c} % (escapes, over tau)" for c in sweep_codecs) + " |", "|---|" + "---|" * len(sweep_codecs)]
        for tau in TAUS:
            rs = {r["codec"]: r for r in res["sweep"] if r["tau"] == tau}
            L.append(f"| {tau} | " + " | ".join(f"{100 * rs[c]['payload_ratio']:.2f} ({rs[c]['escapes']}, "
                                               f"{rs[c]['violations']})" for c in sweep_codecs) + " |")
    L += ["", f"Width pairs tried per block: {res['width_pairs']}.  Run took {res['seconds']:.0f} s.", ""]
    path.write_text("\n".join(L))


def plot(path, sweep, codecs=("log8-rel", "logrel-aw")):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for codec in codecs:
        rs = sorted((r["tau"], 100 * r["payload_ratio"]) for r in sweep if r["codec"] == codec)
        ax.plot([t for t, _ in rs], [p for _, p in rs], marker="o", label=codec)
    ax.axhline(23, color="gray", ls="--", lw=0.8, label="target 23%")
    ax.set_xscale("log")
    ax.set_xlabel("tau (fraction of lr)")
    ax.set_ylabel("moment payload / FP32 (%)")
    ax.set_title("demo ByteTransformer, real torch audit: 0 over tau")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
