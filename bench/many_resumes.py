"""A run resumed from a compressed checkpoint every 20 steps: does it drift from the run
that never stopped?

    python bench/many_resumes.py [--every 20] [--steps 2000] [--codec log8-rel-zstd]
                                 [--cache bench/.cache/long_run] [--out bench/results/many_resumes]
                                 [--kinds torch,optax] [--modes "guarded resume,plain resume"]

The two models of bench/lm_runs.py (torch AdamW and optax adamw, warmup + cosine, 2,000
steps), each trained seven ways from the same initial state on the same batches:

* ``no resume``: the reference (the long run of bench/long_run.py);
* ``plain resume``: every `--every` steps the whole state goes through ``torch.save`` /
  ``torch.load`` (torch) or ``np.savez`` / ``np.load`` (optax) and training continues from
  what was read: bit-exact, the control that resuming itself changes nothing;
* ``guarded resume``: the optimizer state goes through jaxguard (``--codec``, default tau and
  C) and back (``torch_compat.compress_checkpoint`` / ``restore_tree``; ``jaxguard.to_bytes``
  and ``jaxguard.load``); the parameters are stored exactly, as jaxguard stores them;
* ``unguarded 8-bit resume``: the same with ``block8-unguarded`` (bitsandbytes' dynamic 8-bit
  map, absmax per 256-block, no guard): what an 8-bit checkpoint without the certificate does;
* ``other batch order``: no resume, another data seed: the drift the run has anyway;
* ``1-ulp parameter resume``: at every resume the exact state with each parameter moved one
  ulp up or down (at random): the last bit only (the next update then differs about a
  tenth as much as after a guarded resume on torch, a hundredth on optax), to tell "this
  training amplifies any perturbation" from "the guard's error is too large";
* ``perturbed moments resume``: the exact state with m and v scaled by random relative
  errors about the size log8-rel's codes make (`PERTURB_REL`), on every coordinate;
* ``one 1-ulp nudge``: the 1-ulp perturbation once, at the first resume, then no resume:
  how far this training carries a single perturbation of the last bit.

At every resume the state that comes back and the exact state each take the next step on
the same batch: the largest difference per coordinate in units of ``tau * lr`` (what the
guard certifies <= 1 for gradients ``|g| <= C``) and its L2 norm against the update's.

Reported per run against the reference: the largest |eval loss difference| over the evals
every 100 steps, the final eval loss difference, the largest train loss over the run, and
the parameter distance at the end (L2; relative to the reference's norm; RMS per coordinate),
the first-update figures above, and the saves' escapes and payload over the run.  Each finished
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

MODES = ("no resume", "plain resume", "guarded resume", "unguarded 8-bit resume", "other batch order",
         "1-ulp parameter resume", "perturbed moments resume", "one 1-ulp nudge")
RESUMING = ("plain resume", "guarded resume", "unguarded 8-bit resume", "1-ulp parameter resume",
            "perturbed moments resume")
EVAL_EVERY = 100
# "perturbed moments resume": the exact state with m and v each multiplied by (1 + u * REL),
# u uniform in [-1, 1] per coordinate: a relative error of the size log8-rel's codes make
# (m to about 1%, v to about 2%, whose square root halves it), without the guard's choice of
# which coordinates may carry it.
PERTURB_REL = {"m": 0.01, "v": 0.02}


def _nudge(x, rng, what):
    """`x` (float32 numpy) perturbed as `what` says: "p" one ulp up or down per coordinate,
    "m"/"v" by a relative ``PERTURB_REL[what]`` (see PERTURB_REL)."""
    x = np.asarray(x, np.float32)
    if what == "p":
        return np.nextafter(x, np.where(rng.random(x.shape) < 0.5, -np.inf, np.inf).astype(np.float32))
    return (x * (1 + PERTURB_REL[what] * rng.uniform(-1, 1, x.shape))).astype(np.float32)


def _perturbed(run, mode):
    """`run`'s exact state, perturbed as `mode` says (the 1-ulp and perturbed-moments controls);
    a generator seeded by the step, so every run of a mode draws the same perturbations."""
    rng = np.random.default_rng([7, run.step])
    parts = ("m", "v") if mode == "perturbed moments resume" else ("p",)
    if run.kind == "torch":
        import torch
        ck = run.checkpoint()
        if "p" in parts:
            ck["model"] = {k: torch.from_numpy(_nudge(t.numpy(), rng, "p")) for k, t in ck["model"].items()}
        for st in ck["optimizer"]["state"].values():
            for key, what in (("exp_avg", "m"), ("exp_avg_sq", "v")):
                if what in parts:
                    st[key] = torch.from_numpy(_nudge(st[key].numpy(), rng, what))
        return ck
    jax = run.jax
    params, state = run.params, run.state
    if "p" in parts:
        params = jax.tree_util.tree_map(lambda x: run.jnp.asarray(_nudge(x, rng, "p")), params)
    adam = state[0]
    if "m" in parts:
        adam = adam._replace(mu=jax.tree_util.tree_map(lambda x: run.jnp.asarray(_nudge(x, rng, "m")), adam.mu),
                             nu=jax.tree_util.tree_map(lambda x: run.jnp.asarray(_nudge(x, rng, "v")), adam.nu))
    return params, (adam,) + tuple(state[1:])


def _restored(run, mode, codec, tmp):
    """What `mode`'s checkpoint of `run`'s state gives back: a torch checkpoint dict, or
    optax's ``(params, opt_state)``; and the save's summary (None for the controls)."""
    if mode in ("1-ulp parameter resume", "perturbed moments resume", "one 1-ulp nudge"):
        return _perturbed(run, mode), None
    if run.kind == "torch":
        import torch
        ck = run.checkpoint()
        if mode == "plain resume":
            buf = io.BytesIO()
            torch.save(ck, buf)
            buf.seek(0)
            return torch.load(buf, weights_only=False), None
        import torch_compat
        from jaxguard.format.container import atomic_write
        data, summary = torch_compat.compress_checkpoint(
            ck, codec=codec if mode == "guarded resume" else "block8-unguarded")
        path = os.path.join(tmp, "ckpt.jg")
        atomic_write(path, data)
        return torch_compat.restore_tree(path)[0], summary
    if mode == "plain resume":
        path = os.path.join(tmp, "state.npz")
        run.save_fp32(path)
        params, state, step = run.params, run.state, run.step
        run.load_fp32(path)
        out = (run.params, run.state)
        run.params, run.state, run.step = params, state, step
        return out, None
    import jaxguard as jg
    path = os.path.join(tmp, "state.jg")
    summary = jg.save(path, run.state, run.params, lr=run.schedule, weight_decay=lm_runs.WEIGHT_DECAY,
                      codec=codec if mode == "guarded resume" else "block8-unguarded")
    return (run.params, jg.load(path, like=run.state)), summary


def _load(run, restored):
    """Continue `run` from `restored` (a copy: torch's load may alias what it is given)."""
    if run.kind == "torch":
        import copy
        run.load(copy.deepcopy(restored))
    else:
        run.params, run.state = restored


def _first_update_error(run, restored, exact):
    """The next update from `restored` against the one from the `exact` state (same batch):
    (largest |difference| / (tau * lr), L2 of the difference, L2 of the exact update).
    tau is jaxguard's default, lr the next update's."""
    from jaxguard.core.config import GuardSpec
    step = run.step
    lr = lm_runs.lr_at(step + 1) if run.kind == "torch" else float(run.schedule(step))
    starts, ends = [], []
    for state in (exact, restored):
        _load(run, state)
        starts.append(run.params_flat().astype(np.float64))
        run.train_step()
        ends.append(run.params_flat().astype(np.float64))
        run.step = step
    diff = np.abs(ends[1] - ends[0])
    return float(diff.max() / (GuardSpec().tau * lr)), float(np.linalg.norm(diff)), float(np.linalg.norm(ends[0] - starts[0]))


def _exact(run):
    return run.checkpoint() if run.kind == "torch" else (run.params, run.state)


def _resume(run, mode, codec, tmp):
    """Send `run`'s state through `mode`'s checkpoint and continue from what comes back.

    Returns ``{"step", "first_update_over_tau_lr", "first_update_diff_l2", "update_l2"[,
    "escape_rate", "payload_ratio"]}``: the next update from the restored state against the
    exact state's (measured by stepping both on the next batch), and what the save reported."""
    exact = _exact(run)
    t = time.perf_counter()
    restored, summary = _restored(run, mode, codec, tmp)
    seconds = time.perf_counter() - t
    over, diff_l2, upd_l2 = _first_update_error(run, restored, exact)
    _load(run, restored)
    rec = {"step": run.step, "first_update_over_tau_lr": over, "first_update_diff_l2": diff_l2, "update_l2": upd_l2,
           "seconds": seconds}
    if summary:
        rec.update(escape_rate=summary["escape_rate"], payload_ratio=summary["payload_ratio"])
    return rec


def train(kind, mode, steps, every, codec, log=print):
    """One run of `kind` in `mode`; returns its losses and final parameters."""
    run = lm_runs.RUNS[kind](0, data_seed=1 if mode == "other batch order" else None)
    train_loss, eval_loss, resumes, resume_s, per_resume = [], {}, 0, 0.0, []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        while run.step < steps:
            train_loss.append(run.train_step())
            if run.step % EVAL_EVERY == 0:
                eval_loss[run.step] = run.eval_loss()
            if (mode in RESUMING and run.step % every == 0 and run.step < steps) or \
                    (mode == "one 1-ulp nudge" and run.step == every):
                per_resume.append(_resume(run, mode, codec, tmp))
                resume_s += per_resume[-1]["seconds"]
                resumes += 1
    log(f"{kind} {mode}: {time.perf_counter() - t0:.0f} s, {resumes} resumes, final eval {eval_loss[steps]:.4f}")
    return {"kind": kind, "mode": mode, "train_loss": train_loss, "eval_loss": eval_loss, "resumes": resumes,
            "resume_seconds": resume_s, "per_resume": per_resume, "params": run.params_flat()}


def compare(ref, other):
    steps = sorted(ref["eval_loss"])
    d = [abs(other["eval_loss"][s] - ref["eval_loss"][s]) for s in steps]
    dist = float(np.linalg.norm(other["params"].astype(np.float64) - ref["params"]))
    return {"max_eval_loss_diff": max(d), "final_eval_loss_diff": other["eval_loss"][steps[-1]] - ref["eval_loss"][steps[-1]],
            "final_eval_loss": other["eval_loss"][steps[-1]], "max_train_loss": max(other["train_loss"]),
            "max_train_loss_after_warmup": max(other["train_loss"][lm_runs.WARMUP:], default=float("nan")),
            "param_distance": dist, "param_distance_rel": dist / float(np.linalg.norm(ref["params"].astype(np.float64))),
            "param_rms": dist / np.sqrt(ref["params"].size),
            "resumes": other["resumes"], "resume_seconds": other["resume_seconds"], **_per_resume_summary(other)}


def _per_resume_summary(run):
    """The first update after each resume against the exact state's, and the saves' escapes
    and payload, over the run (absent for a run without resumes, or cached before they were
    measured)."""
    per = run.get("per_resume") or []
    if not per:
        return {}
    out = {"max_first_update_over_tau_lr": max(r["first_update_over_tau_lr"] for r in per),
           "median_first_update_rel_l2": float(np.median([r["first_update_diff_l2"] / r["update_l2"] for r in per]))}
    if "escape_rate" in per[0]:
        out.update(escape_rate_range=[min(r["escape_rate"] for r in per), max(r["escape_rate"] for r in per)],
                   payload_ratio_range=[min(r["payload_ratio"] for r in per), max(r["payload_ratio"] for r in per)])
    return out


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for col, kind in enumerate(("torch", "optax")):
        curves = res["curves"].get(kind, {})
        ref = curves.get("no resume")
        if not ref:
            continue
        ax = axes[0, col]
        for mode in MODES[1:]:
            c = curves.get(mode)
            if c:
                steps = sorted(int(s) for s in c)
                ax.plot(steps, [abs(c[str(s)] - ref[str(s)]) + 1e-9 for s in steps], marker=".", label=mode)
        ax.set_yscale("log")
        ax.set_xlabel("training step")
        ax.set_ylabel("|eval loss - no-resume eval loss|")
        ax.set_title(f"{kind} ({res['every']}-step resumes)")
        ax.legend(fontsize=7)
        ax = axes[1, col]
        for mode, per in res.get("first_updates", {}).get(kind, {}).items():
            ax.plot([s for s, _ in per], [max(o, 1e-6) for _, o in per], marker=".", lw=0.8, label=mode)
        ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_xlabel("training step of the resume")
        ax.set_ylabel("first update after it: max |diff| / (tau lr)")
        ax.legend(fontsize=7)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
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
             "Parameter distance: the L2 norm of (parameters - the reference's) over all coordinates; relative: "
             "divided by the reference's L2 norm; RMS: divided by the square root of the coordinate count. "
             "First update after a resume: the run's state after the checkpoint and the exact state each take "
             "the next step on the same batch; the largest per-coordinate difference over all resumes in units "
             "of tau * lr (jaxguard's default tau, the next update's lr: the guard certifies <= 1 for |g| <= C), "
             "and the median over resumes of its L2 norm over the exact update's.", "",
             "| model | run | resumes | max abs eval loss diff | final eval loss diff | max train loss after warmup | "
             "parameter distance (L2) | relative | RMS | x below other batch order | first update: max / (tau lr) | "
             "first update: L2 / update L2 | escapes | payload | seconds in saves + loads |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    pct = lambda r: f"{100 * r[0]:.3f}-{100 * r[1]:.3f}%" if r else ""  # noqa: E731
    for kind in ("torch", "optax"):
        order = res["comparisons"].get(f"{kind}/other batch order")
        for mode in MODES[1:]:
            c = res["comparisons"].get(f"{kind}/{mode}")
            if c:
                below = f"{order['param_distance'] / c['param_distance']:.1f}" if order and c["param_distance"] else ""
                first = (f"{c['max_first_update_over_tau_lr']:.3g} | {c['median_first_update_rel_l2']:.2e}"
                         if "max_first_update_over_tau_lr" in c else " | ")
                lines.append(f"| {kind} | {mode} | {c['resumes']} | {c['max_eval_loss_diff']:.2e} | "
                             f"{c['final_eval_loss_diff']:+.2e} | {c['max_train_loss_after_warmup']:.3f} | "
                             f"{c['param_distance']:.3e} | {c['param_distance_rel']:.2e} | {c['param_rms']:.2e} | "
                             f"{below} | {first} | {pct(c.get('escape_rate_range'))} | "
                             f"{pct(c.get('payload_ratio_range'))} | {c['resume_seconds']:.0f} |")
        ref = res["reference"].get(kind)
        if ref:
            lines.append(f"| {kind} | no resume (reference) | 0 | 0 | eval {ref['final_eval_loss']:.4f} | "
                         f"{ref['max_train_loss_after_warmup']:.3f} | 0 | 0 | 0 | | | | | | 0 |")
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
        res["first_updates"][kind] = prev.get("first_updates", {}).get(kind, {})
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
    comparisons, reference, curves, first_updates, missing = {}, {}, {}, {}, []
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
                       "resumes": r["resumes"], "resume_seconds": r["resume_seconds"], "per_resume": r["per_resume"],
                       "params_npy": os.path.join(a.cache, f"many_resumes-{kind}-{steps[kind]}-{mode.replace(' ', '_')}-{key[-1]}.npy")}
                np.save(rec["params_npy"], r["params"])
                with open(jsonl, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                done[key] = rec
            rec = done[key]
            runs[mode] = {**rec, "eval_loss": {int(k): v for k, v in rec["eval_loss"].items()},
                          "params": np.load(rec["params_npy"])}
            curves.setdefault(kind, {})[mode] = {str(k): v for k, v in rec["eval_loss"].items()}
            if rec.get("per_resume") and mode != "plain resume":
                first_updates.setdefault(kind, {})[mode] = [(r["step"], r["first_update_over_tau_lr"])
                                                            for r in rec["per_resume"]]
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
           "curves": curves, "first_updates": first_updates, "notes": a.notes, "carried": {}, "not_run": missing}
    carry_over(res, a.out + ".json")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as fh:
        json.dump(res, fh, indent=1)
    plot(res, a.out + ".png")
    write_md(res, a.out + ".md")
    print(json.dumps(comparisons, indent=1))


if __name__ == "__main__":
    main()
