"""The checks `load` makes before the first update: the optimizer about to step
against what each entry was certified for, the weights, the layout and the kernel."""
from __future__ import annotations

__all__ = ['HYPERPARAMETERS', 'check_next_update', 'watch_first_step',
           'certified_by_group', 'warn_other_kernel', 'check_certified_weights', 'check_layout']

from jaxguard.errors import CheckpointError, ConfigError, UnsupportedOptimizerError
from torch_compat.state.tensors import scalar_value, torch
from torch_compat.state.param_names import param_digest
from torch_compat.state.coverage import op_model_of


HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def _group_values(group) -> tuple:
    """A param group's hyperparameters as comparable numbers."""
    return (float(scalar_value(group["lr"], "lr")),   # (a group that is not Adam, stored exactly: no betas, eps)
            tuple(float(scalar_value(b, "beta")) for b in group.get("betas", ())),
            float(group.get("eps", 0.0)), float(group.get("weight_decay", 0.0) or 0.0))


def _next_update_differences(header, sd, groups, *, prefix="optimizer") -> list:
    """Where param groups `groups` (parallel to `sd`'s) would step otherwise than the
    moment pairs of `header` were certified for.

    Args:
      header: the container header.
      sd: the optimizer state_dict restored from it (its groups list the state indices).
      groups: the param groups about to step (dicts with lr, betas, eps, weight_decay).
      prefix: the entry-name prefix of the optimizer's state.

    Returns:
      ``[(group index, name, certified value, value it will step with)]``, one per group
      and hyperparameter that differs (an lr outside a certified interval differs).
    """
    from jaxguard.core.config import lr_bounds
    configs = {e.get("name"): e.get("config") or {} for e in header.get("entries", []) if e.get("kind") == "moments"}
    out = []
    for gi, (g, live) in enumerate(zip(sd["param_groups"], groups)):
        cfg = next((configs[f"{prefix}/state/{idx}"] for idx in g.get("params", ())
                    if f"{prefix}/state/{idx}" in configs), None)
        if not cfg or cfg.get("certify") is False:
            continue
        lr, betas, eps, wd = _group_values(live)
        lo, hi = lr_bounds(tuple(cfg["lr"]) if isinstance(cfg["lr"], list) else cfg["lr"])
        if not lo * (1 - 1e-6) <= lr <= hi * (1 + 1e-6):
            out.append((gi, "lr", cfg["lr"], lr))
        for name, want, got in (("betas", tuple(cfg["betas"]), betas), ("eps", cfg["eps"], eps),
                                ("weight_decay", cfg.get("weight_decay", 0.0), wd)):
            if want != got:
                out.append((gi, name, want, got))
    return out


def check_next_update(header, sd, groups, where="the checkpoint", *, strict=False, prefix="optimizer") -> None:
    """Warn (one `JaxguardWarning` line) or, with `strict`, raise when param groups
    `groups` would step with other hyperparameters than the moments of `header` were
    certified for (`_next_update_differences`): the tau guarantee covers the certified
    update only.

    Args:
      header, sd, groups, prefix: as `_next_update_differences`.
      where: how to name the checkpoint.
      strict: raise instead of warning.

    Raises:
      CheckpointError: (``strict``) the first difference, naming both values.
    """
    diffs = _next_update_differences(header, sd, groups, prefix=prefix)
    if not diffs:
        return
    gi, name, want, got = diffs[0]
    fix = "compress again with --lr" if name == "lr" else "save again with the optimizer as it will step"
    msg = (f"{where}: param group {gi} will step with {name}={got!r} but its moments were certified for "
           f"{name}={want!r}: the tau guarantee covers the certified update only; set it back, or {fix}")
    if strict:
        raise CheckpointError(msg)
    import warnings
    from jaxguard.errors import JaxguardWarning
    warnings.warn(msg, JaxguardWarning, stacklevel=3)


