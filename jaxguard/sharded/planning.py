"""Planning a sharded save: what every leaf of an optax state becomes (a moment pair certified
per shard, or a raw leaf), each process's shard records, and the container bytes and index of
its file.  `plan_local` is the entry the sharded save, the orbax handler and the jitted hook share."""
from __future__ import annotations

__all__ = ["StatePlan", "LocalSave", "plan_state", "plan_local", "encode_local", "build_local", "param_leaves",
           "first_op_model", "common_meta"]

import dataclasses
import hashlib
import json
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard import audit, optax_state, writer
from jaxguard.core.config import UpdateRequest, save_spec
from jaxguard.format import container, reader
from jaxguard.format.manifest import file_name
from jaxguard.optax_state import NO_ADAM, dtype_name, find_adam_states, flat_by_dotted
from jaxguard.errors import CheckpointError
from jaxguard.sharded.processes import aligned, host_scalars, local_shards


# ---------------------------------------------------------------- plan (what every leaf becomes)
class StatePlan(NamedTuple):
    """What every leaf of an optax state becomes (`plan_state`); no array's data is read."""
    sites: list       # one meta dict per Adam site (its next update, its guard config, its count's path)
    pairs: list       # the moment pairs certified per shard (`jaxguard.moments.MomentJob`, whole leaves)
    leaves: list      # one record per state leaf: path, kind (mu / nu / raw), entry, dtype, shape[, why]
    treedef: str      # the state's tree structure
    flat: dict        # {dotted path: leaf} of the state


@dataclasses.dataclass
class LocalSave:
    """One process's share of a sharded save, ready to write (`plan_local`)."""
    items: list       # [(entry, global start, writer record)] for `build_local`
    totals: dict      # this process's totals, zeroed (`build_local` adds to them)
    common: dict      # the meta every process's file and the manifest share (`common_meta`)

    @property
    def header(self) -> dict:
        """The top-level header fields of this process's container (op_model, tau, clip, codec)."""
        return {k: self.common[k] for k in ("op_model", "tau", "clip", "codec")}


def plan_state(opt_state, params, *, update: UpdateRequest | None = None, spec=None, prefix="state", fixed=None):
    """(sites meta, moment pairs, leaves meta) of `opt_state`, from the walk every writer
    shares (`optax_state.lay_out`), without touching any array's data.

    A moment pair is a `jaxguard.moments.MomentJob` on the whole leaves (its GuardConfig,
    entry, mu mode, paths, Adam site).  A pair whose next learning rate is 0 is no pair: its mu and nu
    are raw leaves, stored exactly (their leaf records say why).

    Args:
      opt_state, params: as `jaxguard.save`.
      update: the save's `UpdateRequest` (lr, weight_decay, betas, eps, op_model, tx,
        uncertifiable as `jaxguard.save`).
      spec: the save's `GuardSpec` (`jaxguard.core.config.save_spec`).
      prefix: the entry-name prefix of the state's leaves.
      fixed: the next updates resolved already (`optax_state.plan_updates`).

    Returns:
      A `StatePlan` (sites meta, moment pairs, leaves meta, treedef string, leaves by
      dotted path); the leaf record of a moment stored exactly says why (``"why"``).

    Raises:
      CheckpointError, UnsupportedOptimizerError, ConfigError: as
        `optax_adapter.state_records` (no Adam state, mismatched params, dtypes, lr).
    """
    spec = save_spec(spec)
    sites = find_adam_states(host_scalars(opt_state))
    if not sites:
        raise CheckpointError(NO_ADAM)
    lay = optax_state.lay_out(opt_state, params, spec=spec, update=update, prefix=prefix, sites=sites, fixed=fixed)
    sites_meta = [{**plan.meta(spec), "count_path": plan.site.leaf_path("count")} for plan in lay.plans]
    return StatePlan(sites_meta, lay.coded, lay.leaves, lay.treedef, lay.flat)


