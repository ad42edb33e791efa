"""optax state pytrees in and out of jaxguard containers.

`save(path, opt_state, params, lr=...)` finds every `optax.ScaleByAdamState` anywhere in
an optax state pytree (`optax.adam`, `adamw`, `chain`s with clipping, `inject_hyperparams`,
`multi_transform`, `masked`, `named_chain`), compresses each ``mu``/``nu`` leaf pair with
the guard against the ``optax-adam`` / ``optax-adamw`` op model (XLA:CPU; the
``-gpu`` XLA:GPU model when the moments live on a GPU, or the one named by
``op_model=``: docs/gpu.md) and stores every other leaf exactly.  `load(path, like=opt_state)` rebuilds the tree of `like`: same structure,
dtypes and (for `jax.Array` leaves) shardings.

Leaves are matched by their *dotted path*: the key path of the leaf with dict keys,
attribute names and sequence indices joined by ``"."`` (``"0.mu.dense.kernel"``).  A flat
params dict ``{"dense.kernel": x}`` and a nested one ``{"dense": {"kernel": x}}`` give the
same dotted paths, which is how torch names map to JAX params (torch_compat.migrate).

Hyperparameters of the next update, per Adam state: ``lr`` (argument, required: a
number, or the optax schedule, evaluated at the state's ``count``; an `inject_hyperparams`
state holds the last update's rate, which a schedule may have changed); ``b1``, ``b2``, ``eps`` and
``weight_decay`` likewise from the enclosing `inject_hyperparams` state, else from the
arguments.  The state does not record an ``add_decayed_weights`` in a chain (its state
is ``EmptyState``): for `optax.adamw` pass ``weight_decay=`` (or use
``inject_hyperparams(optax.adamw)``, whose state carries it); a state laid out as
``optax.adamw``'s saved without it is refused in one line, never guessed (optax.adamw's
default decay is 1e-4, not 0).  ``weight_decay > 0``
selects the ``optax-adamw`` op model.  `nesterov=True` and ``eps_root != 0`` are outside
the pinned op model and cannot be detected from the state: do not use them.

Numerical contract
------------------
For every float32 ``mu``/``nu`` coordinate, the first ``tx.update`` + ``apply_updates``
after `load` differs from the one the saved state would have produced by at most
``tau * lr`` for every gradient ``|g| <= clip`` reaching ``scale_by_adam`` (see
jaxguard.core.guard).  Every other leaf is restored bit-exactly.  With
``mu_dtype=jnp.bfloat16`` the restored ``mu`` is exactly the saved bfloat16 ``mu`` (it is
stored raw, 2 bytes a coordinate) and only ``nu`` is coded; its certificate uses
``tau / 1.02``, which covers optax computing ``b1 * mu`` in bfloat16 (``b1`` rounds to
0.8984375, a relative change < 0.6% of the ``m'`` the bound assumes; the difference is
``m' * (1/d1 - 1/d2)`` and ``m'`` is the same in both runs).
"""
from __future__ import annotations

__all__ = ["summary", "to_bytes", "encode_state", "save", "read", "load", "load_params", "audit"]

from jaxguard.core.config import GuardSpec, UpdateRequest, save_spec

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxguard.format.spec import DEFAULT_CLIP, DEFAULT_TAU
from jaxguard.format import container
from jaxguard.errors import CheckpointError, ConfigError
from jaxguard import audit as _audit
from jaxguard import flax_state
from jaxguard import sharded as _sharded
from jaxguard import writer
from jaxguard.optax_probe import LR_HALF_WIDTH
from jaxguard.optax_state import (AGREE, EXACT_REASON, INJECT_STATES, NO_ADAM, AdamSite, MomentPair, dotted,  # noqa: F401
                                  dtype_name, exact_reasons, find_adam_states, flat_by_dotted, key_str, lay_out,
                                  moment_pairs, plan_updates, site_config, stored_exactly, stored_like_leaf,
                                  warn_other_platform)


