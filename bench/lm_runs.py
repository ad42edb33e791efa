"""Two small language models trained as a user trains them, for the long-run benchmarks
(bench/long_run.py: payload and escapes over 2,000 steps; bench/many_resumes.py: a run
resumed from a compressed checkpoint every 20 steps).

* torch: `torch_compat.models.ByteTransformer` (d=128, 2 layers, 4 heads, context 64:
  470,784 Adam coordinates) on the standard library's source bytes, the real
  ``torch.optim.AdamW`` (lr 1e-3, weight decay 0.01, ``foreach=False``) with a linear warmup
  over 100 steps and a cosine decay to 1e-4 at step 2,000, batch 16.
* optax: a byte-level MLP LM (8 context bytes, each embedded in 32 dimensions, one hidden
  layer of 640 GELU units, 256 logits: 336,768 Adam coordinates), ``optax.adamw`` with
  ``optax.warmup_cosine_decay_schedule(0, 1e-3, 100, 2000, 1e-4)``, weight decay 0.01,
  batch 64.

Batches are drawn from a generator seeded by (seed, step), so a run resumed at any step
sees exactly the batches of a run that never stopped.  ``Run.state()`` / ``Run.load()``
move the whole training state (FP32) in and out; the resume benchmark replaces the
optimizer's moments with what a compressed checkpoint restores.
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

STEPS = 2000
WARMUP = 100
PEAK_LR, END_LR = 1e-3, 1e-4
WEIGHT_DECAY = 0.01
EVAL_BATCHES = 8


def lr_at(step: int) -> float:
    """The learning rate of update number `step` (1-based): linear warmup, then cosine."""
    if step <= WARMUP:
        return PEAK_LR * step / WARMUP
    frac = min(1.0, (step - WARMUP) / (STEPS - WARMUP))
    return END_LR + 0.5 * (PEAK_LR - END_LR) * (1 + math.cos(math.pi * frac))


_CORPUS = {}


def corpus():
    """(train bytes, held-out bytes) of the standard library's source (int64)."""
    if "c" not in _CORPUS:
        from torch_compat import models
        data = models.stdlib_corpus(2_000_000).astype(np.int64)
        split = int(0.95 * len(data))
        _CORPUS["c"] = (data[:split], data[split:])
    return _CORPUS["c"]


def windows(step: int, seed: int, batch: int, ctx: int, train: bool = True):
    """(x, y) int64 [batch, ctx] windows for `step`, from a generator seeded by (seed, step)."""
    data = corpus()[0 if train else 1]
    rng = np.random.default_rng([seed, step, 0 if train else 1])
    i = rng.integers(0, len(data) - ctx - 1, batch)
    x = np.stack([data[j:j + ctx] for j in i])
    y = np.stack([data[j + 1:j + ctx + 1] for j in i])
    return x, y


