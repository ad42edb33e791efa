"""How long a checkpoint blocks a real training loop: plain async saves vs guarded ones.

JAX: an optax Adam MLP (jitted step, donated state) saved every N steps through orbax's
CheckpointManager(enable_async_checkpointing=True), with the optimizer state as
``StandardSave`` (plain) or ``jaxguard.checkpoint.GuardedSave`` (guarded); plus the guarded
save with async checkpointing off, i.e. the whole encode in the step.
torch: an MLP trained with torch.optim.Adam(foreach=False), saved every N steps with
``torch.distributed.checkpoint.async_save`` (one process, ``no_dist=True``), default
planner (plain) or ``GuardedSavePlanner`` (guarded); a save first waits for the previous one,
as a loop must.

Lightning: `ModelCheckpoint` with Lightning's `AsyncCheckpointIO` around its `TorchCheckpointIO`
(plain) or `GuardedCheckpointIO` (guarded), and the guarded plugin blocking.  HF: the
plain `Trainer` and `GuardedTrainer`, both blocking (transformers has no async save).
Per mode: steps/s over the loop (the final wait included), and per save the time the save
call blocked the loop (median, max).  A first, unreported pass of the guarded blocking
loop compiles the guard's programs (their shapes depend on the data; every pass replays the
same deterministic trajectory), so compile time is not counted.  Writes bench/results/train_loop_save.{json,md,png}.

    python bench/train_loop_save.py [--hidden 1536] [--layers 5] [--steps 150] [--every 50]
                                    [--torch-steps 40] [--torch-every 20]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
FRAMEWORKS = ("jax", "torch", "lightning", "hf")


FAULTED = 1000   # minor page faults of a save call that mark it as staging into fresh memory


def _thread_faults() -> int:
    """Minor page faults of the calling thread so far (of the process where Linux's
    per-thread count is missing)."""
    import resource
    return resource.getrusage(getattr(resource, "RUSAGE_THREAD", resource.RUSAGE_SELF)).ru_minflt


def _stats(name, n_params, steps, wall, blocks, waits, faults=None):
    """blocks: the save calls' times; waits: the waits for the previous save before each;
    faults: the minor page faults of each save call (the calling thread's own)."""
    med = lambda xs: statistics.median(xs) if xs else 0.0   # noqa: E731
    out = {"mode": name, "params": n_params, "steps": steps, "wall_s": wall, "steps_per_s": steps / wall,
           "saves": len(blocks), "block_s": blocks, "wait_s": waits, "block_median_s": med(blocks),
           "block_max_s": max(blocks) if blocks else 0.0, "wait_median_s": med(waits),
           "wait_max_s": max(waits) if waits else 0.0}
    if faults is not None:
        resident = [b for b, f in zip(blocks, faults) if f < FAULTED]
        out.update(block_faults=faults, faulted_saves=len(blocks) - len(resident),
                   block_median_resident_s=med(resident))
    return out


def jax_bench(hidden, layers, steps, every, batch, root):
    import jax
    import jax.numpy as jnp
    import optax
    import orbax.checkpoint as ocp
    import jaxguard.checkpoint as jgc

    key = jax.random.PRNGKey(0)
    params = {}
    for i in range(layers):
        key, k = jax.random.split(key)
        params[f"l{i}"] = {"w": jax.random.normal(k, (hidden, hidden), jnp.float32) / hidden ** 0.5,
                           "b": jnp.zeros(hidden, jnp.float32)}
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(params))
    tx = optax.adam(1e-3)

    def loss(p, x):
        h = x
        for i in range(layers):
            h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        return jnp.mean((h - jnp.roll(x, 1, axis=1)) ** 2)

    def train_step(p, s, x):
        g = jax.grad(loss)(p, x)
        g = jax.tree_util.tree_map(lambda a: jnp.clip(a, -0.2, 0.2), g)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    train_step = jax.jit(train_step, donate_argnums=(0, 1))

    def batch_of(i):
        return jax.random.normal(jax.random.PRNGKey(1000 + i), (batch, hidden), jnp.float32)

    def fresh():
        p = jax.tree_util.tree_map(jnp.copy, params)
        s = tx.init(p)
        for i in range(3):
            p, s = train_step(p, s, batch_of(i))
        jax.block_until_ready((p, s))
        return p, s

    def args(p, s, guarded):
        opt = jgc.GuardedSave(s, params=p, lr=1e-3) if guarded else ocp.args.StandardSave(s)
        return ocp.args.Composite(params=ocp.args.StandardSave(p), opt_state=opt)

    p, s = fresh()    # warm-up: the step, orbax, the guard's programs at these shapes
    for guarded in (True, False):
        with ocp.CheckpointManager(os.path.join(root, f"warm{int(guarded)}"), options=ocp.CheckpointManagerOptions(
                enable_async_checkpointing=True)) as m:
            for k in range(2):
                m.save(k, args=args(p, s, guarded))
                m.wait_until_finished()
    out = []
    # the first pass compiles the guard's data-dependent programs (every mode replays the same
    # deterministic trajectory, so later passes meet the same shapes); it is not reported
    for mode, guarded, use_async in (("warm-up", True, False), ("none", None, None), ("orbax async, plain", False, True),
                                     ("orbax async, guarded", True, True),
                                     ("orbax blocking, guarded", True, False)):
        p, s = fresh()
        d = os.path.join(root, mode.replace(" ", "_").replace(",", ""))
        mngr = None if guarded is None else ocp.CheckpointManager(
            d, options=ocp.CheckpointManagerOptions(enable_async_checkpointing=use_async, max_to_keep=2))
        blocks, waits = [], []
        t0 = time.perf_counter()
        for i in range(steps):
            p, s = train_step(p, s, batch_of(i))
            if mngr is not None and (i + 1) % every == 0:
                jax.block_until_ready((p, s))
                t = time.perf_counter()
                mngr.wait_until_finished()        # what mngr.save would wait for first
                t1 = time.perf_counter()
                mngr.save(i + 1, args=args(p, s, guarded))
                waits.append(t1 - t)
                blocks.append(time.perf_counter() - t1)
        jax.block_until_ready((p, s))
        if mngr is not None:
            mngr.wait_until_finished()
            mngr.close()
        out.append(_stats(mode, n_params, steps, time.perf_counter() - t0, blocks, waits))
        print(json.dumps({k: v for k, v in out[-1].items() if k not in ("block_s", "wait_s")}), flush=True)
        shutil.rmtree(d, ignore_errors=True)
    out = [r for r in out if r["mode"] != "warm-up"]
    return out