# ---------------------------------------------------------------- records for the writer
def state_records(opt_state, params, *, update: UpdateRequest | None = None, spec=None, prefix="state", fixed=None):
    """The write records of `opt_state` (`jaxguard.writer`): a `MomentJob` per Adam
    ``mu``/``nu`` pair (``mu="exact"`` with a raw entry beside it for a bfloat16 mu), a
    `Raw` record per other leaf; a pair whose next learning rate is 0 is stored raw.

    Args:
      opt_state: the optax state (any tree holding `optax.ScaleByAdamState`s).
      params: the parameter pytree the state belongs to.
      update: the save's `UpdateRequest` (lr, weight_decay, betas, eps, op_model, tx,
        uncertifiable: see `save` and `optax_state.plan_updates`).
      spec: the save's `GuardSpec` (`jaxguard.core.config.save_spec`).
      prefix: the entry-name prefix of the state's leaves in the container.
      fixed: the next updates resolved already (`optax_state.plan_updates`).

    Returns:
      ``(records, state meta)``: the records and the meta that `restore_state` reads
      (``leaves``, ``sites``, ``treedef``; a moment leaf stored exactly says ``why``, and
      ``stored_exactly`` lists those pairs: ``{"param", "why"}``).

    Raises:
      CheckpointError: no Adam state, moments without a matching param, shapes that differ,
        two leaves with one dotted path.
      UnsupportedOptimizerError: a param or nu that is not float32, a mu that is neither
        float32 nor bfloat16, ``eps_root != 0``, a `tx` the op model does not reproduce.
      ConfigError: see `optax_state.plan_updates`.
    """
    spec = save_spec(spec)
    lay = lay_out(opt_state, params, spec=spec, update=update, prefix=prefix, fixed=fixed)
    records, in_pairs = [], set()
    for job in lay.coded:
        if job.mu == "coded":
            records.append(job)
        else:
            records.append(_raw(job.raw_entry, job.m))
            records.append(job.with_arrays(np.asarray(jnp.asarray(job.m).astype(jnp.float32)), job.v, job.p))
        in_pairs.update((job.mu_path, job.nu_path))
    records += [_raw(leaf["entry"], lay.flat[leaf["path"]]) for leaf in lay.leaves if leaf["path"] not in in_pairs]
    return records, {"leaves": lay.leaves, "sites": [plan.meta(spec) for plan in lay.plans], "treedef": lay.treedef,
                     "stored_exactly": stored_exactly(lay.plans)}


def _raw(name, leaf):
    arr = np.asarray(leaf)
    return writer.Raw(name, arr, container.numpy_dtype_name(arr))


def summary(totals, container_bytes, raw_state_bytes=None):
    """The save summary from the totals (`jaxguard.audit.compression_summary`).

    Args:
      totals: the summed guard stats (`jaxguard.audit.TOTAL_KEYS`).
      container_bytes: the size written.
      raw_state_bytes: the uncompressed state's size (`state_nbytes`), when known.

    Returns:
      `totals` plus ``escape_rate``, ``payload_ratio``, ``container_bytes`` (and
      ``raw_state_bytes``, ``container_ratio``).
    """
    return _audit.compression_summary(totals, container_bytes, raw_state_bytes)


def state_nbytes(tree) -> int:
    """Bytes of all leaves of `tree` held as numpy arrays.

    Args:
      tree: any pytree of arrays or scalars.

    Returns:
      The sum of ``np.asarray(leaf).nbytes``.
    """
    return int(sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(tree)))


def to_bytes(opt_state, params, *, lr=None, weight_decay=None, betas=None, eps=None, spec=None, tau=None, clip=None,
             codec=None, include_params=False, extra_meta=None, op_model=None, tx=None, fixed=None,
             uncertifiable="refuse") -> tuple[bytes, dict]:
    """Container bytes and a summary dict (see `save`; the keywords users pass, for `encode_state`).

    Args:
      opt_state, params, lr, weight_decay, betas, eps, spec, tau, clip, codec, include_params,
        op_model, tx, uncertifiable: as `save`.
      fixed: the next updates resolved already (`optax_state.plan_updates`).
      extra_meta: more keys for the container's meta (e.g. ``{"source": ...}``).

    Returns:
      ``(bytes, summary)``: the whole container and `summary`'s dict (plus ``encode_seconds``).

    Raises:
      ConfigError, CheckpointError, UnsupportedOptimizerError: as `save`.
    """
    update = UpdateRequest(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, op_model=op_model, tx=tx,
                           uncertifiable=uncertifiable)
    return encode_state(opt_state, params, update=update, spec=save_spec(spec, tau=tau, clip=clip, codec=codec),
                        include_params=include_params, extra_meta=extra_meta, fixed=fixed)