def plan_local(plan: StatePlan, opt_state, params, *, spec, include_params=False, primary=0) -> LocalSave:
    """This process's shard records and the save's shared meta: the planner's entry for every
    writer of a sharded directory (`jaxguard.sharded.save`, the orbax handler).

    Args:
      plan: from `plan_state` of the same trees.
      opt_state, params: the trees `plan` was made from.
      spec: the save's `GuardSpec` (its tau, clip and codec go into the meta).
      include_params: also store the params' shards (and their leaf records).
      primary: the process that writes host leaves.

    Returns:
      A `LocalSave`.

    Raises:
      jax.errors.JaxRuntimeError: a collective of the certification failed (a process died).
    """
    items, totals, _ = encode_local(plan.pairs, plan.leaves, opt_state, params, include_params=include_params,
                                    primary=primary)
    common = common_meta(plan.sites, plan.leaves, plan.treedef, tau=spec.tau, clip=spec.clip, codec=spec.codec,
                         params_meta=param_leaves(params) if include_params else None)
    return LocalSave(items, totals, common)


# ---------------------------------------------------------------- writing one process's file
def _shard_name(entry, start):
    return f"{entry}@{','.join(str(s) for s in start)}"


def _entry_range(e):
    rngs = [e["offsets"]] if e["kind"] == "raw" else list(e["sections"].values())
    return min(r[0] for r in rngs), max(r[1] for r in rngs)


def _rebased(e, b):
    e = json.loads(json.dumps(e))
    if e["kind"] == "raw":
        e["offsets"] = [e["offsets"][0] - b, e["offsets"][1] - b]
    else:
        e["sections"] = {k: [r[0] - b, r[1] - b] for k, r in e["sections"].items()}
    return e


def _renamed(record, name):
    return dataclasses.replace(record, name=name) if isinstance(record, writer.MomentJob) else record._replace(name=name)


def build_local(items, totals, *, process, extra_header):
    """Encode one process's shards (the one writer, `jaxguard.writer`) and build its
    container bytes and index (per shard: global placement, byte range, SHA-256).

    Args:
      items: [(entry, start, record)]: a writer record (`MomentJob`, `Raw`, or an
        encoded `Moments`) per shard, renamed here to the shard's entry name.
      totals: this process's totals (`jaxguard.writer.new_totals()`), added to in place
        and stored in the index.
      process: this process's index (names the file).
      extra_header: top-level header fields (op_model, tau, clip, codec).

    Returns:
      ``(container bytes, index dict)``.
    """
    records, placement = [], {}
    for entry, start, record in items:
        name = _shard_name(entry, start)
        records.append(_renamed(record, name))
        placement[name] = (entry, list(start))
    meta = {"framework": "optax-shards", "process": process,
            "shards": [{"name": n, "entry": e, "start": s} for n, (e, s) in placement.items()]}
    data, summ = writer.to_bytes(records, meta, extra_header=extra_header)
    audit.add_stats(totals, summ)
    _, _, _, hlen = reader.PREFIX.unpack_from(data, 0)
    header = json.loads(bytes(data[reader.PREFIX.size:reader.PREFIX.size + hlen]))
    base = reader.PREFIX.size + hlen
    view = memoryview(data)
    shards = []
    for e in header["entries"]:
        b, end = _entry_range(e)
        entry, start = placement[e["name"]]
        shards.append({"entry": entry, "start": start, "shape": e["shape"], "name": e["name"],
                       "range": [base + b, base + end], "sha256": hashlib.sha256(view[base + b:base + end]).hexdigest(),
                       "header": _rebased(e, b)})
    tables = {k: {"range": [base + r[0], base + r[1]],
                  "sha256": hashlib.sha256(view[base + r[0]:base + r[1]]).hexdigest()}
              for k, r in header.get("tables", {}).items()}
    index = {"file": file_name(process), "bytes": len(data), "sha256": data[-reader.TRAILER:].hex(),
             "shards": shards, "tables": tables, "totals": totals}
    return data, index