def torch_bench(hidden, layers, steps, every, batch, root):
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch_compat.dcp import GuardedSavePlanner

    def build():
        model = _mlp(hidden, layers)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False, fused=False)

    def step(model, opt, i):
        x = torch.randn(batch, hidden, generator=torch.Generator().manual_seed(1000 + i))
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(model(x), torch.roll(x, 1, 1)).backward()
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.2)
        opt.step()

    def state(model, opt):
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    model, opt = build()
    for i in range(3):
        step(model, opt, i)
    n_params = sum(p.numel() for p in model.parameters())
    dcp.save(state(model, opt), checkpoint_id=os.path.join(root, "twarm"), planner=GuardedSavePlanner(), no_dist=True)
    out = []
    for mode, guarded in (("warm-up", True), ("none", None), ("dcp async_save, plain", False),
                          ("dcp async_save, guarded", True), ("dcp save (blocking), guarded", "blocking")):
        model, opt = build()
        blocks, waits, faults, fut = [], [], [], None
        t0 = time.perf_counter()
        for i in range(steps):
            step(model, opt, i)
            if guarded is not None and (i + 1) % every == 0:
                t = time.perf_counter()
                if fut is not None:
                    fut.result()
                f0 = _thread_faults()
                t1 = time.perf_counter()
                planner = GuardedSavePlanner() if guarded else None
                if guarded == "blocking" or mode == "warm-up":
                    dcp.save(state(model, opt), checkpoint_id=os.path.join(root, f"t{i + 1}"), planner=planner,
                             no_dist=True)
                else:
                    fut = dcp.async_save(state(model, opt), checkpoint_id=os.path.join(root, f"t{i + 1}"),
                                         planner=planner, no_dist=True)
                waits.append(t1 - t)
                blocks.append(time.perf_counter() - t1)
                faults.append(_thread_faults() - f0)
        if fut is not None:
            fut.result()
        out.append(_stats(mode, n_params, steps, time.perf_counter() - t0, blocks, waits, faults))
        print(json.dumps({k: v for k, v in out[-1].items() if k not in ("block_s", "wait_s")}), flush=True)
        for n in os.listdir(root):
            if n.startswith("t") and n != "twarm":
                shutil.rmtree(os.path.join(root, n), ignore_errors=True)
    return [r for r in out if r["mode"] != "warm-up"]