def watch_first_step(header, sd, optimizer, where="the checkpoint", *, strict=False) -> None:
    """At `optimizer`'s first step after a load, compare its param groups with the
    certified updates again (`check_next_update`) if they changed since the load (a
    learning rate set by hand or by a scheduler); the hook is inert after that step.

    Args:
      header, sd: the container header and the state_dict loaded from it.
      optimizer: the optimizer it was loaded into.
      where: how to name the checkpoint.
      strict: raise (the step does not happen) instead of warning.
    """
    loaded = [_group_values(g) for g in optimizer.param_groups]
    done = []

    def hook(opt, args, kwargs):
        if done:
            return
        done.append(True)
        if [_group_values(g) for g in opt.param_groups] != loaded:
            check_next_update(header, sd, opt.param_groups, where, strict=strict)

    optimizer.register_step_pre_hook(hook)


def certified_by_group(header, sd, prefix="optimizer") -> list:
    """The op models that certified each param group's moments in a container.

    Args:
      header: the container header (`restore_tree`).
      sd: the optimizer state_dict restored from it.
      prefix: the entry-name prefix of the optimizer's state (``"optimizer"``).

    Returns:
      One sorted list of op model names per param group of `sd` (empty for a group
      without saved state).
    """
    models = {e.get("name"): (e.get("config") or {}).get("op_model") for e in header.get("entries", [])}
    return [sorted({models[f"{prefix}/state/{idx}"] for idx in g.get("params", ())
                    if models.get(f"{prefix}/state/{idx}")}) for g in sd["param_groups"]]


def warn_other_kernel(certified, optimizer, where="the checkpoint") -> None:
    """Warn (one line, `jaxguard.errors.JaxguardWarning`) when a param group of `optimizer`
    will run another kernel than the op model that certified its state: its parameters'
    device and its foreach/fused/capturable flags resolve (`op_model_of`) to another op
    model, or to none.  The first such group is named.

    Args:
      certified: per param group, the op models that certified it (`certified_by_group`).
      optimizer: the optimizer after ``load_state_dict`` (its groups carry the saved flags
        and the live parameters).
      where: how to name the checkpoint.
    """
    import warnings
    from jaxguard.errors import JaxguardWarning
    for gi, (models, group) in enumerate(zip(certified, optimizer.param_groups)):
        devices = sorted({p.device.type for p in group["params"]})
        for dev in devices:
            try:
                runs = op_model_of(group, dev, gi=gi)
            except UnsupportedOptimizerError:
                runs = None
            if models and (runs is None or any(m != runs for m in models)):
                flags = f"foreach={group.get('foreach')}, fused={group.get('fused')}" + \
                    (", capturable=True" if group.get("capturable") else "")
                what = f"whose update is {runs}" if runs else "which no op model covers"
                fix = f", or save the original state again with op_model={runs!r}" if runs else ""
                warnings.warn(f"{where} was certified for {', '.join(models)} but param group {gi} resumes on {dev} "
                              f"({flags}), {what}: the tau guarantee holds for {models[0]} only; resume on that "
                              f"kernel{fix}", JaxguardWarning, stacklevel=3)
                return


