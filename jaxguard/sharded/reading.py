"""Reading a sharded checkpoint: its shards checked against the manifest's SHA-256 and decoded
with the numpy reader, any slice of a leaf assembled from the shards that overlap it, and the
whole directory verified."""
from __future__ import annotations

__all__ = ["is_sharded", "ShardReader", "certified_configs", "load", "verify"]

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard import optax_state
from jaxguard.errors import CheckpointError, ContainerError
from jaxguard.format import reader, storage
from jaxguard.format.manifest import check_files, element_count, path_text, read_manifest


def is_sharded(path) -> bool:
    """Whether `path` is a sharded checkpoint.

    Args:
      path: a local path or an fsspec URL.

    Returns:
      True when `path` is a directory (a sharded checkpoint, complete or not); False for a
      file, a missing path or an unreachable URL.
    """
    return storage.is_dir(path_text(path))


class ShardReader:
    """Reads and checks single shards of a sharded checkpoint (range reads, SHA-256 from the manifest)."""

    def __init__(self, directory, manifest):
        self.dir = path_text(directory)
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
            reader.check_layout({"entries": [h]}, len(data))   # the header is untrusted: ranges first
            if h["kind"] == "raw":
                out = reader.read_raw(h, memoryview(data))
            else:
                out = reader.read_moments(h, memoryview(data), self.tables(rec["file"]))
        except reader.ReaderError as exc:
            raise ContainerError(f"{storage.join(self.dir, rec['file'])}: {exc}") from None
        n = element_count(rec["shape"], f"{self.dir}: shard {rec['name']!r}")
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
    d = path_text(path)
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
