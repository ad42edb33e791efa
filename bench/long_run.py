"""Does the payload hold over a long run?  Two language models trained 2,000 steps as a user
trains them (bench/lm_runs.py: torch AdamW and optax adamw, warmup + cosine), their state
compressed at every 100th step with each codec; where the escapes are and why.

    python bench/long_run.py [--codecs log8-rel,log8-rel-zstd] [--cache bench/.cache/long_run]
                             [--out bench/results/long_run]

The FP32 checkpoints come from `lm_runs.fp32_checkpoints` (trained once, cached, resumable);
each (framework, step, codec) result is appended to ``<cache>/long_run.jsonl`` and reused.
Per save: payload % of FP32, escapes, the tensors that hold them, and for each tensor's
escapes what sets them apart: the span (binades) of v in their blocks against the tensor's
typical block, their v against the tensor's median v (tiny v: rare tokens), |m|/sqrt(v),
and how many sit where the final ``p + step`` rounding alone (half an ulp of p) exceeds
half of ``tau * lr``.  Writes JSON, Markdown and a PNG next to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import lm_runs  # noqa: E402

TAU = 0.01


def _records(kind, path, codec):
    """(records, lr) of the checkpoint at `path` for `codec`, as the user's save makes them."""
    from jaxguard.core.config import GuardSpec
    spec = GuardSpec(codec=codec)
    if kind == "torch":
        import torch
        from torch_compat import state as S
        ck = torch.load(path, weights_only=False)
        _, records = S.state_records(ck["optimizer"], ck["model"], spec=spec)
        return records, ck["optimizer"]["param_groups"][0]["lr"]
    from jaxguard import optax_adapter as oa
    from jaxguard.core.config import UpdateRequest
    run = lm_runs.OptaxRun(0)
    run.load_fp32(path)
    records, _ = oa.state_records(run.state, run.params, spec=spec,
                                  update=UpdateRequest(lr=run.schedule, weight_decay=lm_runs.WEIGHT_DECAY))
    return records, float(run.schedule(run.step))


