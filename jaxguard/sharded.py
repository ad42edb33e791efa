"""Sharded checkpoints of optax state: one container per process plus a manifest.

In a multi-process JAX job every process calls ``jaxguard.save(DIR, opt_state, params,
...)`` with the same ``DIR``.  Each process certifies and writes only the shards of its
addressable devices with ``replica_id == 0`` (a replicated leaf is written once, by the
process holding its replica 0); no process gathers a leaf it does not own.  Layout::

    DIR/process_00000.jaxguard   one container v1 (docs/format.md) per process: a moments
    DIR/process_00001.jaxguard   entry per Adam shard ("<leaf>@<start>") and a raw entry per
    ...                          shard of every other leaf, certified shard by shard
    DIR/manifest.json            written last, by the primary process, after a barrier

The manifest holds the tree (dotted leaf paths, global shapes, dtypes), the sites'
guard configurations, every shard's file, global start offset, shape, byte range and
SHA-256, and each file's size and trailing SHA-256.  A checkpoint exists once the
manifest exists (atomic rename): a directory without one is an incomplete save.

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

import dataclasses
import hashlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath

from jaxguard.format import container, reader
from jaxguard import audit, optax_state, writer
from jaxguard.optax_state import NO_ADAM, dtype_name, find_adam_states, flat_by_dotted, moment_pairs
from jaxguard.errors import CheckpointError, ContainerError
from jaxguard.core.guard import DEFAULT_CODEC

MANIFEST = "manifest.json"
SCHEMA = "jaxguard-sharded"
VERSION = 1
INDEX_SUFFIX = ".index.json"
TOTAL_KEYS = audit.TOTAL_KEYS


def file_name(process: int) -> str:
    """Args: process: a process index.  Returns: the name of that process's container file."""
    return f"process_{process:05d}.jaxguard"


