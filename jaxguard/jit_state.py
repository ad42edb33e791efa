"""A jitted save hook for a whole optax state, per shard, plus its host-side writer.

    k = jg.state_constants(opt_state, params, lr=1e-3, step=t)    # host, no compile
    enc = jg.encode_state_jit(opt_state, params, k, capacity=...)  # inside your jit
    jg.write(path, enc, k)                                         # host, every process

`state_constants` reads the tree once on the host: the Adam sites, their guard
configurations and each moment leaf's `NamedSharding` (mesh and `PartitionSpec`).  It
returns a `StateConstants` pytree whose leaves are the per-site certificate constants
(`GuardConfig.step_row`: lr, step, betas, eps, weight decay, tau as float32) and whose
static part is the layout and the static guard settings; a new step or learning rate
changes only the leaves, so the jitted caller does not retrace.

`encode_state_jit` runs `jit_encode`'s fixed-shape guard on every moment pair with
`jax.shard_map` over the moments' mesh: each device encodes its own block of ``mu``,
``nu`` and ``params`` (no gather; params sharded otherwise are resharded by XLA to the
moments' layout).  Every output array gets a leading axis over the mesh's devices (row
``r`` is ``mesh.devices.flat[r]``'s shard).  Other leaves (``count``, ...) pass through.

`write` turns the result into the sharded checkpoint of jaxguard.sharded (one container
per process, a manifest committed last): for each distinct shard index one device (the
first in mesh order) is written; `jaxguard.load` reads it in any topology.  With enough
`capacity` (every candidate of a shard examined) and no moment below ``2**-80``, the
file decodes to the bits `jaxguard.save(..., sharded=True)` writes for the same state
and shardings (both propose with `codecs.propose` and certify per shard).

Numerical contract
------------------
As `jaxguard.core.jit_encode.encode_jit`, per shard: every coordinate is the saved pair bit
for bit or certified for the next update (``tau * lr`` for every ``|g| <= clip``) with
the constants of the step passed in; `write` refuses a state whose ``count`` is not the
step the constants were built for.
"""
from __future__ import annotations

__all__ = ["state_constants", "encode_state_jit", "write"]

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jaxguard.core import codes, jit_encode
from jaxguard import sharded
from jaxguard import audit, writer
from jaxguard.format import container
from jaxguard.moments import MomentStatic
from jaxguard.optax_state import flat_by_dotted
from jaxguard.errors import CheckpointError, ConfigError, UnsupportedOptimizerError
from jaxguard.core.config import UpdateRequest, save_spec


@jax.tree_util.register_pytree_node_class
class StateConstants:
    """Per-site certificate constants (leaves) and the static plan; `host` (configs of this
    step, the tree's metadata) lives only in the object built by `state_constants`."""

    def __init__(self, k, plan, host=None):
        self.k = tuple(k)
        self.plan = plan
        self.host = host

    def tree_flatten(self):
        return self.k, self.plan

    @classmethod
    def tree_unflatten(cls, plan, leaves):
        return cls(leaves, plan)


@jax.tree_util.register_pytree_node_class
class EncodedState:
    """Output of `encode_state_jit`: ``moments`` {entry: JitEncoded with a leading device
    axis}, ``raw`` {dotted path: leaf} for every other leaf, and the static plan."""

    def __init__(self, moments, raw, plan):
        self.moments, self.raw, self.plan = dict(moments), dict(raw), plan

    def tree_flatten(self):
        mk, rk = tuple(sorted(self.moments)), tuple(sorted(self.raw))
        return (tuple(self.moments[k] for k in mk), tuple(self.raw[k] for k in rk)), (mk, rk, self.plan)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        mk, rk, plan = aux
        return cls(dict(zip(mk, leaves[0])), dict(zip(rk, leaves[1])), plan)


def _layout(x, name):
    if isinstance(x, jax.Array):
        sh = x.sharding
        if isinstance(sh, NamedSharding):
            spec = tuple(sh.spec) + (None,) * (x.ndim - len(sh.spec))
            return sh.mesh, PartitionSpec(*spec)
        if len(sh.device_set) == 1:
            return None, None
        raise ConfigError(f"{name} has a {type(sh).__name__}; encode_state_jit needs a NamedSharding (or a "
                          "single device): place the state with jax.sharding.NamedSharding(mesh, spec)")
    return None, None