# ---------------------------------------------------------------- torch
class TorchRun:
    """The ByteTransformer under AdamW with the warmup + cosine schedule."""

    kind = "torch"
    BATCH, CTX = 16, 64

    def __init__(self, seed: int = 0, data_seed: int | None = None):
        import torch
        from torch_compat import models
        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.torch = torch
        self.data_seed = seed if data_seed is None else data_seed
        self.model = models.ByteTransformer(d=128, layers=2, heads=4, ctx=self.CTX)
        self.opt = torch.optim.AdamW(self.model.named_parameters(), lr=lr_at(1), weight_decay=WEIGHT_DECAY,
                                     foreach=False)
        self.step = 0
        self.evals = [windows(10_000 + k, 999, self.BATCH, self.CTX, train=False) for k in range(EVAL_BATCHES)]

    def train_step(self) -> float:
        torch = self.torch
        x, y = windows(self.step + 1, self.data_seed, self.BATCH, self.CTX)
        for g in self.opt.param_groups:
            g["lr"] = lr_at(self.step + 1)
        self.opt.zero_grad()
        out = self.model(torch.from_numpy(x))
        loss = torch.nn.functional.cross_entropy(out.reshape(-1, 256), torch.from_numpy(y).reshape(-1))
        loss.backward()
        self.opt.step()
        self.step += 1
        for g in self.opt.param_groups:   # what a scheduler leaves there: the next update's lr
            g["lr"] = lr_at(self.step + 1)
        return float(loss.detach())

    def eval_loss(self) -> float:
        torch = self.torch
        with torch.no_grad():
            tot = 0.0
            for x, y in self.evals:
                out = self.model(torch.from_numpy(x))
                tot += float(torch.nn.functional.cross_entropy(out.reshape(-1, 256), torch.from_numpy(y).reshape(-1)))
        return tot / len(self.evals)

    def checkpoint(self) -> dict:
        """``{"model", "optimizer", "step"}`` (copies), what `jaxguard compress` takes."""
        import copy
        return {"model": copy.deepcopy(self.model.state_dict()), "optimizer": copy.deepcopy(self.opt.state_dict()),
                "step": self.step}

    def load(self, ckpt: dict) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        self.step = int(ckpt["step"])

    def params_flat(self) -> np.ndarray:
        return np.concatenate([p.detach().numpy().reshape(-1) for p in self.model.parameters()])

    def save_fp32(self, path) -> None:
        self.torch.save(self.checkpoint(), path)

    def load_fp32(self, path) -> None:
        self.load(self.torch.load(path, weights_only=False))