def _timed_calls(obj, name):
    """Wrap ``obj.name`` so each call's wall time is appended to the returned list."""
    times, real = [], getattr(obj, name)

    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            times.append(time.perf_counter() - t)
    setattr(obj, name, timed)
    return times


def _mlp(hidden, layers):
    """The torch MLP every torch-side mode trains: `layers` Linear(hidden, hidden) + Tanh, seed 0."""
    import torch
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods)


def lightning_bench(hidden, layers, steps, every, batch, root):
    """Lightning: ``ModelCheckpoint(every_n_train_steps=every)`` with Lightning's own
    ``AsyncCheckpointIO`` around ``TorchCheckpointIO`` (plain) or `GuardedCheckpointIO`
    (guarded), and the guarded plugin alone (blocking).  A save blocks the loop for
    ``trainer.save_checkpoint`` (state dicts gathered, tensors cloned, the write queued)."""
    import logging
    import warnings
    import lightning as L
    import torch
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from jaxguard.integrations.lightning import GuardedCheckpointIO
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class MLP(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp(hidden, layers)

        def training_step(self, b, i):
            (x,) = b
            return torch.nn.functional.mse_loss(self.net(x), torch.roll(x, 1, 1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.named_parameters(), lr=1e-3, foreach=False, fused=False)

    x = torch.randn(steps * batch, hidden, generator=torch.Generator().manual_seed(7))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), batch_size=batch)
    n_params = sum(p.numel() for p in MLP().parameters())
    out = []
    for mode, plugin in (("warm-up", lambda: GuardedCheckpointIO(tau=0.01, clip=0.2)), ("none", None),
                         ("lightning async, plain", lambda: AsyncCheckpointIO(TorchCheckpointIO())),
                         ("lightning async, guarded", lambda: AsyncCheckpointIO(GuardedCheckpointIO(tau=0.01, clip=0.2))),
                         ("lightning blocking, guarded", lambda: GuardedCheckpointIO(tau=0.01, clip=0.2))):
        d = os.path.join(root, "pl_" + mode.replace(" ", "_").replace(",", ""))
        cbs = [] if plugin is None else [L.pytorch.callbacks.ModelCheckpoint(dirpath=d, every_n_train_steps=every,
                                                                             save_top_k=-1)]
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, gradient_clip_val=0.2, callbacks=cbs,
                            plugins=[] if plugin is None else [plugin()], enable_checkpointing=plugin is not None)
        blocks = _timed_calls(trainer, "save_checkpoint")
        t0 = time.perf_counter()
        trainer.fit(MLP(), data)    # fit's teardown waits for the last async save
        out.append(_stats(mode, n_params, steps, time.perf_counter() - t0, blocks, []))
        print(json.dumps({k: v for k, v in out[-1].items() if k not in ("block_s", "wait_s")}), flush=True)
        shutil.rmtree(d, ignore_errors=True)
    return [r for r in out if r["mode"] != "warm-up"]


def hf_bench(hidden, layers, steps, every, batch, root):
    """transformers.Trainer (plain) and `GuardedTrainer` (guarded), ``save_steps=every``.
    The Trainer has no asynchronous checkpoint mode, so the plain save blocks; `GuardedTrainer`
    saves blocking, and with ``jaxguard_async=True`` (the encode on a background thread from a
    host copy).  A save blocks the loop for ``Trainer._save_checkpoint`` (model, optimizer,
    scheduler, RNG, state; with async, the wait for the previous save included)."""
    import logging
    import warnings
    import torch
    import transformers
    from jaxguard.integrations.hf import GuardedTrainer
    transformers.logging.set_verbosity_error()
    logging.getLogger("jaxguard").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    class MLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _mlp(hidden, layers)

        def forward(self, x, labels=None):
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    x = torch.randn(steps * batch, hidden, generator=torch.Generator().manual_seed(7))
    ds = [{"x": r, "labels": torch.roll(r, 1, 0)} for r in x]
    n_params = sum(p.numel() for p in MLP().parameters())
    out = []
    for mode, cls, save in (("warm-up", GuardedTrainer, True), ("none", transformers.Trainer, False),
                            ("hf Trainer (blocking), plain", transformers.Trainer, True),
                            ("hf GuardedTrainer async, guarded", GuardedTrainer, "async"),
                            ("hf GuardedTrainer (blocking), guarded", GuardedTrainer, True)):
        d = os.path.join(root, "hf_" + "".join(c if c.isalnum() else "_" for c in mode))
        targs = transformers.TrainingArguments(
            output_dir=d, max_steps=steps, per_device_train_batch_size=batch, learning_rate=1e-3,
            lr_scheduler_type="constant", max_grad_norm=0.2, save_strategy="steps" if save else "no", save_steps=every,
            report_to=[], logging_strategy="no", use_cpu=True, disable_tqdm=True, optim="adamw_torch",
            dataloader_num_workers=0)
        kw = {"jaxguard_tau": 0.01, "jaxguard_clip": 0.2, "jaxguard_async": save == "async"} if cls is GuardedTrainer else {}
        trainer = cls(model=MLP(), args=targs, train_dataset=ds,
                      data_collator=lambda rows: {"x": torch.stack([r["x"] for r in rows]),
                                                  "labels": torch.stack([r["labels"] for r in rows])}, **kw)
        blocks = _timed_calls(trainer, "_save_checkpoint")
        t0 = time.perf_counter()
        trainer.train()
        out.append(_stats(mode, n_params, steps, time.perf_counter() - t0, blocks, []))
        print(json.dumps({k: v for k, v in out[-1].items() if k not in ("block_s", "wait_s")}), flush=True)
        shutil.rmtree(d, ignore_errors=True)
    return [r for r in out if r["mode"] != "warm-up"]