def encode_state(opt_state, params, *, update: UpdateRequest | None, spec: GuardSpec, include_params=False,
                 extra_meta=None, fixed=None) -> tuple[bytes, dict]:
    """Container bytes and a summary dict of `opt_state`: `to_bytes` below the public edge.

    Args:
      opt_state, params, include_params: as `save`.
      update: the save's `UpdateRequest` (the next update's hyperparameters, as given).
      spec: the save's `GuardSpec`.
      extra_meta, fixed: as `to_bytes`.

    Returns:
      As `to_bytes`.

    Raises:
      ConfigError, CheckpointError, UnsupportedOptimizerError: as `save`.
    """
    records, smeta = state_records(opt_state, params, update=update, spec=spec, fixed=fixed)
    stored = smeta.pop("stored_exactly")
    meta = {"framework": "optax", "state": smeta, "jax_version": jax.__version__,
            "optax_version": optax.__version__, **(extra_meta or {})}
    if include_params:
        pnames = list(flat_by_dotted(params, "params"))
        records += [_raw(f"params/{name}", leaf) for name, leaf in flat_by_dotted(params, "params").items()]
        meta["params"] = pnames
    data, summary = writer.to_bytes(records, meta, raw_state_bytes=state_nbytes(opt_state))
    summary["stored_exactly"] = stored
    return data, summary


def save(path, opt_state, params=None, *, lr=None, weight_decay=None, betas=None, eps=None, spec=None, tau=None,
         clip=None, codec=None, include_params: bool = False, sharded: bool | None = None, op_model: str | None = None, tx=None,
         uncertifiable: str = "refuse") -> dict:
    """Write `opt_state` to `path` with every Adam ``mu``/``nu`` pair guarded.

    Args:
      opt_state: the optax state (any tree holding `optax.ScaleByAdamState`s), a Flax
        ``nnx.state(optimizer)`` (with ``tx=optimizer.tx``) or a linen ``TrainState``
        (`jaxguard.flax_state`).
      params: the parameter pytree the state belongs to (the next update's ``p``;
        ``nnx.state(model, nnx.Param)`` for NNX; default a ``TrainState``'s own);
        ``include_params=True`` also stores it (needed by ``jaxguard migrate --to torch``).
      tx: the optax transformation the state belongs to (recommended; required with an
        ``nnx.State``, whose optax types are rebuilt from ``tx.init``,
        `jaxguard.flax_state.plain_state`): the next update's
        learning rate and weight decay of every parameter are read from it and the betas,
        eps and update rule checked (`jaxguard.optax_probe`); an Adam variant the op model
        does not cover, or a given value it disagrees with, is refused in one line.
      lr: the next update's learning rate (required without `tx`): a number, the optax
        schedule (evaluated at the Adam state's ``count``), an interval ``(lo, hi)``
        certified for every rate in it, or a pytree prefix of the params of those (one
        rate per subtree, as optax's masks are given).  An `inject_hyperparams` state's
        ``learning_rate`` is the last update's and is not used.  A next rate of 0 stores
        those moments exactly.
      weight_decay: a number, a schedule or a pytree prefix of the params of those.
      betas, eps: the next update's, see the module docstring.
      spec: the guard settings, a `jaxguard.GuardSpec` (tau, clip, codec, and the ablation
        switches bound and partition; default ``GuardSpec()``: tau 0.01, clip 0.2, the
        default codec, shared bound, mixed partition).
      tau, clip, codec: override the spec's field when given.
      sharded: write a checkpoint *directory* instead of one file (default:
        ``jax.process_count() > 1``): every process certifies and writes only its own
        shards and calls `save` with the same `path` (jaxguard.sharded).
      op_model: the optax kernel the run resumes on: ``optax-adam``/``optax-adamw`` (XLA:CPU)
        or ``optax-adam-gpu``/``optax-adamw-gpu`` (XLA:GPU), matching the weight decay.
        None: the GPU model when the Adam moments are `jax.Array`s on a GPU, else the CPU
        one.  The container header records it (``jaxguard inspect`` shows it).
      uncertifiable: ``"refuse"`` (default: moments the guarantee does not cover raise) or
        ``"exact"`` (they are stored exactly, each leaf saying why: bfloat16 parameters,
        an Adam variant `tx` reveals, ``eps_root``; `jaxguard.uncovered`, docs/coverage.md).

    Returns:
      A summary dict: coordinates, escapes, escape_rate, payload_ratio, container_bytes,
      ``stored_exactly`` (``{"param", "why"}`` of the pairs stored exactly), ...

    Raises:
      ConfigError: no ``lr`` and no ``tx`` (one line saying what to pass), a given value
        that `tx` disagrees with (one line naming both), a hyperparameter that is invalid
        in float32 (e.g. a beta that rounds to 1.0), or an `op_model` of torch or of the
        other optimizer (adam vs adamw); nothing is written.
      CheckpointError, UnsupportedOptimizerError: see `state_records`.

    Warns:
      JaxguardWarning: (once) saved without `tx`: nothing was checked against the
        transformation.
    """
    opt_state, params, tx = flax_state.save_inputs(opt_state, params, tx)
    # built once here: the guard settings and the next update as given
    spec = save_spec(spec, tau=tau, clip=clip, codec=codec)
    update = UpdateRequest(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, op_model=op_model, tx=tx,
                           uncertifiable=uncertifiable)
    if sharded or (sharded is None and jax.process_count() > 1):
        return _sharded.save(path, opt_state, params, update=update, spec=spec, include_params=include_params)
    data, s = encode_state(opt_state, params, update=update, spec=spec, include_params=include_params)
    container.atomic_write(path, data)
    return s


