"""Reproduce the full-checkpoint figures of guarded compression with shared-gradient bounds
(docs/papers.md section A) on the small models of torch_compat.models: a byte-level
transformer (stdlib source text) and a residual CNN with BatchNorm (sklearn digits), 4 seeds
each, Adam checkpoints at 10/50/100% of training.

Usage:
    python bench/reproduce.py                 # full run (resumable; ~40-60 min on 2 shared cores)
    python bench/reproduce.py --tiny --out /tmp/r --cache /tmp/c   # smoke test (1 seed, 20 steps, 2 codecs)
    python bench/reproduce.py --fresh         # ignore cached per-condition results (checkpoints are kept)

Options: --steps-transformer 400 --steps-cnn 300 --continue-steps 100 --codecs log8,bf16,...
--seeds 4 --no-ablation --ablation-fractions 1.0 --out bench/results --cache bench/.cache.

What it does, per condition (model, seed, fraction) and per codec in jaxguard.core.guard.CODECS
(read at run time):

* compress with ``torch_compat.compress_checkpoint`` (tau = 0.01, C = 0.2): coordinates,
  escapes, moment payload / FP32, whole container / ``torch.save`` bytes of the same CKPT;
* restore with ``torch_compat.restore_tree``; encode and restore seconds beside
  ``torch.save`` / ``torch.load`` seconds of the same CKPT in the same process (restore,
  save and load: median of 3; encode: one run, after one untimed warm-up encode per model
  kind and codec so that jit compilation is excluded);
* first-update audit with the real ``torch.optim.Adam(foreach=False, fused=False)``:
  real next-batch gradient plus ``gradient_grid(0.2)`` (45 gradients in all);
* continuation: 100 further Adam steps from the restored state and from the FP32 state,
  on the same batches (the sampler is reseeded identically for every branch), eval loss
  on a fixed held-out batch set; ``continuation_loss_delta`` = restored - FP32.

Then the bound/partition ablation (separate ranges vs shared difference with a linear
partition vs shared with the mixed partition, codec log8) on the pooled moments of the
final transformer checkpoints (--ablation-fractions; 4 seeds x 137,216 = 548,864 coordinates).

Resumable: every finished condition is appended to ``<out>/guarded_reproduction.runs.jsonl``
and skipped on the next run (key: model, seed, fraction, steps, continue steps; codecs
must be a superset); trained checkpoints are cached under ``--cache`` (gitignored).
Outputs: guarded_reproduction.json (rows, ablation, timing context, machine, versions,
commit), guarded_reproduction.md (tables beside the paper's figures) and PNG plots.

torch runs with one intra-op thread: on 2 contended cores two threads made a transformer
step 20x slower (0.94 s vs 0.05 s measured).  JAX uses its default CPU client.
"""
from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

SEEDS = {"transformer": (701, 707, 708, 709), "cnn": (701, 702, 703, 704)}
FRACTIONS = (0.1, 0.5, 1.0)
LR = 1e-3
TAU, CLIP = 0.01, 0.2
CONT_SEED = 424242      # sampler seed of every continuation branch (and of the real next gradient)
EVAL_SEED, EVAL_BATCHES = 999, 8
ABLATION = (("separate ranges", "separate", "mixed"), ("shared, linear partition", "shared", "linear"),
            ("shared, mixed partition", "shared", "mixed"))
PAPER_ABLATION = {"separate ranges": (988_820, 1.2663), "shared, linear partition": (439_362, 0.7168),
                  "shared, mixed partition": (5_324, 0.2828)}
PAPER_COORDS = 1_000_000
# the continuation's parameter difference, as a fraction of how far the exact state's own
# continuation moved the parameters (continuation_distances)
MOVE_HEADER = " param distance / the exact continuation's move |"
MODEL_NAMES = {"transformer": "ByteTransformer (stdlib source bytes)",
               "cnn": "ResidualCNN (BatchNorm, sklearn digits)"}
# the paper's full-checkpoint table (docs/papers.md A): (10%, 50%, 100%)
PAPER = {
    "transformer": {"name": "OPT-125M", "log8_reduction": (71.67, 69.44, 67.35), "vs_bf16": (45.08, 40.76, 36.69),
                    "vs_block8": (27.33, 29.08, 31.49), "container_reduction": (48.77, 48.46, 47.09),
                    "log8_escape": "0.6-4.9%", "block8_escape": "12-21%", "max_gap": 0.009992},
    "cnn": {"name": "ResNet-18/CIFAR-10", "log8_reduction": (72.18, 71.85, 71.56), "vs_bf16": (46.05, 45.41, 44.85),
            "vs_block8": (26.90, 42.64, 43.28), "container_reduction": (52.39, 52.22, 51.83),
            "log8_escape": "0.08-0.7%", "block8_escape": "11-23%", "max_gap": 0.009991},
}


# ---------------------------------------------------------------- helpers
def sampler(kind, seed):
    from torch_compat import models
    return models.text_batches(seed) if kind == "transformer" else models.digits_batches(seed)


def median_seconds(fn, repeats=3):
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def checkpoints(kind, seed, steps, cache: Path):
    """{fraction: CKPT}, trained once and cached on disk."""
    from torch_compat import models
    path = cache / f"{kind}-seed{seed}-steps{steps}.pt"
    if path.exists():
        return torch.load(path, weights_only=False), True
    ckpts, _, _ = models.train(kind, seed=seed, steps=steps, fractions=FRACTIONS, lr=LR)
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(ckpts, tmp)
    os.replace(tmp, path)
    return ckpts, False


def fingerprint(ckpt) -> str:
    """SHA-256 over every tensor of a CKPT (guards against in-place mutation)."""
    h = hashlib.sha256()

    def walk(o):
        if isinstance(o, torch.Tensor):
            h.update(o.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(o, dict):
            for k in sorted(o, key=str):
                h.update(str(k).encode())
                walk(o[k])
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)
        else:
            h.update(repr(o).encode())
    walk(ckpt)
    return h.hexdigest()


