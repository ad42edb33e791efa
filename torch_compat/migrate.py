"""Migration of Adam/AdamW state between torch and optax.

Name mapping
------------
A torch parameter name (``"fc1.weight"``, from ``model.named_parameters()`` and the
optimizer's ``param_names``) is the *dotted path* of the JAX param leaf: its key path with
dict keys, attribute names and sequence indices joined by ``"."``
(`jaxguard.optax_adapter.dotted`).  So `params` may be a flat dict
``{"fc1.weight": array}`` or any pytree whose dotted leaf paths are the torch names
(``{"fc1": {"weight": array}}``).  Arrays keep torch's layout (a ``Linear`` weight stays
``[out, in]``): transposing for a flax ``Dense`` kernel is the model's business.

Semantics
---------
torch ``state["step"] = t`` and optax ``count = t`` both mean that the next update uses
bias corrections at ``t + 1``.  ``torch.optim.Adam`` maps to ``optax.adam``; ``AdamW``
(``decoupled_weight_decay``) to ``optax.adamw`` with the same ``weight_decay`` (torch's
``p *= 1 - lr*wd`` then the Adam step equals optax's ``p - lr*(m^/d + wd*p)``); torch
Adam with ``weight_decay > 0`` (L2 added to the gradient) to
``optax.chain(optax.add_decayed_weights(wd), optax.adam(...))``.  optax keeps one step
count: every parameter must have optimizer state with the same ``step``.  Going back,
``weight_decay > 0`` maps to ``torch.optim.AdamW``; each Adam state of a
``multi_transform`` becomes one torch param group.

Numerical contract
------------------
The moments are copied exactly (``to_optax`` / ``from_optax``), so the first update after
migration differs from the source framework's only by the two frameworks' FP32 op
orders (a few ulps of the step).  ``jaxguard migrate --to optax`` stores the moments
guarded against the *target* op model (``optax-adam``/``optax-adamw``) with
``tau * MIGRATE_TAU_FACTOR``, which leaves room for that cross-framework difference:
the first optax update from the file is within ``tau * lr`` of torch's from the source.
bfloat16 ``mu`` is not migrated to torch (optax multiplies it by ``b1`` in bfloat16, a
difference torch cannot reproduce).
"""
from __future__ import annotations

__all__ = ["to_optax", "from_optax", "container_to_torch", "torch_to_container", "load_migrated"]

from jaxguard.core.config import save_spec
import numpy as np
import torch

import jax
import jax.numpy as jnp
import optax

from jaxguard import optax_adapter
from jaxguard.errors import CheckpointError, UnsupportedOptimizerError

from torch_compat.state import (check_optimizer_state, param_index, scalar_value, step_count, tensor_to_numpy,
                                with_param_names)

MIGRATE_TAU_FACTOR = 0.99


def _to_numpy(x):
    if isinstance(x, torch.Tensor):
        arr, dt = tensor_to_numpy(x)
        return arr.view(jnp.bfloat16) if dt == "bfloat16" else arr
    return np.asarray(x)


def _tx_spec(opt_sd) -> dict:
    """The optax transformation equivalent to the torch optimizer state_dict `opt_sd`.

    Args:
      opt_sd: a torch Adam/AdamW ``optimizer.state_dict()`` (one param group, or several
        with the same hyperparameters).

    Returns:
      ``{"name": "adam" | "adamw" | "adam+l2", "learning_rate", "b1", "b2", "eps",
      "weight_decay"}`` (Python floats), the input of `make_tx`.

    Raises:
      UnsupportedOptimizerError: not torch Adam/AdamW, an option outside the op models,
        or groups with different hyperparameters.
    """
    check_optimizer_state(opt_sd)
    specs = set()
    for g in opt_sd["param_groups"]:
        wd = float(g.get("weight_decay", 0.0) or 0.0)
        decoupled = bool(g.get("decoupled_weight_decay", False))
        specs.add((float(scalar_value(g["lr"], "lr")), tuple(float(scalar_value(b, "beta")) for b in g["betas"]),
                   float(g["eps"]), wd, decoupled and wd > 0, (not decoupled) and wd > 0))
    if len(specs) != 1:
        raise UnsupportedOptimizerError(f"the optimizer has {len(specs)} param groups with different hyperparameters; "
                                        "to_optax maps one group (use optax.multi_transform by hand for several)")
    lr, betas, eps, wd, adamw, l2 = specs.pop()
    name = "adamw" if adamw else ("adam+l2" if l2 else "adam")
    return {"name": name, "learning_rate": lr, "b1": betas[0], "b2": betas[1], "eps": eps, "weight_decay": wd}