# ---------------------------------------------------------------- load
def read(path):
    """Read and verify an optax container.

    Args:
      path: a file or URL written by `save` (one process).

    Returns:
      ``(header, {entry name: array or (m~, v~)})``, every moment entry decoded and its
      decoded hash checked.

    Raises:
      CheckpointError: the container holds another framework's checkpoint.
      ContainerError, ReaderError: the file is not a valid container.
    """
    header, payload, tables = container.read(path, verify_decoded=False)
    meta = header.get("meta") or {}
    if meta.get("framework") != "optax":
        raise CheckpointError(f"{path} holds a {meta.get('framework')!r} checkpoint, not optax state; use "
                              "torch_compat.load, or `jaxguard migrate --to optax` to convert it")
    return header, container.entries_by_name(header, payload, tables, verify_decoded=True)


def _as_dtype(arr, dtype_name):
    if dtype_name == "bfloat16":
        return np.asarray(arr).view(jnp.bfloat16)
    return np.asarray(arr)


def restore_state(header, arrays, like, *, source="the file"):
    """Rebuild the optax state of `like` from a read container.

    Args:
      header, arrays: from `read`.
      like: a state of the same transformation and params (e.g. ``tx.init(params)``):
        its structure, dtypes and, for `jax.Array` leaves, shardings are used.
      source: how to name the checkpoint in errors.

    Returns:
      The restored state (a pytree like `like`).

    Raises:
      CheckpointError: `like` has leaves, shapes or dtypes the container does not hold,
        or lacks leaves it holds.

    Warns:
      JaxguardWarning: `like`'s moments live on another kind of device than the op model
        that certified them (`optax_state.warn_other_platform`).
    """
    meta = header["meta"]
    stored = {leaf["path"]: leaf for leaf in meta["state"]["leaves"]}
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    out = []
    used = set()
    for path, leaf in flat:
        d = dotted(path)
        s = stored_like_leaf(stored, d, leaf, source)
        used.add(d)
        if s["kind"] == "raw":
            val = _as_dtype(arrays[s["entry"]], s["dtype"])
        else:
            m, v = arrays[s["entry"]]
            val = m if s["kind"] == "mu" else v
        val = np.array(val, dtype=val.dtype).reshape(np.shape(leaf))
        if isinstance(leaf, jax.Array):
            val = jax.device_put(val, leaf.sharding)
        elif isinstance(leaf, np.ndarray):
            pass
        elif isinstance(leaf, (bool, int, float)):
            val = type(leaf)(val.item())
        else:
            val = jnp.asarray(val)
        out.append(val)
    extra = sorted(set(stored) - used)
    if extra:
        raise CheckpointError(f"{source} holds {len(extra)} state leaves that like lacks (first {extra[0]!r}); pass "
                              "a state of the same optax transformation as the one saved")
    warn_other_platform(meta["state"].get("sites") or [], like, source)
    return jax.tree_util.tree_unflatten(treedef, out)


