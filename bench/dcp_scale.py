"""Guarded optimizer state in torch.distributed.checkpoint at scale: FSDP2, 4 ranks, resharding.

    python bench/dcp_scale.py [--steps 100] [--width 2048] [--repeats 2] [--out bench/results/dcp_scale]

An MLP of >= 5M parameters (in 256 -> width -> width -> 256, tanh) learns a fixed random
teacher MLP with FSDP2 (`fully_shard` per Linear and the root, gloo on localhost, CPU,
`init_device_mesh("cpu", (4,))`) for --steps steps of Adam and of AdamW (wd 0.1), both
``foreach=False, fused=False``. Then, at world size 4: a plain DCP save and a guarded save
(`GuardedSavePlanner(tau=0.01, clip=0.2)`), each --repeats times (the first guarded save
also compiles the XLA kernels unless the persistent cache has them; every run is
reported, the table shows the last). The checkpoints are then loaded at world size 4, 2
and into one plain (non-distributed) process, plain and guarded side by side, and the first
update after resume is compared with the real optimizer step: on a gradient grid over
[-C, C] (every coordinate sees the same g; 25 values) and on the real next batch (the
gradient clamped to [-C, C], the range the guarantee covers; how many were clamped is
reported). Per case: coordinates over tau*lr, worst gap, optimizer bytes on disk
(exp_avg/exp_avg_sq items, guarded shards) vs the plain save, save/load wall time (the
slowest rank), per-rank peak RSS (ru_maxrss) after each phase.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

HERE = os.path.dirname(os.path.abspath(__file__))
IN, OUT = 256, 256
LR, TAU, CLIP, WD = 1e-3, 0.01, 0.2, 0.1
BATCH = 64   # global batch; each rank takes BATCH / world rows


def _rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def build(width, opt_name, mesh=None, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                                torch.nn.Tanh(), torch.nn.Linear(width, OUT))
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    cls = torch.optim.AdamW if opt_name == "adamw" else torch.optim.Adam
    kw = {"weight_decay": WD} if opt_name == "adamw" else {}
    return model, cls(model.parameters(), lr=LR, foreach=False, fused=False, **kw)


def teacher():
    g = torch.Generator().manual_seed(99)
    return [torch.randn(IN, 512, generator=g) / IN ** 0.5, torch.randn(512, OUT, generator=g) / 512 ** 0.5]


def batch(step, rank, world):
    g = torch.Generator().manual_seed(10_000 + step)
    x = torch.randn(BATCH, IN, generator=g)
    w1, w2 = teacher()
    y = torch.tanh(x @ w1) @ w2
    n = BATCH // world
    return x[n * rank:n * (rank + 1)], y[n * rank:n * (rank + 1)]


def loss_fn(model, step, rank, world):
    x, y = batch(step, rank, world)
    return torch.nn.functional.mse_loss(model(x), y)


def _barrier():
    import torch.distributed as dist
    if dist.is_initialized():
        dist.barrier()


def _timed(fn):
    _barrier()
    t = time.perf_counter()
    fn()
    _barrier()
    return time.perf_counter() - t


def _load(path, width, opt_name, mesh, planner):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    model, opt = build(width, opt_name, mesh, seed=321)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    sec = _timed(lambda: dcp.load(state, checkpoint_id=path, planner=planner))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return (model, opt), sec


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def worker(rank, world, port, root, opt_names, width, steps, repeats, phase):
    """One rank: for every optimizer, train and save (phase "train"), then load and audit."""
    import jax
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~/.cache"), "jaxguard", "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    torch.set_num_threads(1)
    import torch.distributed as dist

    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
        mesh = init_device_mesh("cpu", (world,))
    for opt_name in opt_names:
        _case(rank, world, os.path.join(root, opt_name), opt_name, width, steps, repeats, phase, mesh)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _case(rank, world, root, opt_name, width, steps, repeats, phase, mesh):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from torch_compat.dcp import GuardedLoadPlanner, GuardedSavePlanner, first_update_audit
    from jaxguard.audit import gradient_grid
    res = {"rank": rank, "world": world, "rss_mb": {"start": _rss_mb()}}
    if phase == "train":
        model, opt = build(width, opt_name, mesh)
        t = time.perf_counter()
        losses = []
        for s in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(model, s, rank, world)
            loss.backward()
            opt.step()
            if s in (0, steps - 1):
                losses.append(float(loss.detach()))
        res["train_seconds"] = time.perf_counter() - t
        res["loss_first_last"] = losses
        res["parameters"] = sum(p.numel() for p in model.parameters())
        res["rss_mb"]["trained"] = _rss_mb()
        msd, osd = get_state_dict(model, opt)
        res["save_plain_s"], res["save_guarded_s"] = [], []
        for r in range(repeats):
            d = f"{root}/plain" if r == repeats - 1 else f"{root}/scratch_plain{r}"
            res["save_plain_s"].append(_timed(lambda: dcp.save({"model": msd, "optim": osd}, checkpoint_id=d)))
        res["rss_mb"]["plain_saved"] = _rss_mb()
        for r in range(repeats):
            d = f"{root}/guarded" if r == repeats - 1 else f"{root}/scratch_guarded{r}"
            res["save_guarded_s"].append(_timed(lambda: dcp.save(
                {"model": msd, "optim": osd}, checkpoint_id=d, planner=GuardedSavePlanner(tau=TAU, clip=CLIP))))
        res["rss_mb"]["guarded_saved"] = _rss_mb()
        del model, opt, msd, osd
    plain, res["load_plain_s"] = _load(f"{root}/plain", width, opt_name, mesh, None)
    res["rss_mb"]["plain_loaded"] = _rss_mb()
    guarded, res["load_guarded_s"] = _load(f"{root}/guarded", width, opt_name, mesh, GuardedLoadPlanner(f"{root}/guarded"))
    res["rss_mb"]["guarded_loaded"] = _rss_mb()
    res["weights_bit_identical"] = all(torch.equal(_local(a), _local(b)) for a, b in
                                       zip(plain[0].parameters(), guarded[0].parameters()))
    res["steps_identical"] = all(torch.equal(plain[1].state[a]["step"], guarded[1].state[b]["step"]) for a, b in
                                 zip(plain[0].parameters(), guarded[0].parameters()))
    loss_fn(plain[0], steps, rank, world).backward()
    grads = [p.grad.detach().clone() for p in plain[0].parameters()]
    plain[1].zero_grad(set_to_none=True)
    t = time.perf_counter()
    res["audit_grid"] = first_update_audit(plain, guarded, tau=TAU, clip=CLIP,
                                           grid=gradient_grid(CLIP, n_linear=4, n_log=8))
    res["audit_real"] = first_update_audit(plain, guarded, tau=TAU, clip=CLIP, grid=[], grads=[grads])
    res["audit_seconds"] = time.perf_counter() - t
    res["rss_mb"]["audited"] = _rss_mb()
    with open(os.path.join(root, f"{phase}_w{world}_r{rank}.json"), "w") as fh:
        json.dump(res, fh)
    del plain, guarded


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(world, *args):
    mp.start_processes(worker, args=(world, _free_port(), *args), nprocs=world, start_method="spawn", join=True)


def _optimizer_bytes(path):
    """Bytes of the moments on disk: exp_avg/exp_avg_sq items (plain) or guarded shards."""
    from torch_compat.dcp import SHARD_PREFIX, read_metadata
    md, _ = read_metadata(path)
    total = 0
    for idx, info in md.storage_data.items():
        if idx.fqn.startswith(SHARD_PREFIX) or idx.fqn.endswith((".exp_avg", ".exp_avg_sq")):
            total += info.length
    return total


def _dir_bytes(path):
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def run_cases(opt_names, a, tmp):
    for o in opt_names:
        os.makedirs(os.path.join(tmp, o))
    walls = {}
    for world, phase in ((4, "train"), (2, "load"), (1, "load")):   # world 1: a plain process, no dist
        t = time.perf_counter()
        _spawn(world, tmp, opt_names, a.width, a.steps, a.repeats, phase)
        walls[f"world{world}_{phase}"] = time.perf_counter() - t
    return [dict(summarize(o, a, os.path.join(tmp, o)), phase_wall_seconds=walls) for o in opt_names]


def summarize(opt_name, a, root):
    from torch_compat.dcp import inspect_dir
    ranks = {}
    for f in sorted(os.listdir(root)):
        if f.endswith(".json"):
            r = json.load(open(os.path.join(root, f)))
            ranks.setdefault(r["world"], []).append(r)
    info = inspect_dir(f"{root}/guarded")
    train = ranks[4]
    case = {"optimizer": opt_name, "parameters": train[0]["parameters"], "steps": a.steps,
            "loss_first_last": train[0]["loss_first_last"], "train_seconds": max(r["train_seconds"] for r in train),
            "save_world": 4,
            "save_plain_s_runs": [max(r["save_plain_s"][i] for r in train) for i in range(a.repeats)],
            "save_guarded_s_runs": [max(r["save_guarded_s"][i] for r in train) for i in range(a.repeats)],
            "optimizer_bytes_plain": _optimizer_bytes(f"{root}/plain"),
            "optimizer_bytes_guarded": _optimizer_bytes(f"{root}/guarded"),
            "dir_bytes_plain": _dir_bytes(f"{root}/plain"), "dir_bytes_guarded": _dir_bytes(f"{root}/guarded"),
            "escapes": info["escapes"], "coordinates": info["coordinates"], "payload_ratio": info["payload_ratio"],
            "loads": {}}
    case["optimizer_bytes_ratio"] = case["optimizer_bytes_guarded"] / case["optimizer_bytes_plain"]
    for world in (4, 2, 1):
        rs = ranks[world]
        case["loads"][str(world)] = {
            "load_plain_s": max(r["load_plain_s"] for r in rs), "load_guarded_s": max(r["load_guarded_s"] for r in rs),
            "weights_bit_identical": all(r["weights_bit_identical"] and r["steps_identical"] for r in rs),
            "coordinates": sum(r["audit_grid"]["coordinates"] for r in rs),
            "grid_gradients": rs[0]["audit_grid"]["gradients"],
            "grid_violations": sum(r["audit_grid"]["violations"] for r in rs),
            "grid_max_gap_lr": max(r["audit_grid"]["max_gap_lr"] for r in rs),
            "real_violations": sum(r["audit_real"]["violations"] for r in rs),
            "real_max_gap_lr": max(r["audit_real"]["max_gap_lr"] for r in rs),
            "clamped_real_grad": sum(r["audit_real"]["clamped"] for r in rs),
            "peak_rss_mb_per_rank": [round(max(r["rss_mb"].values()), 1) for r in sorted(rs, key=lambda r: r["rank"])],
            "rss_mb_per_rank": [r["rss_mb"] for r in sorted(rs, key=lambda r: r["rank"])]}
    return case


def _git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True, text=True).stdout.strip()
    except OSError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--optimizers", default="adam,adamw")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "dcp_scale"))
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="dcp_scale.")
    try:
        cases = run_cases(a.optimizers.split(","), a, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = {"bench": "dcp_scale", "machine": {"platform": platform.platform(), "processor": platform.processor(),
                                             "cpus": os.cpu_count(), "load_avg_at_end": os.getloadavg()},
           "torch": torch.__version__, "commit": _git_commit(), "seed": 0, "tau": TAU, "clip": CLIP, "lr": LR,
           "weight_decay_adamw": WD, "width": a.width, "repeats": a.repeats, "cases": cases,
           "total_seconds": time.perf_counter() - t0}
    with open(a.out + ".json", "w") as fh:
        json.dump(out, fh, indent=1)
    with open(a.out + ".md", "w") as fh:
        fh.write(markdown(out))
    print(markdown(out))


def markdown(out):
    lines = [f"# Guarded DCP at scale (FSDP2, gloo, CPU): save at 4 ranks, load at 4, 2, 1\n",
             f"Machine: {out['machine']['platform']}, {out['machine']['cpus']} cores shared with other jobs "
             f"(load average at the end {', '.join(f'{x:.1f}' for x in out['machine']['load_avg_at_end'])}): "
             "timings are contended. tau 0.01, C 0.2, lr 1e-3; the slowest rank's wall time; "
             f"save times: the last of {out['repeats']} runs (all runs in the JSON). Total {out['total_seconds']:.0f} s.\n"]
    for c in out["cases"]:
        lines.append(f"## {c['optimizer']}: {c['parameters']:,} parameters, {c['steps']} steps "
                     f"(loss {c['loss_first_last'][0]:.4f} -> {c['loss_first_last'][1]:.4f})\n")
        lines.append(f"Optimizer bytes on disk: guarded {c['optimizer_bytes_guarded']:,} vs plain "
                     f"{c['optimizer_bytes_plain']:,} = **{100 * c['optimizer_bytes_ratio']:.1f}%** (target <= 30%); "
                     f"whole directory {c['dir_bytes_guarded']:,} vs {c['dir_bytes_plain']:,}. Escapes "
                     f"{c['escapes']:,} of {c['coordinates']:,}. Save at 4 ranks: plain "
                     f"{c['save_plain_s_runs'][-1]:.2f} s, guarded {c['save_guarded_s_runs'][-1]:.2f} s "
                     f"(runs: {', '.join(f'{x:.2f}' for x in c['save_guarded_s_runs'])}).\n")
        lines.append("| load at | coords | grid: g values / over tau*lr / worst gap (lr) | real next batch: over "
                     "tau*lr / worst gap (lr) / g clamped | weights identical | load plain s | load guarded s "
                     "| peak RSS MB per rank |")
        lines.append("|---:|---:|---|---|:---:|---:|---:|---|")
        for w, L in c["loads"].items():
            lines.append(f"| {w} | {L['coordinates']:,} | {L['grid_gradients']} / {L['grid_violations']} / "
                         f"{L['grid_max_gap_lr']:.4f} | {L['real_violations']} / {L['real_max_gap_lr']:.4f} / "
                         f"{L['clamped_real_grad']:,} | {'yes' if L['weights_bit_identical'] else 'NO'} "
                         f"| {L['load_plain_s']:.2f} | {L['load_guarded_s']:.2f} "
                         f"| {', '.join(f'{x:.0f}' for x in L['peak_rss_mb_per_rank'])} |")
        lines.append("")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    main()