def state_constants(opt_state, params, *, lr=None, step=None, weight_decay=None, betas=None, eps=None, spec=None,
                    tau=None, clip=None, codec=None, op_model=None,
                    tx=None) -> StateConstants:
    """Host: the constants and static plan for `encode_state_jit` at one step.

    Args:
      opt_state, params: the state and params (arrays with their shardings; abstract
        shapes are not enough: the Adam sites' hyperparameters are read from the state).
      lr, weight_decay, betas, eps, spec, tau, clip, codec, op_model, tx:
        as `jaxguard.save` (the default op model follows the platform the moments live on;
        pairs whose next learning rate is 0 pass through as raw leaves, stored exactly).
      step: the optax ``count`` of the state that will be encoded (default: the count
        in `opt_state`); a state encoded right after an update has the next count.
    Returns:
      A `StateConstants` to pass to `encode_state_jit` (traced) and to `write` (this
      host object).
    Raises:
      CheckpointError / UnsupportedOptimizerError / ConfigError as `jaxguard.save`;
      bfloat16 ``mu`` is not supported here (use `jaxguard.save`).
    """
    guard = save_spec(spec, tau=tau, clip=clip, codec=codec)
    update = UpdateRequest(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, op_model=op_model, tx=tx)
    state_plan = sharded.plan_state(opt_state, params, update=update, spec=guard)
    sites_meta, leaves, treedef = state_plan.sites, state_plan.leaves, state_plan.treedef
    if step is not None:
        for sm in sites_meta:
            if sm.get("config"):
                sm["config"] = {**sm["config"], "step": int(step)}
    ks, configs, row_of, pair_site = [], [], {}, {}
    plans = []
    for job in state_plan.pairs:
        if job.mu != "coded":
            raise UnsupportedOptimizerError(f"mu of {job.param!r} is bfloat16; encode_state_jit codes float32 mu "
                                            "only: save this state with jaxguard.save")
        cfg = job.config if step is None else dataclasses.replace(job.config, step=int(step))
        key = (job.site, cfg)      # per site: rows of two sites never merge when their rates meet
        if key not in row_of:
            row_of[key] = len(configs)
            configs.append(cfg)
            ks.append(cfg.step_row())
        pair_site[job.name] = job.site
        mesh, spec = _layout(state_plan.flat[job.mu_path], job.mu_path)
        # the jit key: the layout and `cfg.spec`; lr, step, ... are traced in `ks`
        plans.append(dataclasses.replace(job, mesh=mesh, partition_spec=spec).static(row_of[key], cfg))
    host = {"configs": configs, "sites": sites_meta, "pair_sites": pair_site, "leaves": leaves, "treedef": treedef,
            "tau": guard.tau, "clip": guard.clip, "codec": guard.codec}
    return StateConstants(ks, tuple(plans), host)


def _local_size(plan: MomentStatic):
    shape = list(plan.shape)
    for i, ax in enumerate(plan.partition_spec):
        if ax is None:
            continue
        axes = ax if isinstance(ax, tuple) else (ax,)
        parts = int(np.prod([plan.mesh.shape[a] for a in axes]))
        if shape[i] % parts:
            raise ConfigError(f"{plan.mu_path} has dimension {i} of {shape[i]} split over {parts} devices; "
                              "encode_state_jit needs evenly divisible shards")
        shape[i] //= parts
    return int(np.prod(shape, dtype=np.int64))


def _groups(plans):
    """Moment plans grouped by (mesh, site): one guard call per group and device."""
    out = {}
    for pl in plans:
        out.setdefault((pl.mesh, pl.row), []).append(pl)
    return list(out.items())


def _local_shape(plan: MomentStatic):
    if plan.mesh is None:
        return tuple(plan.shape)
    _local_size(plan)
    return tuple(int(s) for s in NamedSharding(plan.mesh, plan.partition_spec).shard_shape(plan.shape))