def load(path, like, *, tx=None, params=None):
    """Restore the optax state saved at `path` into the structure, dtypes and shardings of `like`.

    `path` is a file (`save`) or a sharded checkpoint directory (``save(..., sharded=True)``
    or any multi-process save), restored in any process count or sharding.

    Args:
      path: the file or directory written by `save`.
      like: a state of the same optax transformation and params (``tx.init(params)``),
        ``nnx.state(optimizer)`` of a fresh optimizer or a linen ``TrainState``.
      tx, params: the transformation the run resumes with and its params: the next update
        they will make (`optax_state.plan_updates` with `tx`) is compared with what every
        moment was certified for (`check_next_update`).

    Returns:
      The restored optax state, with `like`'s structure, dtypes and shardings (an
      ``nnx.State`` for ``nnx.update(optimizer, state)`` when `like` is one).

    Raises:
      CheckpointError: `like` does not match what was saved, or the file is not optax state.
      ConfigError: `tx` without `params`; `tx` will make another update than the one
        certified (one line naming both values).
      ContainerError, ReaderError: the file is damaged.
    """
    if tx is not None and params is None:
        raise ConfigError("jaxguard.load(..., tx=tx) needs params= too (the params the run resumes from): the next "
                          "update is read from tx.update on the restored state and those params")
    view = flax_state.plain_state(like, typed=False, what="like")
    if _sharded.is_sharded(path):
        state = _sharded.load(path, view.state)
        configs = _sharded.certified_configs(path) if tx is not None else None
    else:
        header, arrays = read(path)
        state = restore_state(header, arrays, view.state, source=str(path))
        configs = certified_configs(header) if tx is not None else None
    restored = view.back(state)
    if tx is not None:
        typed, plain_params, _ = flax_state.save_inputs(restored, params, tx, what="like")
        check_next_update(configs, typed, plain_params, tx, source=str(path))
    return restored


def certified_configs(header) -> dict:
    """{param dotted name: the entry config it was certified with} of an optax container.

    Args:
      header: the container header.

    Returns:
      The dict (params stored exactly have none).
    """
    return {e["config"]["param"]: e["config"] for e in header["entries"]
            if e.get("kind") == "moments" and (e.get("config") or {}).get("param")}


def _shown(x):
    """A hyperparameter as a message shows it: floats to 6 significant digits."""
    if isinstance(x, float):
        return f"{x:.6g}"
    if isinstance(x, (list, tuple)):
        return "(" + ", ".join(_shown(v) for v in x) + ")"
    return str(x)


def check_next_update(configs: dict, state, params, tx, *, source="the checkpoint") -> None:
    """Refuse a restore whose next update (read from `tx`, `optax_state.plan_updates`) is
    not the one its moments were certified for: a learning rate outside the certified one
    or interval, another weight decay, betas, eps, step or op model.

    Args:
      configs: {param: certified entry config} (`certified_configs`).
      state, params, tx: the restored state, the params and the transformation.
      source: how to name the checkpoint.

    Raises:
      ConfigError: the first difference, in one line naming both values.
    """
    from jaxguard.core.config import lr_bounds
    for plan in plan_updates(state, params, update=UpdateRequest(tx=tx)):
        for pair, now in plan.pairs:
            cfg = configs.get(pair.param)
            if cfg is None:
                continue
            lo, hi = lr_bounds(tuple(cfg["lr"]) if isinstance(cfg["lr"], list) else cfg["lr"])
            (nlo, nhi) = now.lr_interval
            rate = (nlo + nhi) / 2
            differs = []
            if not lo * (1 - AGREE) <= rate <= hi * (1 + AGREE):
                differs.append(("lr", cfg["lr"], rate))
            want_wd, got_wd = float(cfg.get("weight_decay", 0.0)), now.weight_decay
            if abs(want_wd - got_wd) > (AGREE + 2 * LR_HALF_WIDTH) * max(want_wd, got_wd):   # tx widens its own
                differs.append(("weight_decay", want_wd, got_wd))
            for name, want, got in (("betas", tuple(cfg["betas"]), now.betas), ("eps", cfg["eps"], now.eps),
                                    ("step", cfg["step"], now.step), ("op_model", cfg["op_model"], now.op_model)):
                if (tuple(want) != tuple(got)) if name == "betas" else (want != got):
                    differs.append((name, want, got))
            if differs:
                name, want, got = (_shown(x) for x in differs[0])
                raise ConfigError(f"{source}: the moments of {pair.param!r} were certified for {name}={want} but tx's "
                                  f"next update uses {name}={got}: the tau guarantee does not cover that update; "
                                  "resume with the transformation it was saved with, or save the original state "
                                  "again for this one")