# ---------------------------------------------------------------- optax
class OptaxRun:
    """The byte-level MLP LM under optax.adamw with the warmup + cosine schedule."""

    kind = "optax"
    BATCH, CTX, EMBED, HIDDEN = 64, 8, 32, 640

    def __init__(self, seed: int = 0, data_seed: int | None = None):
        import jax
        import jax.numpy as jnp
        import optax
        self.jax, self.jnp, self.optax = jax, jnp, optax
        self.data_seed = seed if data_seed is None else data_seed
        self.schedule = optax.warmup_cosine_decay_schedule(0.0, PEAK_LR, WARMUP, STEPS, END_LR)
        self.tx = optax.adamw(self.schedule, weight_decay=WEIGHT_DECAY)
        k = jax.random.split(jax.random.PRNGKey(seed), 3)
        d_in = self.CTX * self.EMBED
        self.params = {
            "embed": jax.random.normal(k[0], (256, self.EMBED), jnp.float32) * 0.5,
            "hidden": {"kernel": jax.random.normal(k[1], (d_in, self.HIDDEN), jnp.float32) / np.sqrt(d_in),
                       "bias": jnp.zeros(self.HIDDEN, jnp.float32)},
            "out": {"kernel": jax.random.normal(k[2], (self.HIDDEN, 256), jnp.float32) / np.sqrt(self.HIDDEN),
                    "bias": jnp.zeros(256, jnp.float32)},
        }
        self.state = self.tx.init(self.params)
        self.step = 0
        ev = [windows(10_000 + k, 999, self.BATCH, self.CTX + 1, train=False) for k in range(EVAL_BATCHES)]
        self.evals = [(jnp.asarray(x[:, :-1]), jnp.asarray(x[:, -1])) for x, _ in ev]
        tx = self.tx

        def loss(p, x, y):
            e = p["embed"][x].reshape(x.shape[0], -1)
            h = jax.nn.gelu(e @ p["hidden"]["kernel"] + p["hidden"]["bias"])
            logits = h @ p["out"]["kernel"] + p["out"]["bias"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        @jax.jit
        def step(p, st, x, y):
            val, g = jax.value_and_grad(loss)(p, x, y)
            u, st = tx.update(g, st, p)
            return optax.apply_updates(p, u), st, val

        self._loss, self._step = jax.jit(loss), step

    def batch(self, step):
        x, _ = windows(step, self.data_seed, self.BATCH, self.CTX + 1)
        return self.jnp.asarray(x[:, :-1]), self.jnp.asarray(x[:, -1])

    def train_step(self) -> float:
        x, y = self.batch(self.step + 1)
        self.params, self.state, val = self._step(self.params, self.state, x, y)
        self.step += 1
        return float(val)

    def eval_loss(self) -> float:
        return float(np.mean([float(self._loss(self.params, x, y)) for x, y in self.evals]))

    def params_flat(self) -> np.ndarray:
        return np.concatenate([np.asarray(x).reshape(-1) for x in self.jax.tree_util.tree_leaves(self.params)])

    def save_fp32(self, path) -> None:
        leaves = self.jax.tree_util.tree_leaves((self.params, self.state))
        np.savez(path, step=self.step, *[np.asarray(x) for x in leaves])

    def load_fp32(self, path) -> None:
        with np.load(path) as z:
            leaves = [z[f"arr_{i}"] for i in range(len(z.files) - 1)]
            self.step = int(z["step"])
        treedef = self.jax.tree_util.tree_structure((self.params, self.state))
        self.params, self.state = self.jax.tree_util.tree_unflatten(treedef, [self.jnp.asarray(x) for x in leaves])


RUNS = {"torch": TorchRun, "optax": OptaxRun}


def fp32_checkpoints(kind: str, cache: str, steps: int = STEPS, every: int = 100, seed: int = 0, log=print) -> dict:
    """The no-resume run of `kind`, its FP32 state saved every `every` steps under `cache`
    (resumable: a run cut short continues from its last saved state).

    Returns:
      ``{"paths": {step: file}, "train_loss": [...], "eval_loss": {step: loss}}``.
    """
    import json
    os.makedirs(cache, exist_ok=True)
    ext = ".pt" if kind == "torch" else ".npz"
    path = lambda s: os.path.join(cache, f"{kind}-seed{seed}-step{s:05d}{ext}")  # noqa: E731
    log_path = os.path.join(cache, f"{kind}-seed{seed}-log.json")
    hist = {"train_loss": [], "eval_loss": {}}
    if os.path.exists(log_path):
        with open(log_path) as fh:
            hist = json.load(fh)
    run = RUNS[kind](seed)
    done = [s for s in range(every, steps + 1, every) if os.path.exists(path(s))]
    if done:
        run.load_fp32(path(done[-1]))
        hist["train_loss"] = hist["train_loss"][:done[-1]]
    while run.step < steps:
        hist["train_loss"].append(run.train_step())
        if run.step % every == 0:
            hist["eval_loss"][str(run.step)] = run.eval_loss()
            tmp = path(run.step) + ".tmp" + ext
            run.save_fp32(tmp)
            os.replace(tmp, path(run.step))
            with open(log_path + ".tmp", "w") as fh:
                json.dump(hist, fh)
            os.replace(log_path + ".tmp", log_path)
            log(f"{kind} step {run.step}: train {np.mean(hist['train_loss'][-every:]):.4f} "
                f"eval {hist['eval_loss'][str(run.step)]:.4f}")
    return {"paths": {s: path(s) for s in range(every, steps + 1, every)}, **hist}


if __name__ == "__main__":   # python bench/lm_runs.py torch|optax CACHE: the no-resume run's checkpoints
    fp32_checkpoints(sys.argv[1], sys.argv[2])


def bench_options(ap, name):
    """The options bench/long_run.py and bench/many_resumes.py share."""
    ap.add_argument("--cache", default=os.path.join(ROOT, "bench", ".cache", "long_run"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", name))
    ap.add_argument("--machine", default="2-core AMD EPYC, shared with other work")
    ap.add_argument("--notes", default="")


def run_context(machine) -> dict:
    """The machine, commit and versions a result file names."""
    import platform
    import subprocess

    import jax
    import optax
    import torch
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    return {"machine": f"{machine} ({platform.processor() or platform.machine()})", "commit": commit,
            "versions": {"torch": torch.__version__, "jax": jax.__version__, "optax": optax.__version__}}


def write_markdown(path, lines, notes):
    with open(path, "w") as fh:
        fh.write("\n".join(lines + ["", notes or ""]).rstrip() + "\n")