def source_hash() -> str:
    """SHA-256 of the library sources as imported by this run (the tree may be dirty)."""
    h = hashlib.sha256()
    for d in ("jaxguard", "torch_compat"):
        for f in sorted((ROOT / d).rglob("*.py")):
            h.update(str(f.relative_to(ROOT)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def eval_set(kind):
    s = sampler(kind, EVAL_SEED)
    return [s(False) for _ in range(EVAL_BATCHES)]


def model_and_opt(kind, ckpt):
    from torch_compat import models
    # deepcopy: Optimizer.load_state_dict keeps the given tensors (same dtype and device), so
    # the steps below would otherwise update the checkpoint's own exp_avg/exp_avg_sq in place
    ckpt = copy.deepcopy(ckpt)
    model, _ = models.make(kind, 0)
    model.load_state_dict(ckpt["model"])
    opt = torch.optim.Adam(model.named_parameters(), lr=LR, foreach=False)
    opt.load_state_dict(ckpt["optimizer"])
    return model, opt


def flat_params(named_tensors) -> np.ndarray:
    """Every floating-point tensor of a model state, flattened into one float64 vector."""
    return np.concatenate([t.detach().double().reshape(-1).numpy() for t in named_tensors.values()
                           if t.is_floating_point()])


def continue_training(kind, ckpt, steps, evals):
    """`steps` further Adam steps on the CONT_SEED batches; (mean eval loss on `evals`, the
    model state reached as flat_params)."""
    from torch_compat import models
    model, opt = model_and_opt(kind, ckpt)
    sample = sampler(kind, CONT_SEED)
    for _ in range(steps):
        model.train()
        opt.zero_grad()
        models.loss_fn(model, sample(True)).backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        return float(np.mean([float(models.loss_fn(model, b)) for b in evals])), flat_params(model.state_dict())


def continuation_distances(params, fp32_params, start_params) -> dict:
    """How far the parameters continued from a restored state end from those continued from the
    exact state: L2, and relative to the L2 length of the exact continuation's own move."""
    dist = float(np.linalg.norm(params - fp32_params))
    moved = float(np.linalg.norm(fp32_params - start_params))
    return {"continuation_param_distance": dist, "continuation_param_moved": moved,
            "continuation_param_distance_rel": dist / moved if moved else float("nan")}


def real_gradient(kind, ckpt):
    """Gradient of the first CONT_SEED batch: the batch the continuation's first update uses."""
    from torch_compat import models
    return models.next_gradients(kind, ckpt, sampler(kind, CONT_SEED))


# ---------------------------------------------------------------- one condition
def run_condition(kind, seed, fraction, ckpt, codecs, cont_steps, evals, warmed, tmpdir, warmup=True):
    import torch_compat
    from jaxguard.format.container import atomic_write
    from jaxguard.audit import gradient_grid

    t_cond = time.perf_counter()
    fp_before = fingerprint(ckpt)
    buf_path = os.path.join(tmpdir, "ckpt.pt")

    def tsave():
        torch.save(ckpt, buf_path)
    save_s, _ = median_seconds(tsave)
    torch_bytes = os.path.getsize(buf_path)
    load_s, _ = median_seconds(lambda: torch.load(buf_path, weights_only=True))
    grads = real_gradient(kind, ckpt)
    grid = gradient_grid(CLIP)
    t0 = time.perf_counter()
    fp32_loss, fp32_params = continue_training(kind, ckpt, cont_steps, evals) if cont_steps else (float("nan"), None)
    start_params = flat_params(ckpt["model"])
    cont_s = time.perf_counter() - t0
    rows = []
    for codec in codecs:
        if warmup and (kind, codec) not in warmed:  # jit compilation excluded from encode_seconds
            torch_compat.compress_checkpoint(ckpt, tau=TAU, clip=CLIP, codec=codec)
            warmed.add((kind, codec))
        data, s = torch_compat.compress_checkpoint(ckpt, tau=TAU, clip=CLIP, codec=codec)
        path = os.path.join(tmpdir, f"{codec}.jg")
        atomic_write(path, data)
        restore_s, (restored, _) = median_seconds(lambda: torch_compat.restore_tree(path))
        a = torch_compat.audit(ckpt, restored, tau=TAU, clip=CLIP, grads=grads, grid=grid)
        same_params = all(torch.equal(restored["model"][k], v) for k, v in ckpt["model"].items())
        loss, params = continue_training(kind, restored, cont_steps, evals) if cont_steps else (float("nan"), None)
        rows.append({
            "model": kind, "seed": seed, "fraction": fraction, "step": int(ckpt["step"]), "codec": codec,
            "guarded": codec != "block8-unguarded",
            "coordinates": s["coordinates"], "escapes": s["escapes"], "escape_rate": s["escape_rate"],
            "payload_bytes": s["payload_bytes"], "raw_fp32_bytes": s["raw_fp32_bytes"],
            "payload_ratio": s["payload_ratio"], "container_bytes": s["container_bytes"],
            "torch_save_bytes": torch_bytes, "container_ratio": s["container_bytes"] / torch_bytes,
            "first_update_max_gap_lr": a["max_gap_lr"], "audit_violations": a["violations"],
            "audit_gradients": a["gradients"] + 1,
            "encode_seconds": s["encode_seconds"], "restore_seconds": restore_s,
            "torch_save_seconds": save_s, "torch_load_seconds": load_s,
            "model_params_exact": same_params,
            "continuation_steps": cont_steps, "continuation_loss_fp32": fp32_loss,
            "continuation_loss": loss, "continuation_loss_delta": loss - fp32_loss,
            **(continuation_distances(params, fp32_params, start_params) if cont_steps else {}),
        })
    if fingerprint(ckpt) != fp_before:
        raise RuntimeError(f"{kind} seed {seed} {fraction}: the checkpoint changed during its condition")
    return {"rows": rows, "seconds": time.perf_counter() - t_cond, "fp32_continuation_seconds": cont_s,
            "ckpt_sha256": fp_before}


# ---------------------------------------------------------------- ablation
def run_ablation(ckpts, tmpdir):
    import torch_compat
    from jaxguard import GuardSpec
    out = []
    for label, bound, partition in ABLATION:
        tot = {"coordinates": 0, "escapes": 0, "payload_bytes": 0, "raw_fp32_bytes": 0, "encode_seconds": 0.0}
        for ck in ckpts:
            _, s = torch_compat.compress_checkpoint(ck, spec=GuardSpec(tau=TAU, clip=CLIP, codec="log8", bound=bound,
                                                                       partition=partition))
            for k in tot:
                tot[k] += s[k]
        paper_esc, paper_ratio = PAPER_ABLATION[label]
        out.append({"certificate": label, "bound": bound, "partition": partition, **tot,
                    "escape_rate": tot["escapes"] / tot["coordinates"],
                    "payload_ratio": tot["payload_bytes"] / tot["raw_fp32_bytes"],
                    "paper_escapes": paper_esc, "paper_escape_rate": paper_esc / PAPER_COORDS,
                    "paper_payload_ratio": paper_ratio})
    return out


# ---------------------------------------------------------------- JAX/optax counterpart (one model)
def run_optax(seeds, steps, codecs, cont_steps, tmpdir, tau=TAU):
    """An MLP (64-128-10) on sklearn digits trained with optax.adam; jaxguard.save/load at `tau`
    and the audit at `tau` with the real jitted optax update (jaxguard.optax_adapter.audit)."""
    import jax
    import jax.numpy as jnp
    import optax
    from sklearn.datasets import load_digits

    import jaxguard as jg
    from jaxguard import optax_adapter as oa
    d = load_digits()
    x = np.asarray(d.data, np.float32) / 16.0
    y = np.asarray(d.target, np.int32)
    split = int(0.9 * len(x))
    xe, ye = jnp.asarray(x[split:]), jnp.asarray(y[split:])
    tx = optax.adam(LR)

    def init(key):
        k1, k2 = jax.random.split(key)
        return {"h": {"kernel": jax.random.normal(k1, (64, 128)) * 0.125, "bias": jnp.zeros(128)},
                "out": {"kernel": jax.random.normal(k2, (128, 10)) * 0.09, "bias": jnp.zeros(10)}}

    def loss(p, xb, yb):
        h = jax.nn.relu(xb @ p["h"]["kernel"] + p["h"]["bias"])
        logits = h @ p["out"]["kernel"] + p["out"]["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    @jax.jit
    def step(p, st, xb, yb):
        g = jax.grad(loss)(p, xb, yb)
        u, st = tx.update(g, st, p)
        return optax.apply_updates(p, u), st

    def batches(seed, n):
        rng = np.random.default_rng(seed)
        for _ in range(n):
            i = rng.integers(0, split, 64)
            yield jnp.asarray(x[i]), jnp.asarray(y[i])

    def flat(p):
        return np.concatenate([np.asarray(x, np.float64).reshape(-1) for x in jax.tree_util.tree_leaves(p)])

    def cont(p, st):
        for xb, yb in batches(CONT_SEED, cont_steps):
            p, st = step(p, st, xb, yb)
        return float(loss(p, xe, ye)), flat(p)

    rows = []
    marks = {max(1, int(round(f * steps))): f for f in FRACTIONS}
    for seed in seeds:
        p = init(jax.random.PRNGKey(seed))
        st = tx.init(p)
        ck = {}
        for i, (xb, yb) in enumerate(batches(seed, steps), 1):
            p, st = step(p, st, xb, yb)
            if i in marks:
                ck[marks[i]] = (i, p, st)
        for f, (t, p, st) in sorted(ck.items()):
            fp32, fp32_params = cont(p, st)
            for codec in codecs:
                path = os.path.join(tmpdir, f"optax-{codec}.jg")
                s = jg.save(path, st, p, lr=LR, tau=tau, clip=CLIP, codec=codec)
                restored = jg.load(path, like=tx.init(p))
                a = oa.audit(tx, st, restored, p, lr=LR, tau=tau, clip=CLIP)
                cont_loss, cont_params = cont(p, restored)
                rows.append({"model": "mlp-optax", "seed": seed, "fraction": f, "step": t, "codec": codec, "tau": tau,
                             "guarded": codec != "block8-unguarded", "coordinates": s["coordinates"],
                             "escapes": s["escapes"], "escape_rate": s["escape_rate"],
                             "payload_ratio": s["payload_ratio"], "container_ratio_vs_raw_state": s["container_ratio"],
                             "first_update_max_gap_lr": a["max_gap_lr"], "audit_violations": a["violations"],
                             "encode_seconds": s["encode_seconds"],
                             "continuation_loss_delta": cont_loss - fp32,
                             **(continuation_distances(cont_params, fp32_params, flat(p)) if cont_steps else {})})
    return rows


# ---------------------------------------------------------------- context
def machine_info():
    info = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "python": platform.python_version(),
            "note": "2 CPU cores shared with other engineers' jobs (load average 5-7 during the run): "
                    "absolute seconds are inflated and noisy; ratios measured in the same process"}
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


def versions():
    import jax
    import jaxguard
    out = {"torch": torch.__version__, "jax": jax.__version__, "numpy": np.__version__,
           "jaxguard": jaxguard.__version__}
    try:
        out["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                       check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "jaxguard", "torch_compat"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        out["library_dirty"] = bool(dirty)
    except Exception:  # noqa: BLE001 - not a git checkout
        out["commit"] = None
    return out


def load_done(jsonl: Path):
    done = {}
    if jsonl.exists():
        for line in jsonl.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by an interruption
            done[rec["key"]] = rec
    return done


# ---------------------------------------------------------------- report
def summarize(rows, codecs):
    """{(model, fraction, codec): aggregates over seeds}."""
    agg = {}
    for r in rows:
        agg.setdefault((r["model"], r["fraction"], r["codec"]), []).append(r)
    out = {}
    for key, rs in agg.items():
        def mm(f):
            vals = [f(r) for r in rs]
            return {"mean": float(np.mean(vals)), "min": float(np.min(vals)), "max": float(np.max(vals))}
        out[key] = {"n": len(rs), "escape_rate": mm(lambda r: r["escape_rate"]),
                    "payload_ratio": mm(lambda r: r["payload_ratio"]),
                    "container_ratio": mm(lambda r: r["container_ratio"]),
                    "max_gap": max(r["first_update_max_gap_lr"] for r in rs),
                    "violations": sum(r["audit_violations"] for r in rs),
                    "encode_x_save": mm(lambda r: r["encode_seconds"] / r["torch_save_seconds"]),
                    "restore_x_load": mm(lambda r: r["restore_seconds"] / r["torch_load_seconds"]),
                    "loss_delta": mm(lambda r: r["continuation_loss_delta"]),
                    "param_distance_rel": mm(lambda r: r.get("continuation_param_distance_rel", float("nan"))),
                    "step": rs[0]["step"], "coordinates": rs[0]["coordinates"]}
    return out


def pct(d, scale=100.0, fmt="{:.2f}"):
    return f"{fmt.format(scale * d['mean'])} ({fmt.format(scale * d['min'])}-{fmt.format(scale * d['max'])})"


def write_markdown(path, result, codecs):
    rows = result["rows"]
    summ = summarize(rows, codecs)
    models = [m for m in ("transformer", "cnn") if any(r["model"] == m for r in rows)]
    fracs = sorted({r["fraction"] for r in rows})
    ctx = result["settings"]
    L = ["# Guarded compression: reproduction of the paper's full-checkpoint figures", "",
         f"`{result.get('command', 'python bench/reproduce.py')}` "
         f"({'tiny smoke settings' if ctx['tiny'] else 'full run' if result.get('command') in (None, 'python bench/reproduce.py') else 'resumable'}); commit "
         f"`{result['versions'].get('commit')}`; torch {result['versions']['torch']}, jax {result['versions']['jax']}; "
         f"{result['machine']['cpu_count']} CPU cores shared with other jobs (contention: absolute seconds are "
         "inflated and noisy, ratios are measured in the same process). tau = 0.01 lr, C = 0.2, "
         "`torch.optim.Adam(foreach=False)`, lr 1e-3.", "",
         "Models: " + "; ".join(f"{MODEL_NAMES[m]} {ctx['steps'][m]} steps, seeds "
                                f"{', '.join(map(str, ctx['seeds'][m]))}" for m in models)
         + f"; checkpoints at {', '.join(f'{int(100 * f)}%' for f in fracs)} of training. {len(rows)} restored conditions "
         f"(model x seed x fraction x codec), {len({(r['model'], r['seed'], r['fraction']) for r in rows})} checkpoints.",
         "", "## Per model, fraction and codec (mean over seeds, min-max in parentheses)", "",
         "| model | ckpt (step) | codec | escapes % | payload / FP32 % | container / torch.save % | worst gap (lr) "
         "| over tau | encode / torch.save | restore / torch.load | loss delta after "
         f"{ctx['continue_steps']} steps |" + (MOVE_HEADER if ctx["continue_steps"] else ""),
         "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if ctx["continue_steps"] else "")]
    for m in models:
        for f in fracs:
            for c in codecs:
                s = summ.get((m, f, c))
                if s is None:
                    continue
                L.append(f"| {m} | {int(100 * f)}% ({s['step']}) | {c}{'' if c != 'block8-unguarded' else ' **unguarded**'} "
                         f"| {pct(s['escape_rate'])} | {pct(s['payload_ratio'])} | {pct(s['container_ratio'])} "
                         f"| {s['max_gap']:.6f} | {s['violations']:,} | {s['encode_x_save']['mean']:.1f}x "
                         f"| {s['restore_x_load']['mean']:.2f}x | {s['loss_delta']['mean']:+.2e} "
                         f"({s['loss_delta']['min']:+.1e}..{s['loss_delta']['max']:+.1e}) |"
                         + (f" {pct(s['param_distance_rel'], fmt='{:.2e}', scale=1.0)} |" if ctx["continue_steps"] else ""))
    # paper comparison (its figures are log8's)
    if "log8" in codecs:
        L += ["", "## Beside the paper (docs/papers.md A; ours: mean over seeds)", "",
              "| model (paper's) | figure | ours " + " / ".join(f"{int(100 * f)}%" for f in fracs)
              + " | paper 10% / 50% / 100% |", "|---|---|---|---|"]
    for m in (models if "log8" in codecs else ()):
        P = PAPER[m]

        def ours(fn):
            vals = []
            for f in fracs:
                try:
                    vals.append(fn(f))
                except KeyError:
                    vals.append(float("nan"))
            return " / ".join(f"{v:.2f}" for v in vals)

        def red(f, c):
            return 100 * (1 - summ[(m, f, c)]["payload_ratio"]["mean"])

        def vs(f, c):
            return 100 * (1 - summ[(m, f, "log8")]["payload_ratio"]["mean"] / summ[(m, f, c)]["payload_ratio"]["mean"])
        name = f"{m} ({P['name']})"
        L.append(f"| {name} | log8 payload reduction vs FP32 % | {ours(lambda f: red(f, 'log8'))} | "
                 + " / ".join(map(str, P["log8_reduction"])) + " |")
        if "bf16" in codecs:
            L.append(f"| {name} | log8 smaller than guarded bf16 by % | {ours(lambda f: vs(f, 'bf16'))} | "
                     + " / ".join(map(str, P["vs_bf16"])) + " |")
        if "block8" in codecs:
            L.append(f"| {name} | log8 smaller than guarded block8 by % | {ours(lambda f: vs(f, 'block8'))} | "
                     + " / ".join(map(str, P["vs_block8"])) + " |")
        L.append(f"| {name} | whole-container reduction % (log8) | "
                 f"{ours(lambda f: 100 * (1 - summ[(m, f, 'log8')]['container_ratio']['mean']))} | "
                 + " / ".join(map(str, P["container_reduction"])) + " |")
        esc = [r["escape_rate"] for r in rows if r["model"] == m and r["codec"] == "log8"]
        L.append(f"| {name} | escape rate, log8 (range over all) | {100 * min(esc):.2f}-{100 * max(esc):.2f}% "
                 f"| {P['log8_escape']} |")
        escb = [r["escape_rate"] for r in rows if r["model"] == m and r["codec"] == "block8"]
        if escb:
            L.append(f"| {name} | escape rate, guarded block8 | {100 * min(escb):.2f}-{100 * max(escb):.2f}% "
                     f"| {P['block8_escape']} |")
        gaps = [r["first_update_max_gap_lr"] for r in rows if r["model"] == m and r["guarded"]]
        L.append(f"| {name} | largest guarded first-update gap (lr) | {max(gaps):.6f} | {P['max_gap']} |")
    # acceptance
    acc = result["acceptance"]
    L += ["", "## Acceptance", "",
          f"* Guarded rows with audit violations: **{acc['guarded_violating_rows']}** of {acc['guarded_rows']} "
          f"(worst guarded gap {acc['worst_guarded_gap_lr']:.6f} lr <= 0.01: {acc['worst_guarded_gap_lr'] <= TAU}).",
          f"* Unguarded block8: {acc['unguarded_rows_violating']} of {acc['unguarded_rows']} conditions violate, "
          f"{acc['unguarded_violations_total']:,} coordinates over tau in all, worst gap {acc['unguarded_worst_gap_lr']:.4g} lr.",
          f"* log8 smaller than guarded bf16 and guarded block8 in {acc['log8_smallest_conditions']} of "
          f"{acc['conditions']} conditions" + (f"; not in: {', '.join(acc['log8_not_smallest'])}" if
                                                 acc['log8_not_smallest'] else "") + ".",
          "* Restored model parameters bit-identical to the originals in every row: "
          f"{acc['model_params_exact']}."]
    if result.get("ablation"):
        ab = result["ablation"]
        n = ab[0]["coordinates"]
        L += ["", f"## Ablation: certificate, log8 codec, {n:,} pooled transformer coordinates "
              f"({result['settings']['ablation_source']})", "",
              "| certificate | escapes (ours) | rate | payload / FP32 (ours) | escapes (paper, 1M OPT-125M) | "
              "rate | payload / FP32 (paper) | encode s (ours) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for a in ab:
            L.append(f"| {a['certificate']} | {a['escapes']:,} | {100 * a['escape_rate']:.2f}% | "
                     f"{100 * a['payload_ratio']:.2f}% | {a['paper_escapes']:,} | {100 * a['paper_escape_rate']:.2f}% | "
                     f"{100 * a['paper_payload_ratio']:.2f}% | {a['encode_seconds']:.1f} |")
    tm = result["timing"]
    L += ["", "## Timing context", "",
          f"* Invocations (wall seconds; training seconds; checkpoints loaded from cache; conditions resumed): "
          + "; ".join(f"{i['key'][4:]}: {i['run_seconds']:.0f} s, train {i['train_seconds']:.0f} s, "
                      f"{i['ckpts_from_cache']} cached, {i['conditions_resumed']}/{i['conditions']} resumed"
                      for i in tm["invocations"]) + ".",
          f"* Compute recorded with the rows: conditions {tm['condition_seconds_total']:.0f} s, ablation "
          f"{tm.get('ablation_seconds', 0):.0f} s, optax {tm.get('optax_seconds', 0):.0f} s. Median torch.save "
          f"{tm['torch_save_seconds_median']:.4f} s, torch.load {tm['torch_load_seconds_median']:.4f} s.",
          "* Encode seconds exclude jit compilation (one untimed warm-up per model kind and codec); restore, "
          "torch.save and torch.load are medians of 3 in the same process. Encode runs the guard in JAX on "
          "CPU (the paper timed an H100), so encode / torch.save is much larger here than the paper's 7.2x.",
          "", "## JAX/optax counterpart", "", result["optax"], ""]
    orows = result.get("optax_rows") or []
    if orows:
        L += ["| ckpt (step) | codec | escapes % | payload / FP32 % | container / raw optax state % | worst gap (lr) "
              "| over tau | loss delta |" + (MOVE_HEADER if ctx["continue_steps"] else ""),
              "|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if ctx["continue_steps"] else "")]
        for f in sorted({r["fraction"] for r in orows}):
            for c in codecs:
                rs = [r for r in orows if r["fraction"] == f and r["codec"] == c]
                if not rs:
                    continue

                def mm(k, scale=100.0, fmt="{:.2f}"):
                    v = [scale * r[k] for r in rs]
                    return f"{fmt.format(np.mean(v))} ({fmt.format(min(v))}-{fmt.format(max(v))})"
                L.append(f"| {int(100 * f)}% ({rs[0]['step']}) | {c} | {mm('escape_rate')} | {mm('payload_ratio')} | "
                         f"{mm('container_ratio_vs_raw_state')} | {max(r['first_update_max_gap_lr'] for r in rs):.6g} | "
                         f"{sum(r['audit_violations'] for r in rs):,} | "
                         f"{np.mean([r['continuation_loss_delta'] for r in rs]):+.2e} |"
                         + (f" {mm('continuation_param_distance_rel', 1.0, '{:.2e}')} |"
                            if ctx["continue_steps"] else ""))
        L.append("")
    L += ["", "## Where our figures differ from the paper's, and why", "", result.get("discussion", ""), ""]
    Path(path).write_text("\n".join(L))


def plots(out: Path, rows, codecs):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summ = summarize(rows, codecs)
    models = [m for m in ("transformer", "cnn") if any(r["model"] == m for r in rows)]
    fracs = sorted({r["fraction"] for r in rows})
    files = []
    for metric, fname, ylabel in (("payload_ratio", "guarded_reproduction_payload.png", "moment payload / FP32 (%)"),
                                  ("escape_rate", "guarded_reproduction_escapes.png", "escape rate (%)")):
        fig, axes = plt.subplots(1, len(models), figsize=(6 * len(models), 4), squeeze=False)
        for ax, m in zip(axes[0], models):
            w = 0.8 / len(codecs)
            for i, c in enumerate(codecs):
                ys = [summ[(m, f, c)][metric] if (m, f, c) in summ else None for f in fracs]
                xs = [j + (i - (len(codecs) - 1) / 2) * w for j in range(len(fracs))]
                mean = [100 * y["mean"] if y else 0 for y in ys]
                lo = [100 * (y["mean"] - y["min"]) if y else 0 for y in ys]
                hi = [100 * (y["max"] - y["mean"]) if y else 0 for y in ys]
                ax.bar(xs, mean, w, yerr=[lo, hi], capsize=2, label=c)
            ax.set_xticks(range(len(fracs)), [f"{int(100 * f)}%" for f in fracs])
            ax.set_xlabel("checkpoint (fraction of training)")
            ax.set_ylabel(ylabel)
            ax.set_title(m)
            if metric == "escape_rate":
                ax.set_yscale("symlog", linthresh=0.1)
        handles, labels = axes[0][0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="upper center", ncol=len(codecs), fontsize=8)
        fig.tight_layout(rect=(0, 0, 1, 0.92))
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        files.append(fname)
    fig, ax = plt.subplots(figsize=(7, 4))
    data, labels = [], []
    for c in codecs:
        gaps = [max(r["first_update_max_gap_lr"], 1e-9) for r in rows if r["codec"] == c]
        if gaps:
            data.append(gaps)
            labels.append(c)
    ax.boxplot(data, showfliers=True)
    ax.set_xticks(range(1, len(labels) + 1), labels)
    for i, d in enumerate(data):
        ax.scatter(np.full(len(d), i + 1) + np.random.default_rng(i).uniform(-0.15, 0.15, len(d)), d, s=8, alpha=0.6)
    ax.axhline(TAU, color="red", ls="--", label="tau = 0.01 lr")
    ax.set_yscale("log")
    ax.set_ylabel("worst first-update gap per condition (lr)")
    ax.set_title("first-update audit, real torch Adam (next-batch g + gradient grid)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "guarded_reproduction_gaps.png", dpi=110)
    plt.close(fig)
    files.append("guarded_reproduction_gaps.png")
    return files


def acceptance(rows):
    guarded = [r for r in rows if r["guarded"]]
    ung = [r for r in rows if not r["guarded"]]
    conds = {}
    for r in rows:
        conds.setdefault((r["model"], r["seed"], r["fraction"]), {})[r["codec"]] = r
    not_smallest = []
    compared = 0
    for key, cs in conds.items():
        if "log8" not in cs:
            continue
        others = [c for c in ("bf16", "block8") if c in cs]
        if not others:
            continue
        compared += 1
        worse = [c for c in others if cs["log8"]["payload_bytes"] >= cs[c]["payload_bytes"]]
        if worse:
            not_smallest.append(f"{key[0]} seed {key[1]} {int(100 * key[2])}% (vs {', '.join(worse)})")
    bad = [r for r in guarded if r["audit_violations"] or r["first_update_max_gap_lr"] > TAU]
    return {"guarded_rows": len(guarded), "guarded_violating_rows": len(bad),
            "guarded_violating": [f"{r['model']} seed {r['seed']} {r['fraction']} {r['codec']}" for r in bad],
            "worst_guarded_gap_lr": max((r["first_update_max_gap_lr"] for r in guarded), default=0.0),
            "unguarded_rows": len(ung), "unguarded_rows_violating": sum(r["audit_violations"] > 0 for r in ung),
            "unguarded_violations_total": sum(r["audit_violations"] for r in ung),
            "unguarded_worst_gap_lr": max((r["first_update_max_gap_lr"] for r in ung), default=0.0),
            "conditions": compared, "log8_smallest_conditions": compared - len(not_smallest),
            "log8_not_smallest": not_smallest,
            "model_params_exact": all(r["model_params_exact"] for r in rows)}


# Written for the default full run (deterministic: two concurrent runs gave identical rows);
# the figures it quotes are in the tables above it in the Markdown.
DISCUSSION = """\
**Acceptance.** Every guarded restore (96 torch rows over 24 checkpoints x 4 guarded codecs, plus the optax
rows) passed the first-update audit with the real optimizer: 0 coordinates over tau, worst gap {worst:.6f} lr
(paper: 0.009992 / 0.009991). The unguarded block8 baseline broke the contract in every condition. log8 was
smaller than guarded bf16 and guarded block8 in all 24 torch conditions; it was **not** smaller than guarded
block8 for the optax MLP at any fraction (log8 69.5 / 48.2 / 46.7% of FP32 vs block8 60.1 / 45.9 / 43.1%),
and at 10% it was larger than guarded bf16 (51.6%) too (see its table).

**Where we differ, and why.** (1) *Scale and training length.* The paper's checkpoints sit at t = 1,250-31,250
on 125M/11M-parameter models; ours at t = 30-400 on 137,216 (transformer) and 5,018 (CNN) Adam coordinates.
The early checkpoints escape most: CNN 10% (step 30) log8 escapes 10% (paper 0.08-0.7%) and its payload is 37%
of FP32 instead of 28%; transformer 10% (step 40) 5.1% escapes, 32% of FP32. By 50-100% our log8 payload ratios
(transformer 28.9-29.5%, CNN 27.7-28.3%) match the paper's (28.3-32.7%). The usual explanation is the bias
corrections: the restored update lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) scales an m error by
1 / (1 - b1^t) and the v term by sqrt(1 - b2^t) (t = 30: 1/0.958 and 0.172). A first-order estimate says these
largely cancel against v's own small-t size (v ~ (1 - b2^t) E[g^2]), so we do not claim that mechanism as
verified; a wider spread of |m| inside a 256-block early in training (larger, less averaged gradients; linear
m codes are scaled by the block's largest |m|) fits the data as well. Not isolated here.
(2) *Guarded block8 escapes fewer here* on the transformer (7-10% vs 12-21%), so log8's lead
over it is smaller (9-20% vs 27-31%); on the CNN it is 15-24% vs 27-43%. Our block8 is the bitsandbytes dynamic
map (commit d2531c9); a plausible, untested reason is that with 256 byte embeddings and short training v spans
fewer decades per block than in OPT-125M's 50k-token embedding, where a fixed dynamic map loses most. (3) *Whole container.* The
transformer's 54-56% of torch.save is near the paper's 51-53%; the CNN's 62-68% is not, because 5,018
coordinates make the fixed header, JSON tree and per-tensor block metadata (and BatchNorm buffers, stored
exactly) a large share. (4) *Ablation.* Separate ranges escape 90.8% (paper 98.9%) and the mixed partition
1.74% (paper 0.53%, our moments are less trained), but the linear partition escapes only 2.00% against the
paper's 43.9%: in this library "linear" still refines to 1,024 linear cells (jaxguard/core/bound.py LEVELS) and
differs from "mixed" only by the geometric cells near g = 0. 20.6% of the pooled coordinates have
0 < v < (C/1024)^2, so tiny second moments alone do not explain the gap; we have not established whether the
paper's linear ablation used a coarser partition. This figure is **not** reproduced. (5) *Timing.* Encode runs
the guard in JAX on 2 contended CPU cores, against torch.save of a 1.7 MB (transformer) / 74 kB (CNN)
checkpoint that takes milliseconds, so guarded encode / torch.save is {enc_lo:.0f}-{enc_hi:.0f}x instead of the paper's
7.2x (GPU, 125M parameters), and log8 restore / torch.load is {res_lo:.2f}-{res_hi:.2f}x (paper 0.88x / 0.77x).
Medians for a transformer checkpoint: log8 encode {t_enc:.2f} s, restore {t_res:.3f} s; torch.save {t_save:.4f} s,
torch.load {t_load:.4f} s. (6) *Continuation.* After 100
further steps on identical batches, the loss difference from the FP32 branch is <= 1.1e-4 in magnitude on the
transformer for every codec, and up to 3.9e-3 on the CNN for every codec including bf16 and the unguarded one,
as in the paper (ResNet larger for all codecs): BatchNorm and 64-sample batches make the CNN branch noisier;
these deltas do not separate the codecs. (7) *optax MLP.* Its log8 escapes are high (20-42%), and its payload is above
guarded block8 at every fraction and above bf16 at 10%; the inputs are 8x8 digit pixels, several almost always zero, so a 256-block of the first
kernel mixes rows with tiny m and v and rows with ordinary ones; linear m codes scaled by the block's largest
|m| then resolve the small-m coordinates poorly relative to their sqrt(v). log8-rel, which codes m relative to
sqrt(v~), escapes 8-11% there (likely cause; not isolated further). (8) *log8-rel*, the new default codec,
is the smallest guarded codec on the transformer (27.6-27.7%, 0.07-0.17% escapes) and on the CNN at 10-50%;
at CNN 100% it is 0.26 points above log8 (4 block parameters instead of 2 set its floor at 27.9%).
"""


def timing_figures(rows):
    g = [r for r in rows if r["guarded"]]
    lt = [r for r in rows if r["codec"] == "log8"]
    tt = [r for r in lt if r["model"] == "transformer"]
    return {"enc_lo": min(r["encode_seconds"] / r["torch_save_seconds"] for r in g),
            "enc_hi": max(r["encode_seconds"] / r["torch_save_seconds"] for r in g),
            "res_lo": min(r["restore_seconds"] / r["torch_load_seconds"] for r in lt),
            "res_hi": max(r["restore_seconds"] / r["torch_load_seconds"] for r in lt),
            "t_enc": float(np.median([r["encode_seconds"] for r in tt])),
            "t_res": float(np.median([r["restore_seconds"] for r in tt])),
            "t_save": float(np.median([r["torch_save_seconds"] for r in tt])),
            "t_load": float(np.median([r["torch_load_seconds"] for r in tt]))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--cache", default=str(ROOT / "bench" / ".cache"))
    ap.add_argument("--tiny", action="store_true", help="smoke settings: the CNN only (unless --models), 1 seed, "
                    "20 steps, 2 codecs, 5 continuation steps, no warm-up, no ablation, optax 1 seed 20 steps")
    ap.add_argument("--steps-transformer", type=int, default=400)
    ap.add_argument("--steps-cnn", type=int, default=300)
    ap.add_argument("--continue-steps", type=int, default=100)
    ap.add_argument("--codecs", default=None, help="comma list (default: all of jaxguard.core.guard.CODECS)")
    ap.add_argument("--models", default=None, help="comma list (default transformer,cnn)")
    ap.add_argument("--no-optax", action="store_true", help="skip the JAX/optax counterpart")
    ap.add_argument("--optax-steps", type=int, default=300)
    ap.add_argument("--no-ablation", action="store_true")
    ap.add_argument("--ablation-fractions", default="1.0")
    ap.add_argument("--fresh", action="store_true", help="ignore the per-condition JSON-lines cache")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    ap.add_argument("--seeds", type=int, default=len(SEEDS["cnn"]),
                    help="the first N seeds of each model and of the optax counterpart (default all 4)")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    import jax
    # the same persistent XLA cache as tests/conftest.py: reruns and the smoke test skip recompiling
    jax.config.update("jax_compilation_cache_dir", os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxguard", "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

    from jaxguard.core.guard import CODECS
    torch.set_num_threads(args.threads)
    t_run = time.perf_counter()
    out, cache = Path(args.out), Path(args.cache)
    out.mkdir(parents=True, exist_ok=True)
    src_hash = source_hash()
    vers = {**versions(), "library_source_sha256_at_start": src_hash}
    models = [m for m in (args.models or ("cnn" if args.tiny else "transformer,cnn")).split(",") if m]
    codecs = [c for c in (args.codecs.split(",") if args.codecs else CODECS) if c]
    for c in codecs:
        if c not in CODECS:
            ap.error(f"codec {c!r} is not in jaxguard.core.guard.CODECS ({', '.join(CODECS)})")
    if not 1 <= args.seeds <= len(SEEDS["cnn"]):
        ap.error(f"--seeds {args.seeds}: choose 1 to {len(SEEDS['cnn'])}")
    seeds = {m: SEEDS[m][:args.seeds] for m in models}
    steps = {"transformer": args.steps_transformer, "cnn": args.steps_cnn}
    cont = args.continue_steps
    if args.tiny:
        seeds = {m: SEEDS[m][:1] for m in models}
        steps = {"transformer": 20, "cnn": 20}
        codecs = codecs if args.codecs else ["log8", "block8-unguarded"]
        cont = 5
        args.no_ablation = True
        args.optax_steps = 20
    jsonl = out / "guarded_reproduction.runs.jsonl"
    done = {} if args.fresh else load_done(jsonl)
    conditions = [(m, s, f) for m in models for s in seeds[m] for f in FRACTIONS]
    bar = tqdm(total=len(conditions) + (0 if args.no_ablation else 1) + (0 if args.no_optax else 1),
               desc="reproduce", unit="cond")
    warmed: set = set()
    evals = {}
    ckpt_store = {}
    train_s, from_cache, resumed = 0.0, 0, 0
    records = []
    with tempfile.TemporaryDirectory() as tmpdir:
        for m, s, f in conditions:
            key = f"{m}/seed{s}/frac{f}/steps{steps[m]}/cont{cont}"
            bar.set_postfix_str(key)
            rec = done.get(key)
            need_ckpt = (m, s) not in ckpt_store and (rec is None or (not args.no_ablation and m == "transformer"))
            if need_ckpt:
                t0 = time.perf_counter()
                ckpt_store[(m, s)], cached = checkpoints(m, s, steps[m], cache)
                train_s += time.perf_counter() - t0
                from_cache += cached
            if rec is not None and set(codecs) <= {r["codec"] for r in rec["rows"]}:
                rec = {**rec, "rows": [r for r in rec["rows"] if r["codec"] in codecs]}
                records.append(rec)
                resumed += 1
                bar.update(1)
                continue
            if m not in evals:
                evals[m] = eval_set(m)
            res = run_condition(m, s, f, ckpt_store[(m, s)][f], codecs, cont, evals[m], warmed, tmpdir,
                                warmup=not args.tiny)
            rec = {"key": key, **res, "library_source_sha256": src_hash, "commit_at_start": vers.get("commit")}
            with open(jsonl, "a") as fh:
                fh.write(json.dumps(rec) + "\n")
            records.append(rec)
            bad = [r for r in res["rows"] if r["guarded"] and (r["audit_violations"] or r["first_update_max_gap_lr"] > TAU)]
            if bad:
                tqdm.write(f"CRITICAL: guarded audit violation in {key}: "
                           + "; ".join(f"{r['codec']} violations={r['audit_violations']} gap={r['first_update_max_gap_lr']}"
                                       for r in bad))
            bar.update(1)
        rows = [r for rec in records for r in rec["rows"]]
        ablation, ab_s, ab_src = None, 0.0, None
        if not args.no_ablation and "transformer" in models:
            afr = tuple(float(x) for x in args.ablation_fractions.split(","))
            ab_key = f"ablation/steps{steps['transformer']}/fracs{','.join(map(str, afr))}/seeds{','.join(map(str, seeds['transformer']))}"
            bar.set_postfix_str(ab_key)
            if ab_key in done and not args.fresh:
                ablation, ab_s = done[ab_key]["ablation"], done[ab_key]["seconds"]
            else:
                t0 = time.perf_counter()
                cks = [ckpt_store[("transformer", s)][f] for s in seeds["transformer"] for f in afr]
                ablation = run_ablation(cks, tmpdir)
                ab_s = time.perf_counter() - t0
                with open(jsonl, "a") as fh:
                    fh.write(json.dumps({"key": ab_key, "ablation": ablation, "seconds": ab_s}) + "\n")
            ab_src = (f"log8 Adam moments of the {', '.join(f'{int(100 * f)}%' for f in afr)} checkpoints of the "
                      f"{len(seeds['transformer'])} transformer seeds, each tensor certified at its own step")
            bar.update(1)
        import jaxguard
        optax_rows, optax_s = None, 0.0
        if args.no_optax:
            optax_note = "Skipped (--no-optax)."
        elif not (hasattr(jaxguard, "save") and hasattr(jaxguard, "load")):
            optax_note = "Not done: `jaxguard.save` / `jaxguard.load` (jaxguard/optax_adapter.py) do not exist yet."
        else:
            oseeds = SEEDS["cnn"][:1 if args.tiny else args.seeds]
            okey = f"optax/steps{args.optax_steps}/cont{cont}/seeds{','.join(map(str, oseeds))}/codecs{','.join(codecs)}"
            bar.set_postfix_str(okey)
            if okey in done and not args.fresh:
                optax_rows, optax_s = done[okey]["rows"], done[okey]["seconds"]
            else:
                t0 = time.perf_counter()
                optax_rows = run_optax(oseeds, args.optax_steps, codecs, cont, tmpdir)
                optax_s = time.perf_counter() - t0
                with open(jsonl, "a") as fh:
                    fh.write(json.dumps({"key": okey, "rows": optax_rows, "seconds": optax_s}) + "\n")
            optax_note = (f"MLP 64-128-10 on sklearn digits, `optax.adam(1e-3)`, {args.optax_steps} steps, seeds "
                          f"{', '.join(map(str, oseeds))}, checkpoints at 10/50/100%; `jaxguard.save` / `jaxguard.load`, "
                          "audit with the real jitted optax update (`optax_adapter.audit`: gradient grid + one random "
                          f"draw; no real next-batch gradient), continuation {cont} steps on identical batches.")
        bar.close()
    result = {
        "command": shlex.join(["python", "bench/reproduce.py", *(sys.argv[1:] if argv is None else argv)]),
        "machine": machine_info(), "versions": vers,
        "rows_library_source_sha256": sorted({rec.get("library_source_sha256", "unrecorded") for rec in records}),
        "rows_commit_at_start": sorted({str(rec.get("commit_at_start", "unrecorded")) for rec in records}),
        "settings": {"tiny": args.tiny, "seeds": seeds, "steps": steps, "fractions": FRACTIONS, "codecs": codecs,
                     "continue_steps": cont, "tau": TAU, "clip": CLIP, "lr": LR, "continuation_sampler_seed": CONT_SEED,
                     "eval": f"{EVAL_BATCHES} held-out batches, sampler seed {EVAL_SEED}", "torch_threads": args.threads,
                     "ablation_source": ab_src,
                     "audit": "real torch.optim.Adam(foreach=False, fused=False): gradient_grid(0.2) (43 values), one "
                              "uniform per-coordinate draw, the real next-batch gradient clamped to [-0.2, 0.2]"},
        "rows": rows, "ablation": ablation, "optax_rows": optax_rows,
        "timing": {"run_seconds": time.perf_counter() - t_run, "train_seconds": train_s,
                   "ckpts_from_cache": from_cache, "conditions_resumed": resumed, "ablation_seconds": ab_s, "optax_seconds": optax_s,
                   "condition_seconds": {rec["key"]: rec["seconds"] for rec in records},
                   "torch_save_seconds_median": float(np.median([r["torch_save_seconds"] for r in rows])) if rows else None,
                   "torch_load_seconds_median": float(np.median([r["torch_load_seconds"] for r in rows])) if rows else None,
                   "condition_seconds_total": float(sum(rec["seconds"] for rec in records)),
                   "invocations": [rec for rec in done.values() if rec["key"].startswith("run/")]},
        "acceptance": acceptance(rows), "optax": optax_note, "paper": PAPER,
        "discussion": (DISCUSSION.format(worst=acceptance(rows)["worst_guarded_gap_lr"], **timing_figures(rows))
                       if not args.tiny and "transformer" in models and "log8" in codecs
                       else "(not the default full run with log8: no discussion)"),
    }
    run_rec = {"key": f"run/{time.strftime('%Y-%m-%dT%H:%M:%S')}", "run_seconds": result["timing"]["run_seconds"],
               "train_seconds": train_s, "ckpts_from_cache": from_cache, "conditions_resumed": resumed,
               "conditions": len(conditions), "loadavg_end": list(os.getloadavg())}
    result["timing"]["invocations"].append(run_rec)
    with open(jsonl, "a") as fh:
        fh.write(json.dumps(run_rec) + "\n")
    (out / "guarded_reproduction.json").write_text(json.dumps(result, indent=1))
    write_markdown(out / "guarded_reproduction.md", result, codecs)
    result["plots"] = plots(out, rows, codecs)
    acc = result["acceptance"]
    print(f"{len(rows)} rows; guarded violating rows: {acc['guarded_violating_rows']}; worst guarded gap "
          f"{acc['worst_guarded_gap_lr']:.6f} lr; log8 smallest in {acc['log8_smallest_conditions']}/{acc['conditions']}; "
          f"{result['timing']['run_seconds']:.0f} s -> {out}")
    return 1 if acc["guarded_violating_rows"] else 0


if __name__ == "__main__":
    sys.exit(main())
