"""Sharded checkpoints of optax state: one container per process plus a manifest.

In a multi-process JAX job every process calls ``jaxguard.save(DIR, opt_state, params,
...)`` with the same ``DIR``.  Each process certifies and writes only the shards of its
addressable devices with ``replica_id == 0`` (a replicated leaf is written once, by the
process holding its replica 0); no process gathers a leaf it does not own.  Layout::

    DIR/process_00000.<SAVE>.jaxguard   one container v1 (docs/format.md) per process: a
    DIR/process_00001.<SAVE>.jaxguard   moments entry per Adam shard ("<leaf>@<start>") and
    ...                                 a raw entry per shard of every other leaf
    DIR/manifest.json                   written last, by the primary process, in one atomic
                                        replace (one PUT on an object store)

``SAVE`` is the save's id (`new_save_id`: 16 hex digits of the primary's clock in ns and 8
random ones, broadcast to every process), so a save never overwrites a file that the
committed manifest names: the previous checkpoint stays whole until the new manifest
replaces it, whatever happens to the save (a killed process, a full disk, an exception in
one process).  After the replace the primary removes the files no manifest names any more
(the previous save's, and the leftovers of interrupted saves that started earlier).  The
manifest holds the tree (dotted leaf paths, global shapes, dtypes), the sites' guard
configurations, every shard's file, global start offset, shape, byte range and SHA-256,
and each file's size and trailing SHA-256.  A checkpoint exists once the manifest exists:
a directory without one, or whose manifest names a missing or short file, is refused.
Directories of the older layout (``process_00000.jaxguard``, no save id) load as before.

`load(DIR, like)` rebuilds `like`'s tree with `like`'s shardings, in any process count
or mesh: each process reads (with seeks) and checks only the shards that overlap its
addressable devices' slices, decodes them with the numpy reader and assembles its slices
(`jax.make_array_from_callback`).  Each shard decodes to fixed bits, so the restored
values do not depend on the topology that loads them; how a leaf was blocked (256-blocks
run over each shard's row-major coordinates) depends on the writer's sharding.

Numerical contract
------------------
As `jaxguard.optax_adapter`: every Adam coordinate is certified in its shard against the
same coordinate of ``params`` (brought to the moments' sharding first), so the first
update after `load` is within ``tau * lr`` of the saved state's for every ``|g| <= clip``;
every other leaf is restored bit-exactly.
"""
from __future__ import annotations

__all__ = ["MANIFEST", "INDEX_SUFFIX", "file_name", "new_save_id", "is_sharded", "host_scalar",
           "host_scalars", "shard_start", "local_shards", "plan_state", "build_local", "encode_local",
           "param_leaves", "commit_manifest", "remove_unnamed", "check_files", "first_op_model",
           "common_meta", "write_process_files", "remove_process_files", "save", "prepare_directory",
           "write_and_commit", "read_manifest", "certified_configs", "load", "verify"]

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import secrets
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard.format import container, reader, storage
from jaxguard import audit, optax_state, writer
from jaxguard.optax_state import NO_ADAM, dtype_name, find_adam_states, flat_by_dotted, moment_pairs
from jaxguard.errors import CheckpointError, ContainerError
from jaxguard.core.config import GuardConfig, save_spec

MANIFEST = "manifest.json"
SCHEMA = "jaxguard-sharded"
VERSION = 1
INDEX_SUFFIX = ".index.json"
TOTAL_KEYS = audit.TOTAL_KEYS


MAX_MANIFEST_BYTES = 1 << 30
MAX_ELEMENTS = 1 << 48      # per leaf: more is no real array, only a manifest that would make us allocate it
_SAVE_ID = re.compile(r"^[0-9a-f]{24}$")
# a process file or its index (either layout), or the temporary name storage writes it under
_OWNED = re.compile(r"^\.?process_(\d{5})(?:\.([0-9a-f]{24}))?\.jaxguard(?:\.index\.json)?(?:\.[0-9a-f]+\.tmp)?$")
_FILE = re.compile(r"^process_\d{5}(?:\.[0-9a-f]{24})?\.jaxguard$")
_MANIFEST_TMP = re.compile(r"^\.manifest\.json\.[0-9a-f]+\.tmp$")


def file_name(process: int, save_id: str | None = None) -> str:
    """The name of one process's container file.

    Args:
      process: a process index.
      save_id: the save's id (`new_save_id`); None gives the older layout's name.

    Returns:
      ``process_NNNNN.<save_id>.jaxguard`` (``process_NNNNN.jaxguard`` without an id).
    """
    return f"process_{process:05d}.jaxguard" if save_id is None else f"process_{process:05d}.{save_id}.jaxguard"


def new_save_id(primary: int = 0) -> str:
    """A fresh save id, the same on every process: the primary's clock (ns, 16 hex digits)
    and 8 random hex digits, broadcast from the primary (a collective: every process calls it).

    Random, not derived from the step or the old manifest: two jobs saving to one path
    must not pick the same file names.  The clock prefix orders saves by start, so a commit
    removes only the leftovers of saves that started before it.

    Args:
      primary: the process whose id every process takes.

    Returns:
      24 lowercase hex digits.
    """
    sid = f"{time.time_ns():016x}{secrets.token_hex(4)}"
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        words = np.frombuffer(bytes.fromhex(sid), dtype="<u4").copy()
        got = multihost_utils.broadcast_one_to_all(words, is_source=jax.process_index() == primary)
        sid = np.asarray(got).astype("<u4").tobytes().hex()
    return sid


def _dir(path) -> str:
    return os.fspath(path) if isinstance(path, os.PathLike) else str(path)


