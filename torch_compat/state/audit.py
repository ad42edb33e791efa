"""The first-update audit with real torch: one torch step from the original and from
the restored state, compared against the bound."""
from __future__ import annotations

__all__ = ['torch_step', 'audit', 'save_torch']

import math

from jaxguard import audit as jg_audit
from jaxguard.format.spec import DEFAULT_CLIP, DEFAULT_TAU
from jaxguard.format import container
from jaxguard.errors import CheckpointError
from torch_compat.replay import TORCH_FLAGS
from torch_compat.state.tensors import scalar_value, torch
from torch_compat.state.param_names import param_index, param_map_of
from torch_compat.state.coverage import check_optimizer_state, implementation_of
from torch_compat.state.records import step_count


def torch_step(p, m, v, g, step, group, decoupled, lr=None):
    """One real torch Adam/AdamW step of one parameter, with the param group's flags.

    Args:
      p: the parameter (a float32 tensor; not modified).
      m, v: its ``exp_avg`` and ``exp_avg_sq`` (not modified).
      g: the gradient (a tensor of p's shape).
      step: the steps already taken (the state's ``step``).
      group: the param group (lr, betas, eps, weight_decay, foreach/fused flags).
      decoupled: AdamW's decoupled weight decay (``torch.optim.AdamW``).
      lr: the step's learning rate (None: the group's).

    Returns:
      The parameter after the step (a detached tensor).
    """
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    p = torch.nn.Parameter(p.clone())
    lr = float(scalar_value(group["lr"], "lr")) if lr is None else float(lr)
    opt = cls([p], lr=lr, betas=tuple(group["betas"]), eps=group["eps"],
              weight_decay=group.get("weight_decay", 0.0) or 0.0, **TORCH_FLAGS[implementation_of(group)])
    opt.state[p] = {"step": torch.tensor(float(step)), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    p.grad = g
    opt.step()
    return p.detach()


def audit(original, restored, *, tau=DEFAULT_TAU, clip=DEFAULT_CLIP, grads=None, grid=None, progress=False,
          param_order=None, lr=None):
    """Run the real torch Adam/AdamW (with the param group's foreach/fused flags) one step from the
    original and the restored state for every gradient of a grid across [-clip, clip]
    (the same g for every coordinate, plus one random per-coordinate draw) and for any
    real gradients given in `grads` {name: tensor} (clamped to [-clip, clip]).

    Args:
      original, restored: torch checkpoints ``{"model": state_dict, "optimizer": state_dict}``,
        the saved one and the one restored from the container (`restore_tree`).
      tau, clip: the contract: ``|p_original - p_restored| <= tau * lr`` for ``|g| <= clip``.
      grads: real gradients {param name: tensor}, optional.
      grid: gradient values (default `jaxguard.audit.gradient_grid(clip)`).
      progress: show a tqdm bar over the tensors.
      param_order: an asserted order for an optimizer without provable names
        (`infer_param_names`); without it such a checkpoint is refused, never audited
        through a map that cannot be proven.
      lr: the learning rates to step with instead of each group's: a number, or ``(lo,
        hi)`` (an interval certificate: the audit steps at lo, sqrt(lo hi) and hi, each
        gap measured in its own lr).

    Returns:
      {"max_gap_lr", "violations" (coordinates over tau), "coordinates", "gradients",
      "param_map"} (`jaxguard.audit.AuditSummary`; ``param_map`` says how the moments were
      matched to the weights, `PARAM_MAPS`).

    Raises:
      UnsupportedOptimizerError, CheckpointError: an optimizer state_dict that is not a
        single-tensor FP32 Adam/AdamW one (`check_optimizer_state`), or unnamed parameters
        with no provable map and no `param_order`.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny steps: threads only add contention
    try:
        return _audit(original, restored, tau=tau, clip=clip, grads=grads, grid=grid, progress=progress,
                      param_order=param_order, lr=lr)
    finally:
        torch.set_num_threads(threads)


def _audit_rates(lr, group):
    """The learning rates an audit steps one group with (`audit`'s ``lr``)."""
    from jaxguard.core.config import is_interval, lr_bounds
    if lr is None:
        return [float(scalar_value(group["lr"], "lr"))]
    lo, hi = lr_bounds(lr)
    return sorted({lo, math.sqrt(lo * hi), hi}) if is_interval(lr) else [lo]


def _audit(original, restored, *, tau, clip, grads, grid, progress, param_order=None, lr=None):
    grid = jg_audit.gradient_grid(clip) if grid is None else grid
    for what, ck in (("the original checkpoint", original), ("the restored checkpoint", restored)):
        if not isinstance(ck, dict) or "optimizer" not in ck or (ck is original and "model" not in ck):
            raise CheckpointError(f"{what} has no {'model and ' if ck is original else ''}optimizer state "
                                  "to audit; pass {'model': model.state_dict(), 'optimizer': optimizer.state_dict()}")
    o_sd, r_sd = original["optimizer"], restored["optimizer"]
    check_optimizer_state(o_sd, original["model"], param_order)
    names = param_index(o_sd, original["model"], param_order)
    r_state = r_sd.get("state", {}) if isinstance(r_sd, dict) else {}
    for idx, st in o_sd["state"].items():
        rst = r_state.get(idx)
        name = names[idx][0] if idx in names else idx
        got = None if not isinstance(rst, dict) else [tuple(getattr(rst.get(k), "shape", ())) for k in
                                                      ("exp_avg", "exp_avg_sq")]
        want = [tuple(st[k].shape) for k in ("exp_avg", "exp_avg_sq")]
        if got != want or name not in original["model"]:
            raise CheckpointError(f"the container does not hold this checkpoint's optimizer state (parameter "
                                  f"{name!r}: moments {want[0]} in CKPT, {'missing' if got is None else got[0]} in the "
                                  "container); audit the container written from this CKPT")
    tally = jg_audit.AuditTally(tau)
    gen = torch.Generator().manual_seed(0)
    items = list(o_sd["state"].items())
    if progress:
        from tqdm import tqdm
        items = tqdm(items, desc="audit", unit="tensor", leave=False)
    for idx, st in items:
        name, group = names[idx]
        rst = r_sd["state"][idx]
        p = original["model"][name].detach().float()
        decoupled = bool(group.get("decoupled_weight_decay", False))
        step = step_count(st, idx)
        gs = [torch.full_like(p, float(g)) for g in grid]
        gs.append((torch.rand(p.shape, generator=gen) * 2 - 1) * clip)
        if grads is not None and name in grads:
            gs.append(grads[name].detach().float().clamp(-clip, clip))
        for rate in _audit_rates(lr, group):
            for g in gs:
                a = torch_step(p, st["exp_avg"], st["exp_avg_sq"], g, step, group, decoupled, rate)
                b = torch_step(p, rst["exp_avg"], rst["exp_avg_sq"], g, step, group, decoupled, rate)
                tally.add(idx, a.numpy(), b.numpy(), rate)
    return {**tally.summary(len(grid) + 1).to_json(), "param_map": param_map_of(o_sd, param_order)}


def save_torch(path, obj) -> None:
    """``torch.save(obj)`` to ``path`` atomically (a temporary file renamed into place).

    Args:
      path: a local path or an fsspec URL.
      obj: what torch.save accepts (a checkpoint dict of tensors).

    Raises:
      OSError: the file cannot be written; no partial file is left.
    """
    container.atomic_write_with(path, lambda fh: torch.save(obj, fh))   # straight to the file, no copy in memory