def _group_offsets(plans):
    """Offsets of each plan's local shard in the group's concatenation (whole blocks each)."""
    offs, o = [], 0
    for pl in plans:
        n = int(np.prod(_local_shape(pl), dtype=np.int64))
        offs.append((o, n))
        o += -(-max(n, 1) // codes.BLOCK) * codes.BLOCK
    return offs, o


def encode_state_jit(opt_state, params, constants: StateConstants, *, capacity: int = 4096,
                     escape_capacity: int | None = None) -> EncodedState:
    """Guarded fixed-shape encoding of every Adam moment pair of `opt_state`, per shard.

    Call it inside your ``jax.jit`` (or eagerly) with the `StateConstants` of the step.
    On each device the local shards of all moment leaves (of one mesh and Adam site) are
    laid side by side, each padded to whole 256-blocks, and guarded in one call: one
    compiled guard whatever the number of leaves, and blocks never straddle leaves, so the
    codes are those of encoding each shard on its own.

    Args:
      opt_state, params: the state and params (traced or concrete), laid out as when
        `state_constants` was built.
      constants: `state_constants(...)` (its leaves are traced: no retrace per step).
      capacity: candidates per device the certificate examines; beyond it they escape.
      escape_capacity: escape buffer per device (default: the local coordinate count,
        never overflows).
    Returns:
      An `EncodedState` pytree (module docstring); pass it to `write` on the host.
    Raises:
      ConfigError: bad capacity, shards not evenly divisible.
    """
    if not isinstance(constants, StateConstants):
        raise ConfigError(f"constants is a {type(constants).__name__}; pass jaxguard.state_constants(...)")
    if not isinstance(capacity, int) or capacity < 1:
        raise ConfigError(f"capacity={capacity!r} must be an int >= 1 (candidates certified per device)")
    oflat = flat_by_dotted(opt_state, "opt_state")
    pflat = flat_by_dotted(params, "params")
    moments, used = {}, set()
    for gi, ((mesh, site), plans) in enumerate(_groups(constants.plan)):
        offs, total = _group_offsets(plans)
        E = max(1, total if escape_capacity is None else int(escape_capacity))
        cfg = plans[0].spec
        args = []
        for pl in plans:
            args += [oflat[pl.mu_path], oflat[pl.nu_path], pflat[pl.param]]
            used.update((pl.mu_path, pl.nu_path))
        k = constants.k[site].as_float32(jnp)

        def body(k, *xs, offs=offs, total=total, cfg=cfg, E=E):
            cols = []
            for j in range(3):
                parts = []
                for i, (o, n) in enumerate(offs):
                    x = jnp.ravel(xs[3 * i + j]).astype(jnp.float32)
                    nxt = offs[i + 1][0] if i + 1 < len(offs) else total
                    parts.append(jnp.concatenate([x, jnp.zeros((nxt - o - n,), jnp.float32)]))
                cols.append(jnp.concatenate(parts))
            sample = np.concatenate([o + jit_encode.sample_positions(n, container.SAMPLE_EVERY) for o, n in offs])
            je = jit_encode.encode_traced(cols[0], cols[1], cols[2], k, cfg, capacity, E, sample=sample)
            return jax.tree_util.tree_map(lambda a: a[None], je)

        if mesh is None:
            je = body(k, *args)
        else:
            specs = tuple(s for pl in plans for s in (pl.partition_spec,) * 3)
            je = jax.shard_map(body, mesh=mesh, in_specs=(PartitionSpec(),) + specs,
                               out_specs=PartitionSpec(tuple(mesh.axis_names)), check_vma=False)(k, *args)
        moments[f"group{gi}"] = je
    raw = {d: x for d, x in oflat.items() if d not in used}
    return EncodedState(moments, raw, constants.plan)


def _writer_rows(plan: MomentStatic):
    """{device: (row, global start)} of the devices that write a distinct shard index
    (the first device in mesh order holding it)."""
    devs = list(plan.mesh.devices.flat)
    idx = NamedSharding(plan.mesh, plan.partition_spec).devices_indices_map(plan.shape)
    seen, out = set(), {}
    for r, d in enumerate(devs):
        key = tuple((s.start, s.stop) for s in idx[d])
        if key in seen:
            continue
        seen.add(key)
        out[d] = (r, sharded.shard_start(idx[d], len(plan.shape)))
    return out


def write(path, encoded: EncodedState, constants: StateConstants, *, primary: int = 0) -> dict:
    """Host: write the output of `encode_state_jit` as a sharded checkpoint directory.

    Every process calls it with the same `path`; each writes the shards of its devices.

    Args:
      path: a directory (local or an fsspec URL), read back with `jaxguard.load`.
      encoded: the `EncodedState` returned by the jitted step (concrete arrays).
      constants: the host `StateConstants` from `state_constants` for that step.
    Returns:
      This process's summary (coordinates, escapes, container_bytes, ..., ``total``).
    Raises:
      CheckpointError: constants from another step or plan; escape buffers overflowed.
    """
    if not isinstance(encoded, EncodedState):
        raise ConfigError(f"encoded is a {type(encoded).__name__}; pass the result of jaxguard.encode_state_jit")
    if not isinstance(constants, StateConstants) or constants.host is None:
        raise ConfigError("constants must be the StateConstants built on the host by jaxguard.state_constants "
                          "(the copy traced through jit has no configurations)")
    if encoded.plan != constants.plan:
        raise CheckpointError("encoded was built with other constants (another tree, sharding or guard setting); "
                              "pass the state_constants used for this encode_state_jit call")
    host = constants.host
    for pl in constants.plan:
        sm, cfg = host["sites"][host["pair_sites"][pl.entry]], host["configs"][pl.row]
        cnt = encoded.raw.get(sm["count_path"])
        if cnt is not None and int(np.asarray(sharded.host_scalar(cnt))) != cfg.step:
            raise CheckpointError(f"the state's {sm['count_path']} is {int(np.asarray(sharded.host_scalar(cnt)))} "
                                  f"but the constants certify step {cfg.step}; build state_constants(..., "
                                  "step=<the count of the encoded state>)")
    d = str(path)
    sharded.prepare_directory(d, primary)
    items = []
    totals = audit.new_totals()
    me = jax.process_index()
    for gi, ((mesh, site), plans) in enumerate(_groups(constants.plan)):
        je = encoded.moments[f"group{gi}"]
        offs, _ = _group_offsets(plans)
        cfg = host["configs"][site]
        shards = {k: {s.device: s.data for s in a.addressable_shards} for k, a in je.arrays.items()}
        starts = np.cumsum([0] + [jit_encode.sample_positions(n, container.SAMPLE_EVERY).size for _, n in offs])
        for pl, (o, n), s0, s1 in zip(plans, offs, starts[:-1], starts[1:]):
            if mesh is None:
                dev = next(iter(shards["m_codes"]))
                writers = {dev: (0, (0,) * len(pl.shape))} if dev.process_index == me else {}
            else:
                writers = {d_: rs for d_, rs in _writer_rows(pl).items() if d_.process_index == me}
            info = {**cfg.to_json(), "mu_mode": "coded", "param": pl.param}
            for dev, (_, start) in writers.items():
                a = {k: np.asarray(shards[k][dev])[0] for k in je.arrays}
                if int(a["overflow"]):
                    raise ConfigError(f"{int(a['escape_count'])} coordinates escape on {dev} but escape_capacity is "
                                      f"{a['escape_index'].size}; call encode_state_jit with a larger escape_capacity "
                                      "(or the default)")
                idx = a["escape_index"][:int(a["escape_count"])]
                sel = (idx >= o) & (idx < o + n)
                b0, nb = o // codes.BLOCK, codes.num_blocks(n)
                arrays = {"m_codes": a["m_codes"][o:o + n], "v_codes": a["v_codes"][o:o + n],
                          "m_params": a["m_params"][b0:b0 + nb], "v_params": a["v_params"][b0:b0 + nb],
                          "escape_index": (idx[sel] - o).astype(np.int32),
                          "escape_m": a["escape_m"][:idx.size][sel], "escape_v": a["escape_v"][:idx.size][sel],
                          "escape_count": np.int32(sel.sum()), "overflow": np.int32(0)}
                enc = jit_encode.to_encoded(jit_encode.JitEncoded(arrays, je.codec, _local_shape(pl)))
                # what this device's program certified, at the blocks the container writer checks
                enc.decoded = {"positions": jit_encode.sample_positions(n, container.SAMPLE_EVERY),
                               "m": a["sample_m"][s0:s1], "v": a["sample_v"][s0:s1]}
                items.append((pl.entry, start, writer.Moments("", enc, info)))
    for path_, leaf in encoded.raw.items():
        entry = next(lf["entry"] for lf in host["leaves"] if lf["path"] == path_)
        for _, start, data in sharded.local_shards(leaf, primary):
            arr = np.asarray(data)
            items.append((entry, start, writer.Raw("", arr, container.numpy_dtype_name(arr))))
    common = sharded.common_meta(host["sites"], host["leaves"], host["treedef"], tau=host["tau"],
                                 clip=host["clip"], codec=host["codec"])
    return sharded.write_and_commit(d, items, totals, common, primary=primary)