def is_sharded(path) -> bool:
    """Whether `path` is a sharded checkpoint.

    Args:
      path: a local path or an epath URL.

    Returns:
      True when `path` is a directory (a sharded checkpoint, complete or not); False for a
      file, a missing path or an unreachable URL.
    """
    try:
        return epath.Path(path).is_dir()
    except Exception:  # noqa: BLE001 - an unreachable URL is not a directory
        return False


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier `name` (nothing with one process).

    Args:
      name: the barrier's name, the same on every process.
    """
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


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
def plan_state(opt_state, params, *, lr=None, tau=0.01, clip=0.2, codec=DEFAULT_CODEC, weight_decay=None,
               betas=None, eps=None, prefix="state"):
    """(sites meta, moment pairs, leaves meta) of `opt_state`: the same roles and entry
    names as `optax_adapter.state_records`, without touching any array's data.

    A moment pair is a dict: entry, mu/nu (leaves), mu_path, nu_path, param (dotted
    name), p (leaf), config (GuardConfig), mu_mode ("coded" | "raw-bfloat16").

    Args:
      opt_state, params, lr, tau, clip, codec, weight_decay, betas, eps: as `jaxguard.save`.
      prefix: the entry-name prefix of the state's leaves.

    Returns:
      ``(sites meta, moment pairs, leaves meta, treedef string)``.

    Raises:
      CheckpointError, UnsupportedOptimizerError, ConfigError: as
        `optax_adapter.state_records` (no Adam state, mismatched params, dtypes, lr).
    """
    hstate = host_scalars(opt_state)
    sites = find_adam_states(hstate)
    if not sites:
        raise CheckpointError(NO_ADAM)
    pflat = flat_by_dotted(params, "params")
    oflat = flat_by_dotted(opt_state, "opt_state")
    roles, pairs, sites_meta = {}, [], []
    for si, site in enumerate(sites):
        cfg = optax_state.site_config(site, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, tau=tau,
                                        clip=clip, codec=codec)
        sites_meta.append({"path": site.name, "config": cfg.to_json(), "count_path": site.leaf_path("count")})
        for pair in moment_pairs(site, pflat):
            mfull, nfull = pair.mu_path, pair.nu_path
            ename = f"{prefix}/moments/{mfull}"
            mode = "coded" if pair.mu_dtype == "float32" else "raw-bfloat16"
            pairs.append({"entry": ename, "mu": oflat[mfull], "nu": oflat[nfull], "p": pair.p, "mu_path": mfull,
                          "nu_path": nfull, "param": pair.param, "config": cfg, "mu_mode": mode, "site": si})
            roles[nfull] = ("nu", ename)
            roles[mfull] = ("mu", ename) if mode == "coded" else ("raw", f"{prefix}/{mfull}")
    leaves = []
    for d, leaf in oflat.items():
        kind, ename = roles.get(d, ("raw", f"{prefix}/{d}"))
        leaves.append({"path": d, "kind": kind, "entry": ename, "dtype": dtype_name(leaf),
                       "shape": list(np.shape(leaf))})
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


def write_bytes_atomic(path: epath.Path, data) -> None:
    """Write `data` to `path` so that a reader sees the old file or the whole new one.

    Local paths: temp file + fsync + rename (container.atomic_write); other epath
    backends: write a temporary name, then rename.

    Args:
      path: the destination.
      data: bytes-like.
    """
    if "://" in str(path):
        tmp = path.parent / f".{path.name}.tmp"
        tmp.write_bytes(bytes(data))
        tmp.rename(path)
    else:
        container.atomic_write(str(path), bytes(data))


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
def make_manifest(directory: epath.Path, common: dict, process_count: int) -> dict:
    """Merge every process's index (``process_*.index.json``) into the manifest dict.

    Args:
      directory: the checkpoint directory.
      common: the shared meta (`common_meta`).
      process_count: how many processes wrote.

    Returns:
      The manifest (files, shards by entry, summed totals under ``"summary"``).

    Raises:
      CheckpointError: a process's index is missing (it did not finish).
    """
    files, shards, totals = {}, {}, audit.new_totals()
    for pid in range(process_count):
        ipath = directory / (file_name(pid) + INDEX_SUFFIX)
        if not ipath.exists():
            raise CheckpointError(f"{ipath} is missing: process {pid} did not finish writing its shards")
        idx = json.loads(ipath.read_text())
        files[idx["file"]] = {"bytes": idx["bytes"], "sha256": idx["sha256"], "tables": idx["tables"]}
        for s in idx["shards"]:
            shards.setdefault(s.pop("entry"), []).append({"file": idx["file"], **s})
        audit.add_stats(totals, {k: idx["totals"].get(k, 0) for k in totals})
    return {"schema": SCHEMA, "version": VERSION, **common, "process_count": process_count, "files": files,
            "shards": shards, "summary": totals}


def commit_manifest(directory: epath.Path, common: dict, process_count: int) -> dict:
    """Write the manifest (the commit point of a sharded save) and remove the per-process indexes.

    Args:
      directory, common, process_count: as `make_manifest`.

    Returns:
      The manifest written.

    Raises:
      CheckpointError: an index is missing, or the shards do not tile every leaf exactly.
    """
    man = make_manifest(directory, common, process_count)
    _check_coverage(man, str(directory))
    write_bytes_atomic(directory / MANIFEST, json.dumps(man, separators=(",", ":")).encode())
    for pid in range(process_count):
        (directory / (file_name(pid) + INDEX_SUFFIX)).unlink(missing_ok=True)
    return man


def _check_coverage(man, source):
    """Every stored leaf is tiled exactly by its shards (sizes add up, nothing outside)."""
    for leaf in man["state"]["leaves"] + (man.get("params") or []):
        recs = man["shards"].get(leaf["entry"], [])
        total = int(np.prod(leaf["shape"], dtype=np.int64))
        got = sum(int(np.prod(r["shape"], dtype=np.int64)) for r in recs)
        if got != total or (total == 0 and not recs):
            raise CheckpointError(f"{source}: the shards of {leaf['path']!r} hold {got} of its {total} elements; "
                                  "the checkpoint is incomplete or two processes wrote the same shard")


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
         "op_model": sites_meta[0]["config"]["op_model"], "tau": tau, "clip": clip, "codec": codec,
         "jax_version": jax.__version__}
    if params_meta:
        c["params"] = params_meta
    return c


def write_process_files(directory: epath.Path, data: bytes, index: dict, process: int) -> None:
    """Write one process's container and its index, each atomically.

    Args:
      directory: the checkpoint directory.
      data, index: from `build_local`.
      process: the process index.
    """
    write_bytes_atomic(directory / file_name(process), data)
    write_bytes_atomic(directory / (file_name(process) + INDEX_SUFFIX), json.dumps(index).encode())


def save(path, opt_state, params, *, lr=None, tau=0.01, clip=0.2, codec=DEFAULT_CODEC, weight_decay=None,
         betas=None, eps=None, include_params=False, primary=0) -> dict:
    """Sharded `jaxguard.save` (module docstring); every process calls it with the same `path`.

    Args:
      path: the checkpoint directory (the same on every process).
      opt_state, params, lr, tau, clip, codec, weight_decay, betas, eps, include_params: as `jaxguard.save`.
      primary: the process that writes host leaves and commits the manifest.

    Returns:
      This process's summary (its share: coordinates, escapes, container_bytes of its
      file, ...) with the whole checkpoint's totals under ``"total"``.

    Raises:
      CheckpointError, UnsupportedOptimizerError, ConfigError: as `jaxguard.save`; a
        file at `path`.
    """
    t0 = time.perf_counter()
    d = epath.Path(path)
    sites_meta, pairs, leaves, treedef = plan_state(opt_state, params, lr=lr, tau=tau, clip=clip, codec=codec,
                                                    weight_decay=weight_decay, betas=betas, eps=eps)
    prepare_directory(d, primary)
    items, totals, _ = encode_local(pairs, leaves, opt_state, params, include_params=include_params,
                                    primary=primary)
    common = common_meta(sites_meta, leaves, treedef, tau=tau, clip=clip, codec=codec,
                         params_meta=param_leaves(params) if include_params else None)
    return write_and_commit(d, items, totals, common, primary=primary, t0=t0)


def prepare_directory(d: epath.Path, primary: int = 0) -> None:
    """Create the directory and remove an old manifest (the checkpoint is incomplete until
    the new one lands), then wait for every process.

    Args:
      d: the checkpoint directory.
      primary: the process that creates it.

    Raises:
      CheckpointError: `d` is a file.
    """
    if d.exists() and not d.is_dir():
        raise CheckpointError(f"{d} is a file; a sharded checkpoint is a directory: pass a new path or remove it")
    if jax.process_index() == primary:
        d.mkdir(parents=True, exist_ok=True)
        (d / MANIFEST).unlink(missing_ok=True)   # overwriting: incomplete until the new manifest lands
    barrier(f"jaxguard_save_begin:{d}")


def write_and_commit(d: epath.Path, items, totals, common, *, primary=0, t0=None) -> dict:
    """Write this process's file and index, barrier, the primary commits the manifest, barrier.

    Args:
      d: the checkpoint directory.
      items, totals: from `encode_local` (or the jitted hook).
      common: from `common_meta`.
      primary: the process that commits.
      t0: when the save started (for ``encode_seconds``).

    Returns:
      As `save`.
    """
    t0 = time.perf_counter() if t0 is None else t0
    pid, n = jax.process_index(), jax.process_count()
    extra = {k: common[k] for k in ("op_model", "tau", "clip", "codec")}
    data, index = build_local(items, totals, process=pid, extra_header=extra)
    write_process_files(d, data, index, pid)
    barrier(f"jaxguard_save_written:{d}")
    if pid == primary:
        commit_manifest(d, common, n)
    barrier(f"jaxguard_save_committed:{d}")
    man = read_manifest(d)
    totals["encode_seconds"] = time.perf_counter() - t0
    s = audit.compression_summary(totals, len(data))
    s.update(process_index=pid, process_count=n, total=man["summary"],
             checkpoint_bytes=sum(f["bytes"] for f in man["files"].values()))
    return s


# ---------------------------------------------------------------- reading
def read_manifest(path) -> dict:
    """The manifest of a sharded checkpoint.

    Args:
      path: the checkpoint directory.

    Returns:
      The manifest dict.

    Raises:
      CheckpointError: no manifest (the save did not complete).
      ContainerError: the manifest is not valid JSON or not of this schema and version.
    """
    d = epath.Path(path)
    mpath = d / MANIFEST
    if not mpath.exists():
        raise CheckpointError(f"{path} has no {MANIFEST}: the sharded save did not complete (or this is not a "
                              "jaxguard checkpoint directory); load an earlier checkpoint")
    try:
        man = json.loads(mpath.read_text())
    except ValueError as exc:
        raise ContainerError(f"{mpath} is not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(man, dict) or man.get("schema") != SCHEMA or man.get("version") != VERSION:
        raise ContainerError(f"{mpath} is not a jaxguard sharded manifest of version {VERSION}")
    return man


class ShardReader:
    """Reads and checks single shards of a sharded checkpoint (seek + read, SHA-256 from the manifest)."""

    def __init__(self, directory, manifest):
        self.dir = epath.Path(directory)
        self.man = manifest
        self._tables = {}
        self.bytes_read = 0

    def _read(self, fname, rng, sha, what):
        if fname not in self.man["files"]:
            raise ContainerError(f"{self.dir}: the manifest names an unknown file {fname!r}")
        b, e = int(rng[0]), int(rng[1])
        with (self.dir / fname).open("rb") as fh:
            fh.seek(b)
            data = fh.read(e - b)
        self.bytes_read += len(data)
        if len(data) != e - b or hashlib.sha256(data).hexdigest() != sha:
            raise ContainerError(f"{self.dir / fname}: {what} does not match the manifest's SHA-256 (corrupt or "
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
        try:
            if h["kind"] == "raw":
                return reader.read_raw(h, memoryview(data))
            return reader.read_moments(h, memoryview(data), self.tables(rec["file"]))
        except reader.ReaderError as exc:
            raise ContainerError(f"{self.dir / rec['file']}: {exc}") from None


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
    stored = {leaf["path"]: leaf for leaf in man["state"]["leaves"]} if what == "state" else \
        {leaf["path"]: {**leaf, "kind": "raw"} for leaf in man.get("params") or []}
    if what == "params" and not stored:
        raise CheckpointError(f"{path} holds no params; save with jaxguard.save(..., include_params=True)")
    source = str(path)
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
    d = epath.Path(path)
    for fname, f in man["files"].items():
        data = (d / fname).read_bytes()
        if len(data) != f["bytes"] or data[-reader.TRAILER:].hex() != f["sha256"]:
            raise ContainerError(f"{d / fname} does not match the manifest (size or SHA-256)")
        try:
            reader.verify_bytes(data)
        except reader.ReaderError as exc:
            raise ContainerError(f"{d / fname}: {exc}") from None
        for recs in man["shards"].values():
            for r in recs:
                if r["file"] == fname and hashlib.sha256(data[r["range"][0]:r["range"][1]]).hexdigest() != r["sha256"]:
                    raise ContainerError(f"{d / fname}: shard {r['name']!r} does not match the manifest")
    _check_coverage(man, str(path))
    return {"ok": True, "files": len(man["files"]), "shards": sum(len(v) for v in man["shards"].values())}