def encode_local(pairs, leaves, opt_state, params, *, include_params=False, primary=0):
    """This process's shard records: every replica-0 shard it holds (moment pairs as
    `MomentJob`s against the same shard of their parameter, other leaves `Raw`); the
    encoding itself happens in `build_local`.

    Args:
      pairs, leaves: from `plan_state`.
      opt_state, params: the trees `plan_state` was given.
      include_params: also store the params' shards.
      primary: the process that writes host leaves.

    Returns:
      ``(items for build_local, zeroed totals, param names)``.
    """
    oflat = flat_by_dotted(opt_state, "opt_state")
    items, coded = [], []     # float32 pairs after the bfloat16-mu ones (the order files have always had)
    done = set()
    for job in pairs:
        mu = oflat[job.mu_path]
        nu_s, p_s = aligned(oflat[job.nu_path], mu), aligned(job.p, mu)
        for dev, start, mdata in local_shards(mu, primary):
            if dev is None:
                nd, pd = nu_s, p_s
            else:
                nd, pd = nu_s[dev], p_s[dev]
            m, v, p = np.asarray(mdata), np.asarray(nd), np.asarray(pd)
            if job.mu == "coded":
                coded.append((job.name, start, job.with_arrays(m, v, p)))
            else:
                items.append((job.raw_entry, start, writer.Raw("", m, "bfloat16")))
                items.append((job.name, start, job.with_arrays(np.asarray(jnp.asarray(m).astype(jnp.float32)), v, p)))
        done.update({job.mu_path, job.nu_path})
    items += coded
    for leaf in leaves:
        if leaf["path"] in done:
            continue
        for _, start, data in local_shards(oflat[leaf["path"]], primary):
            arr = np.asarray(data)
            items.append((leaf["entry"], start, writer.Raw("", arr, container.numpy_dtype_name(arr))))
    param_names = []
    if include_params:
        for name, x in flat_by_dotted(params, "params").items():
            param_names.append(name)
            for _, start, data in local_shards(x, primary):
                arr = np.asarray(data)
                items.append((f"params/{name}", start, writer.Raw("", arr, container.numpy_dtype_name(arr))))
    return items, audit.new_totals(), param_names


def param_leaves(params) -> list:
    """The manifest records of `params`' leaves (metadata only, no data is read).

    Args:
      params: the params pytree saved beside the optimizer state.

    Returns:
      One dict per leaf in flattening order: ``path`` (dotted), ``entry``
      (``"params/<path>"``, the container entry), ``dtype`` (name) and ``shape`` (list).
    """
    return [{"path": n, "entry": f"params/{n}", "dtype": dtype_name(x), "shape": list(np.shape(x))}
            for n, x in flat_by_dotted(params, "params").items()]


def first_op_model(sites_meta):
    """The op model the header names: the first site's with a certified pair.

    Args:
      sites_meta: from `plan_state`.

    Returns:
      The op model, or None when every moment is stored exactly.
    """
    return next((sm["config"]["op_model"] for sm in sites_meta if sm.get("config")), None)


def common_meta(sites_meta, leaves, treedef, *, tau, clip, codec, params_meta=None):
    """The meta every process's file and the manifest share.

    Args:
      sites_meta, leaves, treedef: from `plan_state`.
      tau, clip, codec: the save's contract and codec.
      params_meta: the params' leaf records, when they are stored.

    Returns:
      {"framework": "optax", "state", "op_model", "tau", "clip", "codec", "jax_version"[, "params"]}.
    """
    c = {"framework": "optax", "state": {"leaves": leaves, "sites": sites_meta, "treedef": treedef},
         "op_model": first_op_model(sites_meta), "tau": tau, "clip": clip, "codec": codec,
         "jax_version": jax.__version__}
    if params_meta:
        c["params"] = params_meta
    return c