def load_params(path) -> dict:
    """The params stored with ``save(..., include_params=True)``.

    Args:
      path: the file or sharded directory.

    Returns:
      {dotted name: ndarray}.

    Raises:
      CheckpointError: the checkpoint holds no params.
    """
    if _sharded.is_sharded(path):
        man = _sharded.read_manifest(path)
        like = {p["path"]: np.zeros(p["shape"], jnp.bfloat16 if p["dtype"] == "bfloat16" else p["dtype"])
                for p in man.get("params") or []}
        return dict(_sharded.load(path, like, what="params"))
    header, arrays = read(path)
    names = header["meta"].get("params")
    if not names:
        raise CheckpointError(f"{path} holds no params; save with jaxguard.save(..., include_params=True)")
    dts = {e["name"]: e.get("dtype") for e in header["entries"]}
    return {n: np.array(_as_dtype(arrays[f"params/{n}"], dts[f"params/{n}"])) for n in names}


# ---------------------------------------------------------------- first-update audit with real optax


def audit(tx, original, restored, params, *, lr, tau=DEFAULT_TAU, clip=DEFAULT_CLIP, grid=None, random_draws=1, seed=0,
          gradients=()):
    """Run the real jitted ``tx.update`` + ``optax.apply_updates`` from `original` and
    `restored` for every gradient of a grid across ``[-clip, clip]`` (the same g for every
    coordinate) plus `random_draws` per-coordinate uniform draws and every gradient tree in
    `gradients` (e.g. a real loss gradient scaled into ``[-clip, clip]``).

    Args:
      tx: the optax transformation both states belong to.
      original, restored: the saved state and the one `load` gave back.
      params: the params of the next update.
      lr: that update's learning rate (the gap is measured in its units).
      tau, clip: the contract: ``|p_original - p_restored| <= tau * lr`` for ``|g| <= clip``.
      grid: gradient values (default `jaxguard.audit.gradient_grid(clip)`).
      random_draws: per-coordinate uniform draws in ``[-clip, clip]``, seeded by `seed`.
      gradients: further gradient trees (same structure as `params`), applied as given.

    Returns:
      {"max_gap_lr", "violations" (coordinates over tau), "coordinates", "gradients",
      "worst": (g, dotted param) of the largest gap} (`jaxguard.audit.AuditSummary`).
    """
    grid = _audit.gradient_grid(clip) if grid is None else np.asarray(grid, np.float32)

    @jax.jit
    def step(state, g):
        u, _ = tx.update(g, state, params)
        return optax.apply_updates(params, u)

    names = list(flat_by_dotted(params))
    tally = _audit.AuditTally(tau)
    key = jax.random.PRNGKey(seed)
    gs = [(float(g), jax.tree_util.tree_map(lambda p, g=g: jnp.full(jnp.shape(p), g, jnp.float32), params))
          for g in grid]
    leaves, tdef = jax.tree_util.tree_flatten(params)
    for i in range(random_draws):
        ks = jax.random.split(jax.random.fold_in(key, i), len(leaves))
        rnd = [jax.random.uniform(k, jnp.shape(p), jnp.float32, -clip, clip) for k, p in zip(ks, leaves)]
        gs.append(("random", jax.tree_util.tree_unflatten(tdef, rnd)))
    gs.extend((f"given {i}", g) for i, g in enumerate(gradients))
    for gval, g in gs:
        a = flat_by_dotted(step(original, g))
        b = flat_by_dotted(step(restored, g))
        for n in names:
            tally.add(n, a[n], b[n], lr, label=gval)
    return tally.summary(len(gs)).to_json(with_worst=True)
