"""A run resumed from a compressed checkpoint every 20 steps: does it drift from the run
that never stopped?

    python bench/many_resumes.py [--every 20] [--steps 2000] [--codec log8-rel-zstd]
                                 [--cache bench/.cache/long_run] [--out bench/results/many_resumes]
                                 [--kinds torch,optax] [--modes "guarded resume,plain resume"]

The two models of bench/lm_runs.py (torch AdamW and optax adamw, warmup + cosine, 2,000
steps), each trained five ways from the same initial state on the same batches:

* ``no resume``: the reference (the long run of bench/long_run.py);
* ``plain resume``: every `--every` steps the whole state goes through ``torch.save`` /
  ``torch.load`` (torch) or ``np.savez`` / ``np.load`` (optax) and training continues from
  what was read: bit-exact, the control that resuming itself changes nothing;
* ``guarded resume``: the optimizer state goes through jaxguard (``--codec``, default tau and
  C) and back (``torch_compat.compress_checkpoint`` / ``restore_tree``; ``jaxguard.to_bytes``
  and ``jaxguard.load``); the parameters are stored exactly, as jaxguard stores them;
* ``unguarded 8-bit resume``: the same with ``block8-unguarded`` (bitsandbytes' dynamic 8-bit
  map, absmax per 256-block, no guard): what an 8-bit checkpoint without the certificate does;
* ``other batch order``: no resume, another data seed: the drift the run has anyway.

Reported per run against the reference: the largest |eval loss difference| over the evals
every 100 steps, the final eval loss difference, the largest train loss over the run, and
the parameter distance at the end (L2, and relative to the reference's norm).  Each finished
run is cached in ``<cache>/many_resumes.jsonl``.  Writes JSON, Markdown and a PNG.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import lm_runs  # noqa: E402

MODES = ("no resume", "plain resume", "guarded resume", "unguarded 8-bit resume", "other batch order")
EVAL_EVERY = 100


def _resume(run, mode, codec, tmp):
    """Send `run`'s state through `mode`'s checkpoint and load what comes back."""
    if run.kind == "torch":
        import torch
        ck = run.checkpoint()
        if mode == "plain resume":
            buf = io.BytesIO()
            torch.save(ck, buf)
            buf.seek(0)
            run.load(torch.load(buf, weights_only=False))
            return
        import torch_compat
        from jaxguard.format.container import atomic_write
        data, _ = torch_compat.compress_checkpoint(ck, codec=codec if mode == "guarded resume" else "block8-unguarded")
        path = os.path.join(tmp, "ckpt.jg")
        atomic_write(path, data)
        restored, _ = torch_compat.restore_tree(path)
        run.load(restored)
        return
    if mode == "plain resume":
        path = os.path.join(tmp, "state.npz")
        run.save_fp32(path)
        run.load_fp32(path)
        return
    import jaxguard as jg
    path = os.path.join(tmp, "state.jg")
    jg.save(path, run.state, run.params, lr=run.schedule, weight_decay=lm_runs.WEIGHT_DECAY,
            codec=codec if mode == "guarded resume" else "block8-unguarded")
    run.state = jg.load(path, like=run.state)


def train(kind, mode, steps, every, codec, log=print):
    """One run of `kind` in `mode`; returns its losses and final parameters."""
    run = lm_runs.RUNS[kind](0, data_seed=1 if mode == "other batch order" else None)
    train_loss, eval_loss, resumes, resume_s = [], {}, 0, 0.0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        while run.step < steps:
            train_loss.append(run.train_step())
            if run.step % EVAL_EVERY == 0:
                eval_loss[run.step] = run.eval_loss()
            if mode in ("plain resume", "guarded resume", "unguarded 8-bit resume") and run.step % every == 0 \
                    and run.step < steps:
                t = time.perf_counter()
                _resume(run, mode, codec, tmp)
                resume_s += time.perf_counter() - t
                resumes += 1
    log(f"{kind} {mode}: {time.perf_counter() - t0:.0f} s, {resumes} resumes, final eval {eval_loss[steps]:.4f}")
    return {"kind": kind, "mode": mode, "train_loss": train_loss, "eval_loss": eval_loss, "resumes": resumes,
            "resume_seconds": resume_s, "params": run.params_flat()}


def compare(ref, other):
    steps = sorted(ref["eval_loss"])
    d = [abs(other["eval_loss"][s] - ref["eval_loss"][s]) for s in steps]
    dist = float(np.linalg.norm(other["params"].astype(np.float64) - ref["params"]))
    return {"max_eval_loss_diff": max(d), "final_eval_loss_diff": other["eval_loss"][steps[-1]] - ref["eval_loss"][steps[-1]],
            "final_eval_loss": other["eval_loss"][steps[-1]], "max_train_loss": max(other["train_loss"]),
            "max_train_loss_after_warmup": max(other["train_loss"][lm_runs.WARMUP:]),
            "param_distance": dist, "param_distance_rel": dist / float(np.linalg.norm(ref["params"].astype(np.float64))),
            "resumes": other["resumes"], "resume_seconds": other["resume_seconds"]}


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, kind in zip(axes, ("torch", "optax")):
        curves = res["curves"].get(kind, {})
        ref = curves.get("no resume")
        if not ref:
            continue
        for mode in MODES[1:]:
            c = curves.get(mode)
            if c:
                steps = sorted(int(s) for s in c)
                ax.plot(steps, [abs(c[str(s)] - ref[str(s)]) + 1e-9 for s in steps], marker=".", label=mode)
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel("|eval loss - no-resume eval loss|")
        ax.set_title(f"{kind} ({res['every']}-step resumes)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_md(res, path):
    steps = ", ".join(f"{k} {n:,}" for k, n in res["steps"].items())
    lines = [f"# Many resumes: runs of {steps} steps resumed every {res['every']} steps", "",
             f"`python bench/many_resumes.py --every {res['every']} --steps "
             f"{','.join(f'{k}={n}' for k, n in res['steps'].items())} --codec {res['codec']}`. "
             f"Machine: {res['machine']}. "
             f"Commit {res['commit']}, torch {res['versions']['torch']}, jax {res['versions']['jax']}, optax "
             f"{res['versions']['optax']}.", "",
             "Models and schedules: bench/lm_runs.py (torch ByteTransformer, AdamW; optax MLP LM, adamw; warmup 100 "
             "+ cosine 1e-3 -> 1e-4 over 2,000 steps; a shorter --steps runs the first steps of that schedule). Every run starts from the same initial state and sees the same "
             "batches (but `other batch order`); eval loss on 8 held-out batches every 100 steps; distances against "
             "the run that never stopped.", "",
             "| model | run | resumes | max abs eval loss diff | final eval loss diff | max train loss after warmup | "
             "parameter distance (L2) | relative | seconds in resumes |", "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for kind in ("torch", "optax"):
        for mode in MODES[1:]:
            c = res["comparisons"].get(f"{kind}/{mode}")
            if c:
                lines.append(f"| {kind} | {mode} | {c['resumes']} | {c['max_eval_loss_diff']:.2e} | "
                             f"{c['final_eval_loss_diff']:+.2e} | {c['max_train_loss_after_warmup']:.3f} | "
                             f"{c['param_distance']:.3e} | {c['param_distance_rel']:.2e} | {c['resume_seconds']:.0f} |")
        ref = res["reference"].get(kind)
        if ref:
            lines.append(f"| {kind} | no resume (reference) | 0 | 0 | eval {ref['final_eval_loss']:.4f} | "
                         f"{ref['max_train_loss_after_warmup']:.3f} | 0 | 0 | 0 |")
    if res.get("not_run"):
        lines += ["", "Not run (not in `--modes` and not in the cache): " + ", ".join(res["not_run"]) + "."]
    carried = res.get("carried") or {}
    if carried:
        lines += ["", "Not rerun by this call (`--kinds " + ",".join(k for k in res["steps"] if k not in carried)
                  + "`), kept from the previous result of this benchmark: " + "; ".join(
                      f"{k} ({res['steps'][k]:,} steps, commit {c})" for k, c in carried.items()) + "."]
    lm_runs.write_markdown(path, lines, res.get("notes"))


def carry_over(res, previous_json):
    """Keep the models this call did not run (--kinds) from the previous result at the same
    --out, if it resumed as often with the same codec; res["carried"] names the commit that
    ran each."""
    if not os.path.exists(previous_json):
        return
    with open(previous_json) as fh:
        prev = json.load(fh)
    if (prev.get("every"), prev.get("codec")) != (res["every"], res["codec"]):
        return
    for kind, n in prev["steps"].items():
        if kind in res["steps"]:
            continue
        res["steps"][kind] = n
        res["carried"][kind] = prev.get("carried", {}).get(kind, prev["commit"])
        res["reference"][kind] = prev["reference"][kind]
        res["curves"][kind] = prev["curves"][kind]
        res["comparisons"].update({k: v for k, v in prev["comparisons"].items() if k.startswith(kind + "/")})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--steps", default=str(lm_runs.STEPS),
                    help="steps of every run: N, or per model torch=N,optax=M (a shorter run follows the "
                         "first steps of the 2,000-step schedule)")
    ap.add_argument("--codec", default=None, help="the guarded resumes' codec (default: jaxguard's default)")
    ap.add_argument("--kinds", default="torch,optax")
    ap.add_argument("--modes", default=",".join(MODES),
                    help="train only these runs (comma-separated; the cache keeps them): two processes with "
                         "disjoint --modes share the work, a last call without --modes writes the result (one "
                         "with --modes writes what the cache holds, once it holds the run that never stops)")
    lm_runs.bench_options(ap, "many_resumes")
    a = ap.parse_args(argv)
    from jaxguard.format.spec import DEFAULT_CODEC
    codec = a.codec or DEFAULT_CODEC
    kinds = a.kinds.split(",")
    steps = {k: int(n) for k, n in (p.split("=") for p in a.steps.split(","))} if "=" in a.steps \
        else dict.fromkeys(kinds, int(a.steps))
    os.makedirs(a.cache, exist_ok=True)
    jsonl = os.path.join(a.cache, "many_resumes.jsonl")
    done = {}
    if os.path.exists(jsonl):
        with open(jsonl) as fh:
            for line in fh:
                r = json.loads(line)
                done[(r["kind"], r["mode"], r["every"], r["steps"], r["codec"])] = r
    modes = a.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"--modes: unknown run(s) {unknown}; choose from {list(MODES)}")
    comparisons, reference, curves, missing = {}, {}, {}, []
    for kind in kinds:
        runs = {}
        for mode in MODES:
            key = (kind, mode, a.every, steps[kind], codec if mode == "guarded resume" else "")
            if key not in done and mode not in modes:
                continue
            if key not in done:
                r = train(kind, mode, steps[kind], a.every, codec)
                rec = {"kind": kind, "mode": mode, "every": a.every, "steps": steps[kind], "codec": key[-1],
                       "train_loss": r["train_loss"], "eval_loss": {str(k): v for k, v in r["eval_loss"].items()},
                       "resumes": r["resumes"], "resume_seconds": r["resume_seconds"],
                       "params_npy": os.path.join(a.cache, f"many_resumes-{kind}-{steps[kind]}-{mode.replace(' ', '_')}-{key[-1]}.npy")}
                np.save(rec["params_npy"], r["params"])
                with open(jsonl, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                done[key] = rec
            rec = done[key]
            runs[mode] = {**rec, "eval_loss": {int(k): v for k, v in rec["eval_loss"].items()},
                          "params": np.load(rec["params_npy"])}
            curves.setdefault(kind, {})[mode] = {str(k): v for k, v in rec["eval_loss"].items()}
        if "no resume" not in runs:
            print(f"{kind}: {sorted(runs)} cached; the result is written once the run that never stops is")
            return
        missing += [f"{kind} {mode}" for mode in MODES if mode not in runs]
        ref = runs["no resume"]
        reference[kind] = {k: v for k, v in compare(ref, ref).items() if k in ("final_eval_loss", "max_train_loss_after_warmup")}
        for mode in MODES[1:]:
            if mode in runs:
                comparisons[f"{kind}/{mode}"] = compare(ref, runs[mode])
    res = {**lm_runs.run_context(a.machine), "every": a.every, "steps": {k: steps[k] for k in kinds}, "codec": codec,
           "comparisons": comparisons, "reference": reference,
           "curves": curves, "notes": a.notes, "carried": {}, "not_run": missing}
    carry_over(res, a.out + ".json")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as fh:
        json.dump(res, fh, indent=1)
    plot(res, a.out + ".png")
    write_md(res, a.out + ".md")
    print(json.dumps(comparisons, indent=1))


if __name__ == "__main__":
    main()