def make_tx(spec: dict) -> optax.GradientTransformation:
    """The optax transformation a `_tx_spec` describes.

    Args:
      spec: a dict from `_tx_spec` (or a container's ``meta["tx"]``).

    Returns:
      ``optax.adamw`` for "adamw", ``chain(add_decayed_weights, adam)`` for "adam+l2"
      (torch's coupled L2 decay), else ``optax.adam``.
    """
    kw = dict(b1=spec["b1"], b2=spec["b2"], eps=spec["eps"])
    if spec["name"] == "adamw":
        return optax.adamw(spec["learning_rate"], weight_decay=spec["weight_decay"], **kw)
    if spec["name"] == "adam+l2":
        return optax.chain(optax.add_decayed_weights(spec["weight_decay"]), optax.adam(spec["learning_rate"], **kw))
    return optax.adam(spec["learning_rate"], **kw)


def _replace_adam(state, new):
    leaves, tdef = jax.tree_util.tree_flatten(state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
    leaves = [new if isinstance(x, optax.ScaleByAdamState) else x for x in leaves]
    return jax.tree_util.tree_unflatten(tdef, leaves)


def to_optax(state_dict, params):
    """torch Adam/AdamW optimizer ``state_dict`` (with ``param_names``) -> (opt_state, tx).

    `opt_state` mirrors `params`' structure and is what ``tx.init(params)`` gives, with
    the torch moments and step filled in.

    Args:
      state_dict: the torch optimizer's ``state_dict()``; its param groups carry
        ``param_names`` (torch >= 2.4 with named parameters).
      params: flat dict torch name -> array/tensor, or a pytree whose dotted leaf paths
        are the torch names (module docstring).

    Returns:
      ``(opt_state, tx)``: the optax state (float32 moments copied exactly) and the
      transformation (`make_tx` of `_tx_spec`).

    Raises:
      CheckpointError: a param missing from ``param_names`` or without state, a shape
        mismatch, or params at different steps.
      UnsupportedOptimizerError: as `_tx_spec`.
    """
    spec = _tx_spec(state_dict)
    tx = make_tx(spec)
    names = {name: idx for idx, (name, _) in param_index(state_dict).items()}
    jparams = jax.tree_util.tree_map(lambda x: jnp.asarray(_to_numpy(x)), params)
    pflat = optax_adapter.flat_by_dotted(jparams, "params")
    steps = set()
    for name, p in pflat.items():
        if name not in names:
            raise CheckpointError(f"param {name!r} is not in the optimizer's param_names; pass the params the "
                                  "optimizer was built from (names from model.named_parameters())")
        st = state_dict["state"].get(names[name])
        if st is None:
            raise CheckpointError(f"param {name!r} has no optimizer state (it never received a gradient); optax keeps "
                                  "one step count for all params, so every param needs state of the same step")
        if tuple(st["exp_avg"].shape) != tuple(np.shape(p)):
            raise CheckpointError(f"param {name!r} has shape {tuple(np.shape(p))} but its moments have "
                                  f"{tuple(st['exp_avg'].shape)}")
        steps.add(step_count(st, names[name]))
    if len(steps) != 1:
        raise CheckpointError(f"params have different steps {sorted(steps)}; optax keeps one step count")

    def moment(key):
        return jax.tree_util.tree_map_with_path(
            lambda path, p: jnp.asarray(_to_numpy(state_dict["state"][names[optax_adapter.dotted(path)]][key])),
            jparams)

    adam = optax.ScaleByAdamState(count=jnp.asarray(steps.pop(), jnp.int32), mu=moment("exp_avg"),
                                  nu=moment("exp_avg_sq"))
    return _replace_adam(tx.init(jparams), adam), tx


def _torch_ckpt(items, params_flat):
    """items: [(name, mu, nu, cfg dict)] -> {"model", "optimizer"} torch checkpoint dict."""
    groups: dict = {}
    state = {}
    order = []
    for name, mu, nu, cfg in items:
        key = (cfg["lr"], tuple(cfg["betas"]), cfg["eps"], cfg["weight_decay"])
        groups.setdefault(key, []).append(name)
        order.append((name, mu, nu, cfg))
    idx_of = {}
    param_groups = []
    i = 0
    for (lr, betas, eps, wd), names in groups.items():
        for n in names:
            idx_of[n] = i
            i += 1
        param_groups.append({"lr": lr, "betas": betas, "eps": eps, "weight_decay": wd, "amsgrad": False,
                             "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                             "fused": None, "decoupled_weight_decay": wd > 0,
                             "params": [idx_of[n] for n in names], "param_names": list(names)})
    for name, mu, nu, cfg in order:
        mu, nu = np.asarray(mu), np.asarray(nu)
        if mu.dtype != np.float32:
            raise UnsupportedOptimizerError(f"mu of {name!r} is {mu.dtype}; only float32 mu migrates to torch "
                                            "(optax rounds b1*mu to bfloat16, which torch cannot reproduce)")
        state[idx_of[name]] = {"step": torch.tensor(float(cfg["step"])), "exp_avg": torch.from_numpy(np.array(mu)),
                               "exp_avg_sq": torch.from_numpy(np.array(nu, np.float32))}
    model = {n: torch.from_numpy(np.array(np.asarray(p, np.float32))) for n, p in params_flat.items()}
    return {"model": model, "optimizer": {"state": state, "param_groups": param_groups}}


def from_optax(opt_state, params, *, lr=None, weight_decay=None, betas=None, eps=None):
    """optax state (any tree with Adam states, see `jaxguard.save`) -> torch checkpoint
    dict ``{"model": {name: tensor}, "optimizer": state_dict}`` loadable into
    ``torch.optim.Adam``/``AdamW`` built from ``model.named_parameters()``.

    Args:
      opt_state: the optax state holding one or more ``ScaleByAdamState``.
      params: the params pytree; dotted leaf paths become the torch names.
      lr: the learning rate; default: the state's inject_hyperparams.
      weight_decay: ``> 0`` makes the group AdamW (``decoupled_weight_decay=True``).
      betas, eps: Adam's hyperparameters (default: as `jaxguard.save`).

    Returns:
      The torch checkpoint dict (moments copied exactly as float32 tensors).

    Raises:
      CheckpointError: no Adam state in `opt_state`, or a moment without a param.
    """
    pflat = optax_adapter.flat_by_dotted(params, "params")
    sites = optax_adapter.find_adam_states(opt_state)
    if not sites:
        raise CheckpointError(optax_adapter.NO_ADAM)
    items = []
    for site in sites:
        cfg = optax_adapter.site_config(site, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                                          lr_from_state=True).to_json()
        nus = optax_adapter.flat_by_dotted(site.state.nu, "nu")
        for name, mu in optax_adapter.flat_by_dotted(site.state.mu, "mu").items():
            if name not in pflat:
                raise CheckpointError(f"params has no leaf {name!r} but the Adam state at {site.name!r} does")
            items.append((name, np.asarray(mu), np.asarray(nus[name]), cfg))
    return _torch_ckpt(items, {n: np.asarray(p) for n, p in pflat.items()})


def container_to_torch(path):
    """An optax jaxguard container saved with params (``include_params=True`` or
    ``jaxguard migrate --to optax``) -> torch checkpoint dict of the restored state.

    Args:
      path: the container's local path or fsspec URL.

    Returns:
      ``{"model": {name: tensor}, "optimizer": state_dict}`` with the decoded moments.

    Raises:
      UnsupportedOptimizerError: an entry holds bfloat16 mu (only float32 mu migrates).
      CheckpointError: the container holds no params.
      ContainerError: the file is corrupt or not a jaxguard container.
    """
    header, arrays = optax_adapter.read(path)
    params = optax_adapter.load_params(path)
    items = []
    for e in header["entries"]:
        if e["kind"] != "moments":
            continue
        cfg = e["config"]
        if cfg.get("mu_mode") != "coded":
            raise UnsupportedOptimizerError(f"{e['name']} holds bfloat16 mu; only float32 mu migrates to torch")
        m, v = arrays[e["name"]]
        items.append((cfg["param"], m, v, cfg))
    return _torch_ckpt(items, params)


def torch_to_container(ckpt, *, spec=None, tau=None, clip=None, codec=None):
    """torch checkpoint dict -> (optax container bytes, summary), moments guarded against
    the target optax op model with ``tau * MIGRATE_TAU_FACTOR``; params stored.

    Args:
      ckpt: ``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}``.
      spec: the guard settings, a `jaxguard.GuardSpec` (default ``GuardSpec()``); the
        arguments below override its fields.
      tau: the first-update tolerance as a fraction of lr (shrunk by MIGRATE_TAU_FACTOR).
      clip: the gradient bound C; for torch's coupled L2 decay it is widened by
        ``wd * max|p|`` (optax's adam then sees ``g + wd p``).
      codec: the moment codec.

    Returns:
      ``(data, summary)``: the container bytes (with ``meta["tx"]`` for `load_migrated`)
      and the save summary.

    Raises:
      CheckpointError: not a dict with 'model' and 'optimizer', or a param missing from
        the model state_dict.
      UnsupportedOptimizerError: as `_tx_spec`.
    """
    if not isinstance(ckpt, dict) or "model" not in ckpt or "optimizer" not in ckpt:
        raise CheckpointError("the checkpoint must be a dict with 'model' (state_dict) and 'optimizer' "
                              "(Adam/AdamW state_dict) keys")
    guard = save_spec(spec, tau=tau, clip=clip, codec=codec)
    clip = guard.clip
    osd = with_param_names(ckpt["optimizer"], ckpt["model"])   # a model.parameters() optimizer: by order
    spec = _tx_spec(osd)
    names = [n for n, _ in param_index(osd).values()]
    missing = [n for n in names if n not in ckpt["model"]]
    if missing:
        raise CheckpointError(f"parameter {missing[0]!r} is in the optimizer but not in the model state_dict")
    params = {n: _to_numpy(ckpt["model"][n]) for n in names}
    opt_state, _ = to_optax(osd, params)
    if spec["name"] == "adam+l2":  # Adam sees g + wd*p: widen the certified gradient range
        pmax = max((float(np.max(np.abs(np.asarray(p, np.float32)))) for p in params.values() if np.size(p)), default=0.0)
        clip = (clip + spec["weight_decay"] * pmax) * (1 + 2.0**-20)
    data, summary = optax_adapter.to_bytes(
        opt_state, params, lr=spec["learning_rate"], spec=guard, tau=guard.tau * MIGRATE_TAU_FACTOR, clip=clip,
        weight_decay=spec["weight_decay"] if spec["name"] == "adamw" else 0.0,
        betas=(spec["b1"], spec["b2"]), eps=spec["eps"], include_params=True,
        extra_meta={"tx": spec, "migrated_from": "torch"})
    return data, summary


def load_migrated(path):
    """(params {name: array}, opt_state, tx) of a container written by ``migrate --to optax``.

    Args:
      path: the container's local path or fsspec URL.

    Returns:
      ``(params, opt_state, tx)``: jax params by torch name, the restored optax state
      and the transformation recorded at migration.

    Raises:
      CheckpointError: the container records no optax transformation.
    """
    header, _ = optax_adapter.read(path)
    spec = header["meta"].get("tx")
    if not spec:
        raise CheckpointError(f"{path} records no optax transformation; load it with jaxguard.load(path, like=...)")
    params = {k: jnp.asarray(v) for k, v in optax_adapter.load_params(path).items()}
    tx = make_tx(spec)
    return params, optax_adapter.load(path, tx.init(params)), tx