def _block_span(v):
    """log2(max / min) of the positive v of each 256-block (nan: no positive v)."""
    n = v.size
    nb = -(-n // 256)
    vb = np.zeros(nb * 256, np.float32)
    vb[:n] = v
    vb = vb.reshape(nb, 256)
    with np.errstate(all="ignore"):
        pos = np.where(vb > 0, vb, np.nan)
        return np.log2(np.nanmax(pos, 1)) - np.log2(np.nanmin(pos, 1))


def measure(kind, path, codec):
    """One save of one checkpoint: payload, escapes, and where they are (see the module docstring)."""
    from jaxguard import writer
    records, lr = _records(kind, path, codec)
    jobs = {r.name: r for r in records if isinstance(r, writer.MomentJob)}
    totals = writer.new_totals()
    t0 = time.perf_counter()
    tensors = []
    for e in writer.container_entries(records, totals):
        enc = getattr(e, "encoded", None)
        if enc is None:
            continue
        job = jobs[e.name]
        m, v, p = (np.asarray(x, np.float32).reshape(-1) for x in (job.m, job.v, job.p))
        idx = np.asarray(enc.arrays["escape_index"], np.int64)
        row = {"name": e.name, "coordinates": enc.n, "escapes": int(idx.size),
               "payload_bytes": int(enc.stats["payload_bytes"])}
        if "widths" in enc.arrays:
            row["wide_blocks"] = int((np.asarray(enc.arrays["widths"]) != 0x88).sum())
        if idx.size:
            span = _block_span(v)
            with np.errstate(all="ignore"):
                ratio = np.abs(m[idx]) / np.sqrt(v[idx])
            half_ulp = np.spacing(np.abs(p[idx]).astype(np.float32)) / 2
            row.update({"span_escaping_blocks": float(np.nanmedian(span[idx // 256])),
                        "span_all_blocks": float(np.nanmedian(span)),
                        "v_escaped_over_median": float(np.median(v[idx]) / max(float(np.median(v[v > 0])) if (v > 0).any()
                                                                                 else 1.0, 1e-45)),
                        "m_over_sqrt_v": float(np.nanmedian(ratio)),
                        "final_rounding_share": float(np.mean(half_ulp > TAU * lr / 2))})
        tensors.append(row)
    n = totals["coordinates"]
    return {"kind": kind, "codec": codec, "lr": lr, "coordinates": n, "escapes": totals["escapes"],
            "escape_rate": totals["escapes"] / n, "payload_ratio": totals["payload_bytes"] / (8 * n),
            "seconds": time.perf_counter() - t0,
            "tensors": sorted(tensors, key=lambda r: -r["escapes"])[:6]}


def run(codecs, cache, every=100, log=print):
    os.makedirs(cache, exist_ok=True)
    jsonl = os.path.join(cache, "long_run.jsonl")
    done = {}
    if os.path.exists(jsonl):
        with open(jsonl) as fh:
            for line in fh:
                r = json.loads(line)
                done[(r["kind"], r["step"], r["codec"])] = r
    curves, rows = {}, []
    for kind in ("torch", "optax"):
        ck = lm_runs.fp32_checkpoints(kind, cache, every=every, log=log)
        curves[kind] = {"train_loss": ck["train_loss"], "eval_loss": ck["eval_loss"]}
        for step, path in sorted(ck["paths"].items()):
            for codec in codecs:
                key = (kind, step, codec)
                if key not in done:
                    r = {**measure(kind, path, codec), "step": step}
                    with open(jsonl, "a") as fh:
                        fh.write(json.dumps(r) + "\n")
                    done[key] = r
                    log(f"{kind} step {step} {codec}: {100 * r['payload_ratio']:.2f}% of FP32, "
                        f"{r['escapes']} escapes")
                rows.append(done[key])
    return rows, curves


def summary(rows, codecs):
    out = {}
    for kind in ("torch", "optax"):
        for codec in codecs:
            rs = sorted((r for r in rows if r["kind"] == kind and r["codec"] == codec), key=lambda r: r["step"])
            if not rs:
                continue
            short = rs[0]
            out[f"{kind}/{codec}"] = {
                "short_run_step": short["step"], "short_run_payload": short["payload_ratio"],
                "final_payload": rs[-1]["payload_ratio"], "max_payload": max(r["payload_ratio"] for r in rs),
                "max_payload_step": max(rs, key=lambda r: r["payload_ratio"])["step"],
                "max_escape_rate": max(r["escape_rate"] for r in rs),
                "points_above_short_run": 100 * (max(r["payload_ratio"] for r in rs) - short["payload_ratio"])}
    return out


def plot(rows, codecs, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, what, label in ((axes[0], "payload_ratio", "payload, % of FP32"), (axes[1], "escape_rate", "escapes, %")):
        for kind, style in (("torch", "-"), ("optax", "--")):
            for codec in codecs:
                rs = sorted((r for r in rows if r["kind"] == kind and r["codec"] == codec), key=lambda r: r["step"])
                if rs:
                    ax.plot([r["step"] for r in rs], [100 * r[what] for r in rs], style, marker=".",
                            label=f"{kind} {codec}")
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle("Default tau/C at every 100th save of a 2,000-step run (bench/long_run.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_md(res, path):
    codecs, rows = res["codecs"], res["rows"]
    lines = ["# Long runs: payload and escapes over 2,000 steps", "",
             f"`python bench/long_run.py --codecs {','.join(codecs)}`. Machine: {res['machine']}. "
             f"Commit {res['commit']}, torch {res['versions']['torch']}, jax {res['versions']['jax']}, optax "
             f"{res['versions']['optax']}.", "",
             "Models (bench/lm_runs.py): torch ByteTransformer (470,784 Adam coordinates, AdamW lr 1e-3, weight "
             "decay 0.01, warmup 100 + cosine to 1e-4 at 2,000, batch 16 x 64 bytes); optax byte-level MLP LM "
             "(336,768 coordinates, `optax.adamw` with the same schedule, batch 64). Each save compressed with "
             "default tau 0.01 and C 0.2 for the next update's lr; payload = moment bytes / FP32 bytes.", "",
             "## Summary", "",
             "| run | codec | step 100 | final (2,000) | worst (step) | worst escapes | worst - step 100 |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for key, s in res["summary"].items():
        kind, codec = key.split("/", 1)
        lines.append(f"| {kind} | {codec} | {100 * s['short_run_payload']:.2f}% | {100 * s['final_payload']:.2f}% | "
                     f"{100 * s['max_payload']:.2f}% ({s['max_payload_step']}) | {100 * s['max_escape_rate']:.3f}% | "
                     f"{s['points_above_short_run']:+.2f} points |")
    lines += ["", "## Every save", "", "| step | " + " | ".join(f"{k} {c}" for k in ("torch", "optax") for c in codecs)
              + " |", "|---:|" + "---:|" * (2 * len(codecs))]
    by = {(r["kind"], r["codec"], r["step"]): r for r in rows}
    for step in sorted({r["step"] for r in rows}):
        cells = []
        for k in ("torch", "optax"):
            for c in codecs:
                r = by.get((k, c, step))
                cells.append(f"{100 * r['payload_ratio']:.2f}% / {r['escapes']}" if r else "")
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    lines += ["", "Cells: payload % of FP32 / escapes.", "", "## Where the escapes are (step 2,000)", "",
              "| run | codec | tensor | coordinates | escapes | v span of their blocks / all blocks (binades) | "
              "their v / median v | their median abs(m)/sqrt(v) | final rounding alone > tau*lr/2 | wider blocks |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    last = max(r["step"] for r in rows)
    for k in ("torch", "optax"):
        for c in codecs:
            r = by.get((k, c, last))
            for t in (r or {}).get("tensors", [])[:4]:
                if not t["escapes"]:
                    continue
                lines.append(f"| {k} | {c} | {t['name']} | {t['coordinates']:,} | {t['escapes']:,} | "
                             f"{t.get('span_escaping_blocks', float('nan')):.1f} / {t.get('span_all_blocks', float('nan')):.1f} | "
                             f"{t.get('v_escaped_over_median', float('nan')):.2g} | {t.get('m_over_sqrt_v', float('nan')):.2f} | "
                             f"{100 * t.get('final_rounding_share', 0):.0f}% | {t.get('wide_blocks', '')} |")
    lm_runs.write_markdown(path, lines, res.get("notes"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--codecs", default="log8-rel,log8-rel-zstd")
    lm_runs.bench_options(ap, "long_run")
    a = ap.parse_args(argv)
    codecs = [c for c in a.codecs.split(",") if c]
    rows, curves = run(codecs, a.cache)
    res = {**lm_runs.run_context(a.machine), "codecs": codecs, "rows": rows, "curves": curves, "summary": summary(rows, codecs), "notes": a.notes}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as fh:
        json.dump(res, fh, indent=1)
    plot(rows, codecs, a.out + ".png")
    write_md(res, a.out + ".md")
    print(json.dumps(res["summary"], indent=1))


if __name__ == "__main__":
    main()