def is_sharded(path) -> bool:
    """Whether `path` is a sharded checkpoint.

    Args:
      path: a local path or an fsspec URL.

    Returns:
      True when `path` is a directory (a sharded checkpoint, complete or not); False for a
      file, a missing path or an unreachable URL.
    """
    return storage.is_dir(_dir(path))


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (nothing with one process).

    Args:
      name: the barrier's name, the same on every process.
    """
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


def failed_processes(ok: bool) -> list:
    """Every process says whether its step succeeded; all learn who failed (a collective).

    Args:
      ok: this process's outcome.

    Returns:
      The sorted indexes of the processes that passed ``ok=False`` (empty: all succeeded).
    """
    if jax.process_count() == 1:
        return [] if ok else [0]
    from jax.experimental import multihost_utils
    flags = np.asarray(multihost_utils.process_allgather(np.array([1 if ok else 0], np.int32))).reshape(-1)
    return [i for i, f in enumerate(flags.tolist()) if not f]


# ---------------------------------------------------------------- host views of global arrays
def host_scalar(x):
    """A 0-d leaf as a host value; a global (non fully addressable) scalar reads its local copy.

    Args:
      x: any leaf.

    Returns:
      A numpy scalar array for a global 0-d `jax.Array`, else `x` unchanged.
    """
    if isinstance(x, jax.Array) and x.ndim == 0 and not x.is_fully_addressable:
        return np.asarray(x.addressable_data(0))
    return x


def host_scalars(tree):
    """Args: tree: any pytree.  Returns: `tree` with `host_scalar` applied to every leaf."""
    return jax.tree_util.tree_map(host_scalar, tree)


def shard_start(index, ndim) -> tuple:
    """The global offset of a shard from its index (a tuple of slices).

    Args:
      index: a shard's ``index`` (slices per leading dimension; ``None`` starts are 0).
      ndim: the array's rank (missing trailing dimensions start at 0).

    Returns:
      The start offset per dimension, a tuple of ``ndim`` ints.
    """
    return tuple(0 if s.start is None else int(s.start) for s in index) + (0,) * (ndim - len(index))


def local_shards(x, primary=0):
    """The replica-0 shards of `x` this process holds.

    Args:
      x: a `jax.Array`, or a host (numpy / Python) leaf: one shard, written by the primary.
      primary: the process that writes host leaves.

    Returns:
      [(device or None, global start index, host array)].
    """
    if isinstance(x, jax.Array):
        return [(s.device, shard_start(s.index, x.ndim), s.data) for s in x.addressable_shards if s.replica_id == 0]
    if jax.process_index() == primary:
        a = np.asarray(x)
        return [(None, (0,) * a.ndim, a)]
    return []


def aligned(x, like):
    """`x` laid out like `like` ({device: shard array}), or a host array when `like` is one.

    Differently sharded inputs are copied to `like`'s sharding with a jitted identity (a
    collective: every process reaches it in the same order, as it walks the same tree).

    Args:
      x: the array to lay out (a `jax.Array` or host array of `like`'s shape).
      like: the reference layout (a `jax.Array`, or a host leaf).

    Returns:
      {device: shard data} of `x` in `like`'s sharding, or a numpy array when `like` is on the host.
    """
    if not isinstance(like, jax.Array):
        return np.asarray(host_scalar(x)) if isinstance(x, jax.Array) and x.ndim == 0 else np.asarray(x)
    if not isinstance(x, jax.Array):
        host = np.asarray(x)
        x = jax.make_array_from_callback(like.shape, like.sharding, lambda idx: host[idx])
    elif not x.sharding.is_equivalent_to(like.sharding, like.ndim):
        x = jax.jit(lambda a: a, out_shardings=like.sharding)(x)
    return {s.device: s.data for s in x.addressable_shards}


# ---------------------------------------------------------------- plan (what every leaf becomes)
def plan_state(opt_state, params, *, lr=None, weight_decay=None, betas=None, eps=None, spec=None, prefix="state",
               op_model=None, tx=None, fixed=None, uncertifiable="refuse"):
    """(sites meta, moment pairs, leaves meta) of `opt_state`: the same roles and entry
    names as `optax_adapter.state_records`, without touching any array's data.

    A moment pair is a dict: entry, mu/nu (leaves), mu_path, nu_path, param (dotted
    name), p (leaf), config (GuardConfig), mu_mode ("coded" | "raw-bfloat16"), site (its
    Adam site's index).  A pair whose next learning rate is 0 is no pair: its mu and nu
    are raw leaves, stored exactly (their leaf records say why).

    Args:
      opt_state, params, lr, weight_decay, betas, eps, op_model, tx, uncertifiable: as
        `jaxguard.save`.
      spec: the save's `GuardSpec` (`jaxguard.core.config.save_spec`).
      prefix: the entry-name prefix of the state's leaves.
      fixed: the next updates resolved already (`optax_state.plan_updates`).

    Returns:
      ``(sites meta, moment pairs, leaves meta, treedef string)``; the leaf record of a
      moment stored exactly says why (``"why"``).

    Raises:
      CheckpointError, UnsupportedOptimizerError, ConfigError: as
        `optax_adapter.state_records` (no Adam state, mismatched params, dtypes, lr).
    """
    spec = save_spec(spec)
    hstate = host_scalars(opt_state)
    sites = find_adam_states(hstate)
    if not sites:
        raise CheckpointError(NO_ADAM)
    plans = optax_state.plan_updates(opt_state, params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                                     op_model=op_model, tx=tx, sites=sites, fixed=fixed, uncertifiable=uncertifiable)
    oflat = flat_by_dotted(opt_state, "opt_state")
    exact = optax_state.exact_reasons(plans)
    roles, pairs, sites_meta = {}, [], []
    for si, plan in enumerate(plans):
        sites_meta.append({**plan.meta(spec), "count_path": plan.site.leaf_path("count")})
        for pair, update in plan.pairs:
            mfull, nfull = pair.mu_path, pair.nu_path
            if update.stores_exactly:
                roles[mfull] = roles[nfull] = ("raw", None)
                continue
            ename = f"{prefix}/moments/{mfull}"
            mode = "coded" if pair.mu_dtype == "float32" else "raw-bfloat16"
            pairs.append({"entry": ename, "mu": oflat[mfull], "nu": oflat[nfull], "p": pair.p, "mu_path": mfull,
                          "nu_path": nfull, "param": pair.param, "config": GuardConfig.from_update(spec, update),
                          "mu_mode": mode, "site": si})
            roles[nfull] = ("nu", ename)
            roles[mfull] = ("mu", ename) if mode == "coded" else ("raw", f"{prefix}/{mfull}")
    leaves = []
    for d, leaf in oflat.items():
        kind, ename = roles.get(d, ("raw", f"{prefix}/{d}"))
        rec = {"path": d, "kind": kind, "entry": ename or f"{prefix}/{d}", "dtype": dtype_name(leaf),
               "shape": list(np.shape(leaf))}
        if d in exact:
            rec["why"] = exact[d]
        leaves.append(rec)
    treedef = jax.tree_util.tree_structure(opt_state)
    return sites_meta, pairs, leaves, str(treedef)


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
    for pr in pairs:
        mu = pr["mu"]
        nu_s, p_s = aligned(pr["nu"], mu), aligned(pr["p"], mu)
        for dev, start, mdata in local_shards(mu, primary):
            if dev is None:
                nd, pd = nu_s, p_s
            else:
                nd, pd = nu_s[dev], p_s[dev]
            m, v, p = np.asarray(mdata), np.asarray(nd), np.asarray(pd)
            if pr["mu_mode"] == "coded":
                coded.append((pr["entry"], start, writer.MomentJob(pr["entry"], m, v, p, pr["config"],
                                                                   {"param": pr["param"]})))
            else:
                items.append((f"state/{pr['mu_path']}", start, writer.Raw("", m, "bfloat16")))
                m32 = np.asarray(jnp.asarray(m).astype(jnp.float32))
                items.append((pr["entry"], start, writer.MomentJob(pr["entry"], m32, v, p, pr["config"],
                                                                   {"param": pr["param"]}, mu="exact")))
        done.update({pr["mu_path"], pr["nu_path"]})
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


# ---------------------------------------------------------------- manifest
def _index_name(process, save_id):
    return file_name(process, save_id) + INDEX_SUFFIX


def make_manifest(directory, common: dict, process_count: int, save_id: str | None = None) -> dict:
    """Merge every process's index of save `save_id` into the manifest dict.

    Args:
      directory: the checkpoint directory.
      common: the shared meta (`common_meta`).
      process_count: how many processes wrote.
      save_id: the save's id (None: the older layout's names).

    Returns:
      The manifest (save_id, files, shards by entry, summed totals under ``"summary"``).

    Raises:
      CheckpointError: a process's index is missing (it did not finish).
    """
    d = _dir(directory)
    files, shards, totals = {}, {}, audit.new_totals()
    for pid in range(process_count):
        ipath = storage.join(d, _index_name(pid, save_id))
        if not storage.exists(ipath):
            raise CheckpointError(f"{ipath} is missing: process {pid} did not finish writing its shards")
        idx = json.loads(bytes(storage.read_bytes(ipath)))
        files[idx["file"]] = {"bytes": idx["bytes"], "sha256": idx["sha256"], "tables": idx["tables"]}
        for sh in idx["shards"]:
            shards.setdefault(sh.pop("entry"), []).append({"file": idx["file"], **sh})
        audit.add_stats(totals, {k: idx["totals"].get(k, 0) for k in totals})
    man = {"schema": SCHEMA, "version": VERSION, **common, "process_count": process_count, "files": files,
           "shards": shards, "summary": totals}
    if save_id is not None:
        man["save_id"] = save_id
    return man


def _current_save_id(d):
    """The save id of the manifest at `d` now ("" for an older-layout one, None for none or unreadable)."""
    try:
        man = json.loads(bytes(storage.read_bytes(storage.join(d, MANIFEST))))
        return str(man.get("save_id") or "") if isinstance(man, dict) else None
    except Exception:  # noqa: BLE001 - a missing or broken manifest is no committed save
        return None


def commit_manifest(directory, common: dict, process_count: int, save_id: str | None = None) -> dict:
    """Publish a sharded save: check it, replace ``manifest.json`` in one atomic write (the
    commit point), then remove the per-process indexes and every file no manifest names.

    Args:
      directory, common, process_count, save_id: as `make_manifest`.

    Returns:
      The manifest written.

    Raises:
      CheckpointError: an index or file is missing, the shards do not tile every leaf, or a
        save that started later has already committed to this path (this one is dropped,
        that checkpoint kept).
      ContainerError: the manifest could not be written (the previous one is intact).
    """
    d = _dir(directory)
    man = make_manifest(d, common, process_count, save_id)
    _check_coverage(man, d)
    with _commit_lock(d):   # two jobs: check, replace and clean up one after the other
        check_files(man, d)
        cur = _current_save_id(d)
        if save_id is not None and cur and cur > save_id:
            raise CheckpointError(f"{d}: a save that started later ({cur}) committed to this path while this one "
                                  f"({save_id}) ran; this save is dropped and that checkpoint kept")
        storage.atomic_write(storage.join(d, MANIFEST), json.dumps(man, separators=(",", ":")).encode())
        for pid in range(process_count):
            try:
                storage.remove(storage.join(d, _index_name(pid, save_id)))
            except Exception:  # noqa: BLE001 - committed: a stale index is only garbage for the next save
                pass
        if save_id is not None:
            remove_unnamed(d, save_id)
    return man


@contextlib.contextmanager
def _commit_lock(d):
    """An exclusive lock on a local checkpoint directory's commit step (``flock`` on the
    directory itself: no file is added, and the lock is released when the process dies,
    so a killed primary never blocks the next save).  Without it,
    a save that checked the manifest just before another job replaced it and removed the
    older save's files could publish a manifest naming removed files.  fsspec URLs have
    no such lock: one job per path there (docs/format.md)."""
    if storage.is_url(d):
        yield
        return
    import fcntl
    fd = os.open(storage.local_path(d), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_unnamed(directory, save_id: str) -> list:
    """Remove what the manifest of save `save_id` has made garbage: process files, indexes
    and temporary files of the older layout and of every save that started before it, and
    temporary manifests.  Files of a save that started later (still running) stay.

    Args:
      directory: the checkpoint directory.
      save_id: the id of the save whose manifest was just committed.

    Returns:
      The names removed.
    """
    d = _dir(directory)
    gone = []
    for name in storage.listdir(d):
        m = _OWNED.match(name)
        if m:
            sid = m.group(2)
            if sid is not None and (sid > save_id or (sid == save_id and not name.startswith("."))):
                continue
        elif not _MANIFEST_TMP.match(name):
            continue
        try:
            storage.remove(storage.join(d, name))
            gone.append(name)
        except Exception:  # noqa: BLE001 - a file another cleaner removed first
            pass
    return gone


def check_files(man, directory) -> None:
    """Every file the manifest names is there, with the size it records.

    Args:
      man: a manifest (`read_manifest`).
      directory: the checkpoint directory.

    Raises:
      CheckpointError: one line naming the first missing or short file.
    """
    d = _dir(directory)
    for fname, f in man["files"].items():
        p = storage.join(d, fname)
        try:
            got = storage.size(p)
        except (FileNotFoundError, ContainerError):
            got = None
        except OSError:
            got = None
        if got is None:
            raise CheckpointError(f"{d}: {fname}, named by {MANIFEST}, is missing: the checkpoint is incomplete "
                                  "(a partial copy, or its files were removed); load an earlier checkpoint")
        if got != f["bytes"]:
            raise CheckpointError(f"{d}: {fname} holds {got} bytes where {MANIFEST} records {f['bytes']}: the "
                                  "file is truncated or replaced; load an earlier checkpoint")


def _leaf_elements(leaf, source):
    return _prod(leaf["shape"], f"{source}: leaf {leaf['path']!r}")


def _prod(shape, what):
    n = 1
    for x in shape:
        n *= x
    if n > MAX_ELEMENTS:
        raise ContainerError(f"{what} has shape {list(shape)} ({n} elements, over {MAX_ELEMENTS}); the manifest "
                             "is corrupt")
    return n


def _check_coverage(man, source):
    """Every stored leaf is tiled exactly by its shards (sizes add up, nothing outside)."""
    for leaf in man["state"]["leaves"] + (man.get("params") or []):
        recs = man["shards"].get(leaf["entry"], [])
        total = _leaf_elements(leaf, source)
        got = 0
        for r in recs:
            if len(r["start"]) != len(leaf["shape"]) or len(r["shape"]) != len(leaf["shape"]) or any(
                    a + n > m for a, n, m in zip(r["start"], r["shape"], leaf["shape"])):
                raise ContainerError(f"{source}: shard {r['name']!r} lies outside {leaf['path']!r} (shape "
                                     f"{leaf['shape']}); the manifest is corrupt")
            got += _prod(r["shape"], f"{source}: shard {r['name']!r}")
        if got != total or (total == 0 and not recs):
            raise CheckpointError(f"{source}: the shards of {leaf['path']!r} hold {got} of its {total} elements; "
                                  "the checkpoint is incomplete or two processes wrote the same shard")


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


def write_process_files(directory, data: bytes, index: dict, process: int, save_id: str | None = None) -> None:
    """Write one process's container and its index, each atomically, under the save's names.

    Args:
      directory: the checkpoint directory.
      data, index: from `build_local`.
      process: the process index.
      save_id: the save's id (`new_save_id`); None writes the older layout's names.

    Raises:
      ContainerError: a write failed (one line, e.g. a full disk); nothing the manifest names is touched.
    """
    d = _dir(directory)
    fname = file_name(process, save_id)
    storage.atomic_write(storage.join(d, fname), data)
    storage.atomic_write(storage.join(d, fname + INDEX_SUFFIX), json.dumps({**index, "file": fname}).encode())


def remove_process_files(directory, process: int, save_id: str) -> None:
    """Remove one process's file and index of save `save_id` (a save that failed), best effort.

    Args:
      directory: the checkpoint directory.
      process: the process index.
      save_id: the failed save's id.
    """
    d = _dir(directory)
    for name in (file_name(process, save_id), file_name(process, save_id) + INDEX_SUFFIX):
        try:
            storage.remove(storage.join(d, name))
        except Exception:  # noqa: BLE001 - cleaning up after a failure must not hide it
            pass


def save(path, opt_state, params, *, lr=None, weight_decay=None, betas=None, eps=None, spec=None, tau=None, clip=None,
         codec=None, bound=None, partition=None, include_params=False, primary=0, op_model=None, tx=None,
         uncertifiable="refuse") -> dict:
    """Sharded `jaxguard.save` (module docstring); every process calls it with the same `path`.

    Args:
      path: the checkpoint directory (the same on every process).
      opt_state, params, lr, weight_decay, betas, eps, spec, tau, clip, codec, bound, partition,
        include_params, op_model, tx, uncertifiable: as `jaxguard.save`.
      primary: the process that writes host leaves and commits the manifest.

    Returns:
      This process's summary (its share: coordinates, escapes, container_bytes of its
      file, ...) with the whole checkpoint's totals under ``"total"``.

    Raises:
      CheckpointError, UnsupportedOptimizerError, ConfigError: as `jaxguard.save`; a
        file at `path`.
    """
    t0 = time.perf_counter()
    d = _dir(path)
    spec = save_spec(spec, tau=tau, clip=clip, codec=codec, bound=bound, partition=partition)
    sites_meta, pairs, leaves, treedef = plan_state(opt_state, params, lr=lr, weight_decay=weight_decay, betas=betas,
                                                    eps=eps, spec=spec, op_model=op_model, tx=tx,
                                                    uncertifiable=uncertifiable)
    prepare_directory(d, primary)
    try:
        items, totals, _ = encode_local(pairs, leaves, opt_state, params, include_params=include_params,
                                        primary=primary)
    except jax.errors.JaxRuntimeError as exc:   # a collective of the certification failed: a process died
        raise CheckpointError(f"{d}: a collective failed while certifying the shards ({_first_line(exc)}); another "
                              "process of this job probably stopped; nothing was written, the previous "
                              "checkpoint there is kept") from None
    common = common_meta(sites_meta, leaves, treedef, tau=spec.tau, clip=spec.clip, codec=spec.codec,
                         params_meta=param_leaves(params) if include_params else None)
    return write_and_commit(d, items, totals, common, primary=primary, t0=t0)


def prepare_directory(d, primary: int = 0) -> None:
    """Create the directory (the previous checkpoint in it, if any, is left as it is: a
    save writes new names and commits by replacing the manifest), then wait for every process.

    Args:
      d: the checkpoint directory.
      primary: the process that creates it.

    Raises:
      CheckpointError: `d` is a file.
    """
    d = _dir(d)
    if storage.exists(d) and not storage.is_dir(d):
        raise CheckpointError(f"{d} is a file; a sharded checkpoint is a directory: pass a new path or remove it")
    if jax.process_index() == primary:
        storage.mkdir(d)
    try:
        barrier(f"jaxguard_save_begin:{d}")
    except jax.errors.JaxRuntimeError as exc:   # a process died before the save began
        raise CheckpointError(f"{d}: another process of this job stopped before the save began "
                              f"({str(exc).strip().splitlines()[0][:160] if str(exc).strip() else exc!r}); "
                              "nothing was written, the previous checkpoint there is kept") from None


def _first_line(exc) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:160] if text else ''}"


def write_and_commit(d, items, totals, common, *, primary=0, t0=None, save_id=None) -> dict:
    """Write this process's file and index under a fresh save id, agree that every process
    wrote, the primary commits the manifest, agree that it did.

    A process whose write fails raises its own error; every other process raises one
    `CheckpointError` line naming it; the files of the failed save are removed and the
    previous checkpoint at `d` is untouched.

    Args:
      d: the checkpoint directory.
      items, totals: from `encode_local` (or the jitted hook).
      common: from `common_meta`.
      primary: the process that commits.
      t0: when the save started (for ``encode_seconds``).
      save_id: the save's id (default: `new_save_id`, a collective).

    Returns:
      As `save`.

    Raises:
      CheckpointError, ContainerError: this or another process could not write or commit.
    """
    d = _dir(d)
    t0 = time.perf_counter() if t0 is None else t0
    pid, n = jax.process_index(), jax.process_count()
    try:
        sid = save_id or new_save_id(primary)
    except jax.errors.JaxRuntimeError as exc:   # the broadcast failed: a process died before writing
        raise CheckpointError(f"{d}: another process of this job stopped before the save began writing "
                              f"({_first_line(exc)}); nothing was written, the previous checkpoint there is "
                              "kept") from None
    extra = {k: common[k] for k in ("op_model", "tau", "clip", "codec")}
    err, data = None, b""
    try:
        data, index = build_local(items, totals, process=pid, extra_header=extra)
        write_process_files(d, data, index, pid, sid)
    except Exception as exc:  # noqa: BLE001 - every process must learn of it before anyone commits
        err = exc
    try:
        failed = failed_processes(err is None)
    except Exception as exc:  # noqa: BLE001 - a process of the job died: the collective fails
        remove_process_files(d, pid, sid)
        raise CheckpointError(f"{d}: another process of this job stopped before every shard was written "
                              f"({_first_line(exc)}); nothing was committed, the previous checkpoint there is "
                              "kept") from None
    if failed:
        remove_process_files(d, pid, sid)
        if err is not None:
            raise err
        raise CheckpointError(f"{d}: process{'es' if len(failed) > 1 else ''} {', '.join(map(str, failed))} could "
                              "not write its shards; nothing was committed, the previous checkpoint there is kept")
    man = None
    if pid == primary:
        try:
            man = commit_manifest(d, common, n, sid)
        except Exception as exc:  # noqa: BLE001 - as above
            err = exc
    try:
        failed = failed_processes(err is None)
    except Exception as exc:  # noqa: BLE001 - as above; the primary may have committed
        if man is None:   # files stay (the primary may still be committing); the next save removes them
            raise CheckpointError(f"{d}: another process of this job stopped while the primary committed "
                                  f"({_first_line(exc)}); `jaxguard.load` gives the last committed checkpoint") from None
        failed = []
    if failed:
        remove_process_files(d, pid, sid)
        if err is not None:
            raise err
        raise CheckpointError(f"{d}: the primary process {primary} could not commit {MANIFEST}; nothing was "
                              "committed, the previous checkpoint there is kept")
    if man is None:
        man = read_manifest(d)
        if man.get("save_id") != sid:
            raise CheckpointError(f"{d}: {MANIFEST} is another save's ({man.get('save_id')}) right after this one "
                                  f"({sid}) committed; two jobs are saving to this path")
    totals["encode_seconds"] = time.perf_counter() - t0
    s = audit.compression_summary(totals, len(data))
    s.update(process_index=pid, process_count=n, total=man["summary"], save_id=sid,
             checkpoint_bytes=sum(f["bytes"] for f in man["files"].values()))
    return s


# ---------------------------------------------------------------- reading
def read_manifest(path) -> dict:
    """The manifest of a sharded checkpoint, checked as untrusted input (`validate_manifest`).

    Args:
      path: the checkpoint directory.

    Returns:
      The manifest dict.

    Raises:
      CheckpointError: no manifest (the save did not complete).
      ContainerError: the manifest is too large, not valid JSON, not of this schema and
        version, or malformed (one line naming the field).
    """
    d = _dir(path)
    mpath = storage.join(d, MANIFEST)
    if not storage.exists(mpath):
        raise CheckpointError(f"{d} has no {MANIFEST}: the sharded save did not complete (or this is not a "
                              "jaxguard checkpoint directory); load an earlier checkpoint")
    n = storage.size(mpath)
    if n > MAX_MANIFEST_BYTES:
        raise ContainerError(f"{mpath} is {n} bytes, more than a manifest may be ({MAX_MANIFEST_BYTES}); "
                             "it is not a jaxguard manifest")
    return parse_manifest(bytes(storage.read_bytes(mpath)), mpath)


def parse_manifest(data: bytes, source: str = MANIFEST) -> dict:
    """Parse and check manifest bytes (`validate_manifest`).

    Args:
      data: the bytes of a ``manifest.json``.
      source: what to name in errors.

    Returns:
      The manifest dict.

    Raises:
      ContainerError: one line naming what is wrong.
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise ContainerError(f"{source} is {len(data)} bytes, more than a manifest may be ({MAX_MANIFEST_BYTES})")
    try:
        man = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:   # bad UTF-8/JSON, huge ints, deep nesting
        raise ContainerError(f"{source} is not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(man, dict) or man.get("schema") != SCHEMA or man.get("version") != VERSION:
        raise ContainerError(f"{source} is not a jaxguard sharded manifest of version {VERSION}")
    validate_manifest(man, source)
    return man


def _int(x, lo=0, hi=1 << 62):
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _bad(source, what):
    return ContainerError(f"{source}: {what}; the manifest is corrupt or not jaxguard's")


def _check_leaf(leaf, source, raw_only):
    if not isinstance(leaf, dict) or not isinstance(leaf.get("path"), str) or not isinstance(leaf.get("entry"), str):
        raise _bad(source, f"a leaf record {str(leaf)[:80]} has no string path and entry")
    shape = leaf.get("shape")
    if not isinstance(shape, list) or len(shape) > 32 or not all(_int(x, 0, MAX_ELEMENTS) for x in shape):
        raise _bad(source, f"leaf {leaf['path'][:80]!r} has an invalid shape {str(shape)[:80]}")
    _prod(shape, f"{source}: leaf {leaf['path'][:80]!r}")
    kind = "raw" if raw_only else leaf.get("kind")
    if kind not in ("mu", "nu", "raw"):
        raise _bad(source, f"leaf {leaf['path'][:80]!r} has unknown kind {str(kind)[:40]!r}")
    if not isinstance(leaf.get("dtype"), str) or leaf["dtype"] not in reader.DTYPES:
        raise _bad(source, f"leaf {leaf['path'][:80]!r} has unsupported dtype {str(leaf.get('dtype'))[:40]!r}")


def _check_range(rng, size, what, source):
    if not isinstance(rng, list) or len(rng) != 2 or not _int(rng[0]) or not _int(rng[1]) or \
            not rng[0] <= rng[1] <= size:
        raise _bad(source, f"{what} has byte range {str(rng)[:60]} outside its file of {size} bytes")


def validate_manifest(man: dict, source: str = MANIFEST) -> None:
    """Check a parsed manifest before anything is allocated or opened from it: file names
    (no paths), sizes, byte ranges inside their files, leaf shapes and dtypes, shard
    placements inside their leaves, and that the shards tile every leaf.

    Args:
      man: the parsed JSON object.
      source: what to name in errors.

    Raises:
      ContainerError: one line naming the first bad field.
      CheckpointError: the shards do not tile a leaf (an incomplete checkpoint).
    """
    files = man.get("files")
    if not isinstance(files, dict) or not files:
        raise _bad(source, "'files' is not a non-empty object")
    for fname, f in files.items():
        if not _FILE.match(fname):
            raise _bad(source, f"file name {fname[:80]!r} is not a process file name")
        if not isinstance(f, dict) or not _int(f.get("bytes")) or not isinstance(f.get("sha256"), str):
            raise _bad(source, f"file {fname!r} has no byte count and SHA-256")
        tables = f.get("tables") or {}
        if not isinstance(tables, dict):
            raise _bad(source, f"file {fname!r} has 'tables' that is not an object")
        for k, t in tables.items():
            if not isinstance(t, dict) or not isinstance(t.get("sha256"), str):
                raise _bad(source, f"table {k[:40]!r} of {fname!r} has no SHA-256")
            _check_range(t.get("range"), f["bytes"], f"table {k[:40]!r} of {fname!r}", source)
            if t["range"][1] - t["range"][0] != 4 * reader.spec.TABLE_SIZE:
                raise _bad(source, f"table {k[:40]!r} of {fname!r} is not {reader.spec.TABLE_SIZE} float32")
    state = man.get("state")
    if not isinstance(state, dict) or not isinstance(state.get("leaves"), list):
        raise _bad(source, "'state' has no 'leaves' list")
    params = man.get("params") or []
    if not isinstance(params, list):
        raise _bad(source, "'params' is not a list")
    for leaf in state["leaves"]:
        _check_leaf(leaf, source, False)
    for leaf in params:
        _check_leaf(leaf, source, True)
    shards = man.get("shards")
    if not isinstance(shards, dict):
        raise _bad(source, "'shards' is not an object")
    for entry, recs in shards.items():
        if not isinstance(recs, list):
            raise _bad(source, f"the shards of {entry[:80]!r} are not a list")
        for r in recs:
            if not isinstance(r, dict) or not isinstance(r.get("name"), str) or not isinstance(r.get("file"), str) \
                    or r["file"] not in files \
                    or not isinstance(r.get("sha256"), str) or not isinstance(r.get("header"), dict):
                raise _bad(source, f"a shard of {entry[:80]!r} lacks a name, a listed file, a SHA-256 or a header")
            for k in ("start", "shape"):
                v = r.get(k)
                if not isinstance(v, list) or len(v) > 32 or not all(_int(x, 0, MAX_ELEMENTS) for x in v):
                    raise _bad(source, f"shard {r['name'][:80]!r} has an invalid {k} {str(v)[:60]}")
            _check_range(r.get("range"), files[r["file"]]["bytes"], f"shard {r['name'][:80]!r}", source)
    if not _int(man.get("process_count"), 1, 1 << 20):
        raise _bad(source, f"process_count {str(man.get('process_count'))[:40]} is not a positive count")
    if "save_id" in man and not (isinstance(man["save_id"], str) and _SAVE_ID.match(man["save_id"])):
        raise _bad(source, f"save_id {str(man['save_id'])[:40]!r} is not 24 hex digits")
    if not isinstance(man.get("summary", {}), dict):
        raise _bad(source, "'summary' is not an object")
    _check_coverage(man, source)


class ShardReader:
    """Reads and checks single shards of a sharded checkpoint (range reads, SHA-256 from the manifest)."""

    def __init__(self, directory, manifest):
        self.dir = _dir(directory)
        self.man = manifest
        self._tables = {}
        self.bytes_read = 0

    def _read(self, fname, rng, sha, what):
        if fname not in self.man["files"]:
            raise ContainerError(f"{self.dir}: the manifest names an unknown file {fname!r}")
        b, e = int(rng[0]), int(rng[1])
        path = storage.join(self.dir, fname)
        data = storage.read_range(path, b, e)
        self.bytes_read += len(data)
        if len(data) != e - b or hashlib.sha256(data).hexdigest() != sha:
            raise ContainerError(f"{path}: {what} does not match the manifest's SHA-256 (corrupt or "
                                 "truncated file)")
        return data

    def tables(self, fname):
        """Args: fname: a process file.  Returns: its decode tables {name: float32 array}, read once."""
        if fname not in self._tables:
            t = self.man["files"][fname].get("tables") or {}
            self._tables[fname] = {k: np.frombuffer(self._read(fname, r["range"], r["sha256"], f"table {k}"),
                                                    "<f4").astype(np.float32) for k, r in t.items()}
        return self._tables[fname]

    def decode(self, rec):
        """The shard's array (raw) or (m~, v~) (moments), as the numpy reader decodes it.

        Args:
          rec: the shard's manifest record.

        Returns:
          An array, or the pair ``(m~, v~)``.

        Raises:
          ContainerError: the bytes do not match the manifest or do not decode.
        """
        data = self._read(rec["file"], rec["range"], rec["sha256"], f"shard {rec['name']!r}")
        h = rec["header"]
        if not all(isinstance(h.get(k, ""), str) for k in ("kind", "dtype", "codec", "name")):
            raise ContainerError(f"{self.dir}: shard {rec['name']!r} has a header with non-string fields; the "
                                 "manifest is corrupt")
        try:
            reader._check_layout({"entries": [h]}, len(data))   # the header is untrusted: ranges first
            if h["kind"] == "raw":
                out = reader.read_raw(h, memoryview(data))
            else:
                out = reader.read_moments(h, memoryview(data), self.tables(rec["file"]))
        except reader.ReaderError as exc:
            raise ContainerError(f"{storage.join(self.dir, rec['file'])}: {exc}") from None
        n = _prod(rec["shape"], f"{self.dir}: shard {rec['name']!r}")
        if any(np.size(x) != n for x in (out if isinstance(out, tuple) else (out,))):
            raise ContainerError(f"{storage.join(self.dir, rec['file'])}: shard {rec['name']!r} decodes to another "
                                 f"size than its shape {rec['shape']}; the manifest is corrupt")
        return out


def _overlap(rec, lo, hi):
    a = [max(int(s), l) for s, l in zip(rec["start"], lo)]
    b = [min(int(s) + int(n), h) for s, n, h in zip(rec["start"], rec["shape"], hi)]
    return (a, b) if all(x < y for x, y in zip(a, b)) else None


class _Assembler:
    """Builds any slice of a stored leaf from the shards that overlap it; caches decoded
    shards for the leaves of one entry (mu and nu share a moments entry)."""

    def __init__(self, rd: ShardReader):
        self.rd = rd
        self.cache = {}

    def slice(self, leaf, index):
        shape = tuple(leaf["shape"])
        index = tuple(index) + (slice(None),) * (len(shape) - len(tuple(index)))
        lo = [sl.indices(n)[0] for sl, n in zip(index, shape)]
        hi = [sl.indices(n)[1] for sl, n in zip(index, shape)]
        out_shape = tuple(h - l for l, h in zip(lo, hi))
        is_bf16 = leaf["dtype"] == "bfloat16" and leaf["kind"] == "raw"
        out = np.empty(out_shape, np.uint16 if is_bf16 else np.dtype(leaf["dtype"] if leaf["kind"] == "raw"
                                                                      else "float32"))
        filled = 0
        for i, rec in enumerate(self.rd.man["shards"].get(leaf["entry"], [])):
            ov = _overlap(rec, lo, hi) if shape else ((), ())
            if ov is None:
                continue
            key = (leaf["entry"], i)
            if key not in self.cache:
                self.cache[key] = self.rd.decode(rec)
            val = self.cache[key]
            if isinstance(val, tuple) != (leaf["kind"] != "raw"):
                raise ContainerError(f"{self.rd.dir}: shard {rec['name']!r} is {'a moments' if isinstance(val, tuple) else 'a raw'} "
                                     f"entry but {leaf['path']!r} is a {leaf['kind']} leaf; the manifest is corrupt")
            if leaf["kind"] == "mu":
                val = val[0]
            elif leaf["kind"] == "nu":
                val = val[1]
            a, b = ov
            src = tuple(slice(x - int(s), y - int(s)) for x, y, s in zip(a, b, rec["start"]))
            dst = tuple(slice(x - l, y - l) for x, y, l in zip(a, b, lo))
            out[dst] = np.asarray(val).reshape(rec["shape"])[src]
            filled += int(np.prod([y - x for x, y in zip(a, b)], dtype=np.int64))
        if filled != out.size:
            raise ContainerError(f"{self.rd.dir}: the shards of {leaf['path']!r} cover {filled} of the {out.size} "
                                 "elements requested; the checkpoint is incomplete")
        return out.view(jnp.bfloat16) if is_bf16 else out

    def drop(self, entry):
        for k in [k for k in self.cache if k[0] == entry]:
            del self.cache[k]


def _sharding_of(leaf):
    if isinstance(leaf, jax.Array):
        return leaf.sharding
    if isinstance(leaf, jax.ShapeDtypeStruct) and getattr(leaf, "sharding", None) is not None:
        return leaf.sharding
    return None


def certified_configs(path) -> dict:
    """{param dotted name: the entry config its shards were certified with} of a sharded
    checkpoint (`jaxguard.optax_adapter.certified_configs` for a directory).

    Args:
      path: the checkpoint directory.

    Returns:
      The dict (moments stored exactly have none).
    """
    out = {}
    for shards in read_manifest(path)["shards"].values():
        for sh in shards:
            cfg = (sh.get("header") or {}).get("config") or {}
            if sh.get("header", {}).get("kind") == "moments" and cfg.get("param"):
                out.setdefault(cfg["param"], cfg)
    return out


def load(path, like, *, what="state"):
    """Restore a sharded checkpoint into `like`'s structure, dtypes and shardings.

    `like` leaves may be `jax.Array`s or `jax.ShapeDtypeStruct`s with a sharding (each
    process reads only the shards overlapping its addressable devices' slices), numpy
    arrays or Python scalars (read whole).

    Args:
      path: the checkpoint directory.
      like: the tree to restore into.
      what: ``"state"`` or ``"params"`` (stored with ``include_params=True``).

    Returns:
      The restored tree.

    Raises:
      CheckpointError: `like` does not match what was stored, or no params were stored.
      ContainerError: a file or shard is damaged.
    """
    man = read_manifest(path)
    check_files(man, path)
    stored = {leaf["path"]: leaf for leaf in man["state"]["leaves"]} if what == "state" else \
        {leaf["path"]: {**leaf, "kind": "raw"} for leaf in man.get("params") or []}
    if what == "params" and not stored:
        raise CheckpointError(f"{path} holds no params; save with jaxguard.save(..., include_params=True)")
    source = str(path)
    if what == "state":
        optax_state.warn_other_platform(man["state"].get("sites") or [], like, source)
    flat, treedef = jax.tree_util.tree_flatten_with_path(like)
    asm = _Assembler(ShardReader(path, man))
    paths = [optax_state.dotted(p) for p, _ in flat]
    for d, (_, leaf) in zip(paths, flat):
        optax_state.stored_like_leaf(stored, d, leaf, source)   # presence, shape and dtype
    extra = sorted(set(stored) - set(paths))
    if extra:
        raise CheckpointError(f"{source} holds {len(extra)} leaves that like lacks (first {extra[0]!r}); pass a "
                              "state of the same optax transformation as the one saved")
    # mu and nu of one entry are restored one after the other, so one decode serves both
    order = sorted(range(len(flat)), key=lambda i: (stored[paths[i]]["entry"], i))
    out = [None] * len(flat)
    for pos, i in enumerate(order):
        leaf, s = flat[i][1], stored[paths[i]]
        sh = _sharding_of(leaf)
        if sh is not None:
            val = jax.make_array_from_callback(tuple(s["shape"]), sh, lambda idx, s=s: asm.slice(s, idx))
        else:
            full = asm.slice(s, ())
            if isinstance(leaf, np.ndarray):
                val = full
            elif isinstance(leaf, (bool, int, float)):
                val = type(leaf)(full.item())
            else:
                val = jnp.asarray(full)
        out[i] = val
        if pos + 1 == len(order) or stored[paths[order[pos + 1]]]["entry"] != s["entry"]:
            asm.drop(s["entry"])
    return jax.tree_util.tree_unflatten(treedef, out)


def verify(path) -> dict:
    """Full check of a sharded checkpoint: every file's trailing SHA-256 against the manifest
    (`reader.verify_bytes`: envelope, checksums, layout, decoded hash), every shard's range.

    Args:
      path: the checkpoint directory.

    Returns:
      {"ok": True, "files", "shards"}.

    Raises:
      ContainerError: a file or shard does not match the manifest.
      CheckpointError: the shards do not tile every leaf, or no manifest.
    """
    man = read_manifest(path)
    d = _dir(path)
    check_files(man, d)
    for fname, f in man["files"].items():
        p = storage.join(d, fname)
        data = storage.read_bytes(p)
        if len(data) != f["bytes"] or bytes(data[-reader.TRAILER:]).hex() != f["sha256"]:
            raise ContainerError(f"{p} does not match the manifest (size or SHA-256)")
        try:
            reader.verify_bytes(data)
        except reader.ReaderError as exc:
            raise ContainerError(f"{p}: {exc}") from None
        for recs in man["shards"].values():
            for r in recs:
                if r["file"] == fname and hashlib.sha256(data[r["range"][0]:r["range"][1]]).hexdigest() != r["sha256"]:
                    raise ContainerError(f"{p}: shard {r['name']!r} does not match the manifest")
    return {"ok": True, "files": len(man["files"]), "shards": sum(len(v) for v in man["shards"].values()),
            "save_id": man.get("save_id")}
