"""The rank side of tests/torch_compat/test_dcp.py: FSDP2 on gloo (CPU), spawned by torch.multiprocessing.

Each rank writes ``rank{r}.json`` with what it measured; the test asserts on those.
"""
import json
import os
import shutil
import socket

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

IN, HID, OUT = 24, 41, 6          # 41 rows: an uneven FSDP2 split (21 + 20)
LR, TAU, CLIP = 1e-3, 0.01, 0.2
STEPS = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(mesh=None, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))
    if mesh is not None:
        from torch.distributed.fsdp import fully_shard
        for m in model:
            if isinstance(m, torch.nn.Linear):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=LR, foreach=False, fused=False)
    return model, opt


def batch(step, rank, world):
    """The global batch of a step, and this rank's part of it."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8 * world, IN, generator=g)
    y = torch.randn(8 * world, OUT, generator=g)
    return x[8 * rank:8 * (rank + 1)], y[8 * rank:8 * (rank + 1)]


def train_step(model, opt, step, rank, world):
    x, y = batch(step, rank, world)
    opt.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def next_grads(model, rank, world):
    x, y = batch(STEPS, rank, world)
    for p in model.parameters():
        p.grad = None
    torch.nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return grads


def load_into(path, mesh, planner):
    model, opt = build(mesh, seed=123)          # different init: the load must overwrite everything
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path, planner=planner)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt


def local_state(model, opt):
    out = []
    for p in model.parameters():
        st = opt.state[p]
        out.append([p.to_local().detach().clone()] + [st[k].to_local().detach().clone() if hasattr(st[k], "to_local")
                                                      else st[k].detach().clone() for k in ("exp_avg", "exp_avg_sq", "step")])
    return out


def same(a, b):
    return all(torch.equal(x, y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def run(rank, world, port, root):
    import jax
    jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~/.cache"), "jaxguard", "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.checkpoint.api import CheckpointException

    from jaxguard.errors import CheckpointError
    from torch_compat.dcp import GuardedLoadPlanner, GuardedSavePlanner, first_update_audit

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    mesh = init_device_mesh("cpu", (world,))
    res = {}
    model, opt = build(mesh)
    for s in range(STEPS):
        train_step(model, opt, s, rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/plain")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/guarded", planner=GuardedSavePlanner(tau=TAU, clip=CLIP))
    fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/async",
                         planner=GuardedSavePlanner(tau=TAU, clip=CLIP))
    fut.result()
    original = local_state(model, opt)

    # same-size resume: plain and guarded, audited with the real FSDP2 Adam step
    plain = load_into(f"{root}/plain", mesh, None)
    guarded = load_into(f"{root}/guarded", mesh, GuardedLoadPlanner(f"{root}/guarded"))
    asynced = load_into(f"{root}/async", mesh, GuardedLoadPlanner(f"{root}/async"))
    ps, gs, As = local_state(*plain), local_state(*guarded), local_state(*asynced)
    res["plain_equals_original"] = same(ps, original)
    res["weights_bit_identical"] = all(torch.equal(a[0], b[0]) for a, b in zip(ps, gs))
    res["steps_identical"] = all(torch.equal(a[3], b[3]) for a, b in zip(ps, gs))
    res["async_equals_sync"] = same(gs, As)
    res["moments_changed"] = sum(int((a[1] != b[1]).sum() + (a[2] != b[2]).sum()) for a, b in zip(ps, gs))
    res["lr_betas"] = [guarded[1].param_groups[0]["lr"], list(guarded[1].param_groups[0]["betas"])]
    from jaxguard.audit import gradient_grid
    grid = gradient_grid(CLIP, n_linear=4, n_log=8)
    res["audit"] = first_update_audit(plain, guarded, tau=TAU, clip=CLIP, grid=grid,
                                      grads=[next_grads(plain[0], rank, world)])
    # the real next batch, unclamped, through the real training step: same loss path
    for m, o in (plain, guarded):
        train_step(m, o, STEPS, rank, world)
    gap = max(float(((a[0].double() - b[0].double()).abs() / LR).max()) for a, b in zip(local_state(*plain),
                                                                                      local_state(*guarded)))
    res["real_step_gap_lr"] = gap

    # corrupted, truncated, missing rank files: one-line error naming the file, nothing loaded on any rank
    res["corruption"] = {}
    for case in ("flip", "truncate", "missing"):
        bad = f"{root}/bad_{case}"
        if rank == 0:
            shutil.copytree(f"{root}/guarded", bad)
            victim = os.path.join(bad, "__1_0.distcp")
            data = bytearray(open(victim, "rb").read())
            if case == "flip":
                data[len(data) // 2] ^= 0x40
                open(victim, "wb").write(bytes(data))
            elif case == "truncate":
                open(victim, "wb").write(bytes(data[:len(data) - 100]))
            else:
                os.remove(victim)
        dist.barrier()
        model, opt = build(mesh, seed=7)
        msd, osd = get_state_dict(model, opt)     # initialises the optimizer state
        before = local_state(model, opt)
        err = None
        try:
            dcp.load({"model": msd, "optim": osd}, checkpoint_id=bad, planner=GuardedLoadPlanner(bad))
        except CheckpointException as exc:
            errs = [e for e, _ in exc.failures.values()]
            err = [type(e).__name__ + ": " + str(e) for e in errs]
            assert all(isinstance(e, CheckpointError) for e in errs), err
        res["corruption"][case] = {"errors": err, "untouched": same(before, local_state(model, opt))}
    with open(os.path.join(root, f"rank{rank}.json"), "w") as fh:
        json.dump(res, fh)
    dist.barrier()
    dist.destroy_process_group()