def _ratio(rows, plain, guarded):
    by = {r["mode"]: r for r in rows}
    return by[guarded]["block_median_s"] / by[plain]["block_median_s"]


def write(res, name="train_loop_save"):
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, name + ".json"), "w") as fh:
        json.dump(res, fh, indent=1)
    c = res["config"]
    lines = ["# Training-loop saves: how long a checkpoint blocks the step", "",
             f"Machine: {res['machine']}."
             + (" **Shared with other work while this ran**, so the speed figures are not quiet-machine figures; "
                "the background encode competes with the training step for the same 2 cores."
                if "shared" in res["machine"].lower() else " The background encode shares the cores with the "
                "training step."), "",
             f"`python bench/train_loop_save.py --hidden {c['hidden']} --layers {c['layers']} --steps {c['steps']} "
             f"--every {c['every']} --torch-steps {c['torch_steps']} --torch-every {c['torch_every']} "
             f"--batch {c['batch']}`: an MLP of {c['layers']} {c['hidden']}x{c['hidden']} "
             f"layers ({next(res[f] for f in FRAMEWORKS if res.get(f))[0]['params'] / 1e6:.1f}M parameters, Adam/AdamW), the same "
             "in JAX/optax, torch, Lightning and the HF Trainer (the last two use --torch-steps/--torch-every); "
             "wall time includes waiting for the last save. A save blocks the loop for its call plus, when the "
             "previous save is still running, the wait for it (orbax's `mngr.save` and a DCP loop wait first); "
             "the two are timed apart.", "",
             "| framework | mode | steps | save every | steps/s | saves | save call blocks, median / max | "
             "waiting for the previous save, median / max |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for fw in FRAMEWORKS:
        for r in res.get(fw) or []:
            lines.append(f"| {fw} | {r['mode']} | {r['steps']} | {c['every' if fw == 'jax' else 'torch_every']} | "
                         f"{r['steps_per_s']:.2f} | {r['saves']} | "
                         f"{r['block_median_s'] * 1e3:.0f} / {r['block_max_s'] * 1e3:.0f} ms | "
                         f"{r['wait_median_s'] * 1e3:.0f} / {r['wait_max_s'] * 1e3:.0f} ms |")
    ratios = ", ".join(f"{k} **{res[f'ratio_{k.lower()}']:.2f}x**" for k in ("orbax", "DCP", "Lightning")
                       if res.get(f"ratio_{k.lower()}") is not None)
    lines += ["", f"Save-call ratio guarded / plain (median per save): {ratios} (target <= 1.2x); the waits "
              "for the previous save are in the last column."]
    faulted = [(fw, r) for fw in FRAMEWORKS for r in res.get(fw) or [] if r.get("block_faults") is not None
               and r["saves"]]
    if faulted:
        lines += ["", f"Page faults of the save call (the loop thread's own; {FAULTED} or more: the staged copy went "
                  "to fresh memory, which glibc's heap hands out or not depending on what the process freed "
                  "before):", "",
                  "| framework | mode | calls that faulted | median of the others | faults per call |",
                  "|---|---|---:|---:|---|"]
        lines += [f"| {fw} | {r['mode']} | {r['faulted_saves']} of {r['saves']} | "
                  f"{r['block_median_resident_s'] * 1e3:.0f} ms | {', '.join(map(str, r['block_faults']))} |"
                  for fw, r in faulted]
    if res.get("ratio_hf") is not None:
        lines += ["", "HF Trainer: transformers has no asynchronous checkpoint mode, so the plain `Trainer` saves "
                  "blocking; per save, `GuardedTrainer(jaxguard_async=True)` / plain blocking save: "
                  f"**{res['ratio_hf']:.2f}x**; the blocking `GuardedTrainer` / plain: {res['ratio_hf_blocking']:.2f}x."]
    lines += ["", res.get("notes", "")]
    with open(os.path.join(RESULTS, name + ".md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fws = [fw for fw in FRAMEWORKS if res.get(fw)]
        fig, axes = plt.subplots(1, len(fws), figsize=(5 * len(fws), 3.6), squeeze=False)
        for ax, fw in zip(axes[0], fws):
            rows = [r for r in res[fw] if r["saves"]]
            if not rows:
                ax.axis("off")
                continue
            names = [r["mode"].replace(", ", "\n") for r in rows]
            calls = [r["block_median_s"] * 1e3 for r in rows]
            ax.bar(names, calls, label="save call")
            ax.bar(names, [r["wait_median_s"] * 1e3 for r in rows], bottom=calls, label="waiting for the previous save")
            ax.set_ylabel("blocked per save, median (ms)")
            ax.legend(fontsize=7)
            ax.set_title(f"{fw}: {res[fw][0]['params'] / 1e6:.1f}M params (2-core EPYC, shared)")
            ax.tick_params(axis="x", labelsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(RESULTS, name + ".png"), dpi=110)
    except ImportError:
        pass


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--torch-steps", type=int, default=40)
    ap.add_argument("--torch-every", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--notes", default="", help="a paragraph for the .md")
    ap.add_argument("--machine", default="2-core AMD EPYC (AVX-512), shared with other work")
    ap.add_argument("--only", choices=list(FRAMEWORKS))
    ap.add_argument("--replot", metavar="NAME", help="rewrite bench/results/NAME.{md,png} from NAME.json")
    ap.add_argument("--name", default=None, help="results file stem (default: train_loop_save, or "
                                                 "train_loop_save_FRAMEWORK_everyN with --only)")
    a = ap.parse_args(argv)
    if a.replot:
        with open(os.path.join(RESULTS, a.replot + ".json")) as fh:
            return write(json.load(fh), a.replot)
    root = tempfile.mkdtemp(prefix="jg_trainloop_")
    try:
        res = {"config": {k: getattr(a, k) for k in ("hidden", "layers", "steps", "every", "torch_steps",
                                                      "torch_every", "batch")},
               "machine": f"{a.machine}; {os.cpu_count()} CPUs visible, {platform.processor() or platform.machine()}",
               "notes": a.notes}
        res["jax"] = jax_bench(a.hidden, a.layers, a.steps, a.every, a.batch, root) if a.only in (None, "jax") else []
        run = lambda fw: a.only in (None, fw)    # noqa: E731
        res["torch"] = torch_bench(a.hidden, a.layers, a.torch_steps, a.torch_every, a.batch, root) if run("torch") else []
        res["lightning"] = (lightning_bench(a.hidden, a.layers, a.torch_steps, a.torch_every, a.batch, root)
                            if run("lightning") else [])
        res["hf"] = hf_bench(a.hidden, a.layers, a.torch_steps, a.torch_every, a.batch, root) if run("hf") else []
        if res["jax"]:
            res["ratio_orbax"] = _ratio(res["jax"], "orbax async, plain", "orbax async, guarded")
        if res["torch"]:
            res["ratio_dcp"] = _ratio(res["torch"], "dcp async_save, plain", "dcp async_save, guarded")
        if res["lightning"]:
            res["ratio_lightning"] = _ratio(res["lightning"], "lightning async, plain", "lightning async, guarded")
        if res["hf"]:
            res["ratio_hf"] = _ratio(res["hf"], "hf Trainer (blocking), plain", "hf GuardedTrainer async, guarded")
            res["ratio_hf_blocking"] = _ratio(res["hf"], "hf Trainer (blocking), plain",
                                              "hf GuardedTrainer (blocking), guarded")
        write(res, a.name or ("train_loop_save" if a.only is None else
              f"train_loop_save_{a.only}_every{a.every if a.only == 'jax' else a.torch_every}"))
        print(json.dumps({k: res.get(k) for k in ("ratio_orbax", "ratio_dcp", "ratio_lightning", "ratio_hf",
                                                  "ratio_hf_blocking")}))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