def check_certified_weights(header, optimizer, where="the checkpoint", *, on_mismatch="warn") -> None:
    """Compare `optimizer`'s live parameters with the weights each moment pair in `header`
    was certified against (``param_sha256``; containers written before it have none and
    are not checked).

    A framework that writes the model's weights and the optimizer's state as separate
    files in place (the HF Trainer, accelerate) leaves, after a kill between the two, a
    directory whose weights are the new save's and whose optimizer state is the previous
    one's; the guarantee (and the resume) was stated for the previous weights.

    Args:
      header: the container header (`restore_tree`).
      optimizer: the optimizer about to take the state (its params hold the weights the
        run resumes from: load the model first).
      where: how to name the checkpoint.
      on_mismatch: ``"warn"`` (one `JaxguardWarning` line), ``"raise"`` (one
        `CheckpointError` line) or ``"off"``.
    Raises:
      CheckpointError: ``on_mismatch="raise"`` and a parameter differs.
      ConfigError: `on_mismatch` is not one of the three.
    """
    if on_mismatch not in ("warn", "raise", "off"):
        raise ConfigError(f"check_weights={on_mismatch!r} is not 'warn', 'raise' or 'off'")
    if on_mismatch == "off":
        return
    want = {e["name"]: (e.get("config") or {}) for e in header.get("entries", []) if e.get("config")}
    sd_groups = optimizer.state_dict()["param_groups"]
    for g, live in zip(sd_groups, optimizer.param_groups):
        for idx, p in zip(g["params"], live["params"]):
            cfg = want.get(f"optimizer/state/{idx}")
            if not cfg or not cfg.get("param_sha256") or p.device.type == "meta" \
                    or param_digest(p) == cfg["param_sha256"]:   # a meta parameter has no values yet
                continue
            msg = (f"{where}: the Adam state of parameter {cfg.get('param') or idx!r} was certified against other "
                   "weights than the model's (SHA-256 differs): the model was not loaded first, or the directory "
                   "mixes two saves (weights rewritten in place by a save that was interrupted before the optimizer "
                   "file); load the matching weights, or resume from an earlier checkpoint")
            if on_mismatch == "raise":
                raise CheckpointError(msg)
            import warnings
            from jaxguard.errors import JaxguardWarning
            warnings.warn(msg, JaxguardWarning, stacklevel=3)
            return


def check_layout(sd, optimizer, where="the state", *, match="names") -> None:
    """Check that optimizer state_dict `sd` fits `optimizer`'s parameters (see `load`).

    Args:
      sd: a saved optimizer state_dict.
      optimizer: the live optimizer it is to be loaded into.
      where: what `sd` came from, for the error.
      match: ``"names"`` or ``"position"`` (names not compared: `load`).

    Raises:
      CheckpointError: the first difference (groups, parameter counts, names, shapes,
        dtypes), in one line.
    """
    live_groups = optimizer.param_groups
    names_live = optimizer.state_dict()["param_groups"]
    if len(live_groups) != len(sd["param_groups"]):
        raise CheckpointError(f"{where} has {len(sd['param_groups'])} param groups, this optimizer "
                              f"{len(live_groups)}; load it into an optimizer over the same parameters")
    index = {}
    for gi, (g, live, lsd) in enumerate(zip(sd["param_groups"], live_groups, names_live)):
        if len(g["params"]) != len(live["params"]):
            raise CheckpointError(f"{where}: param group {gi} has {len(g['params'])} parameters, this optimizer's "
                                  f"{len(live['params'])}; load it into an optimizer over the same parameters")
        a, b = g.get("param_names"), lsd.get("param_names")
        if a and b and list(a) != list(b) and match == "names":
            k = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            raise CheckpointError(f"{where}: param group {gi} parameter {k} is {a[k]!r}, this optimizer's is "
                                  f"{b[k]!r}; load it into an optimizer over the same named parameters, or, if a "
                                  "module was renamed since the save, load with match='position' (the order you "
                                  "assert; shapes and certified weights are still checked)")
        for i, (idx, p) in enumerate(zip(g["params"], live["params"])):
            index[idx] = (gi, i, (a or b or [None] * len(g["params"]))[i], p)
    for idx, st in sd["state"].items():
        if idx not in index:
            raise CheckpointError(f"{where} has state for parameter index {idx}, which no param group lists")
        gi, i, name, p = index[idx]
        label = f"{name!r}" if name else f"group {gi} parameter {i}"
        for key in ("exp_avg", "exp_avg_sq"):
            t = st.get(key)
            if not isinstance(t, torch.Tensor):
                continue
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{where}: {label} has {key} of shape {tuple(t.shape)}, this optimizer's "
                                      f"parameter is {tuple(p.shape)}; load it into an optimizer over the same parameters")
            if t.dtype != p.dtype:
                raise CheckpointError(f"{where}: {label} has {key} {t.dtype}, this optimizer's parameter is "
                                      f"{p.dtype}; torch would cast the restored moments (keep the parameters {t.dtype})")
