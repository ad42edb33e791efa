"""Reading a DCP directory's ``.metadata`` and jaxguard manifest as untrusted input.

torch's ``FileSystemReader.read_metadata`` is a plain ``pickle.load`` of ``.metadata``: a
directory handed in by someone else runs whatever code its pickle names.  `load_metadata`
unpickles it with only the classes a DCP save writes (the metadata dataclasses, torch
dtypes, ``torch.Size``, layouts, memory formats, ``TorchVersion``, paths) and checks the
structure jaxguard and torch read (counts, offsets, lengths, file names) before anything
is read; `check_manifest` does the same for the jaxguard manifest in its planner data.
Every refusal is one `CheckpointError` line naming the file and the field.
"""
from __future__ import annotations

__all__ = ["load_metadata", "check_manifest"]

import io
import math
import os
import pathlib
import pickle
import pickletools

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from jaxguard.errors import CheckpointError
from jaxguard.format.manifest import check_tiling, is_count, is_counts

MAX_METADATA_BYTES = 1 << 31
_MD_CLASSES = {"Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
               "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"}
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
            ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
            ("torch", "Size"): torch.Size,
            ("torch.torch_version", "TorchVersion"): torch.torch_version.TorchVersion,
            ("pathlib", "PosixPath"): pathlib.PosixPath, ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
            ("pathlib", "WindowsPath"): pathlib.PureWindowsPath, ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
            ("collections", "OrderedDict"): dict}


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        if module == "torch.distributed.checkpoint.metadata" and name in _MD_CLASSES:
            return getattr(_md, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        raise pickle.UnpicklingError(f"names {module}.{name}, which a DCP save never writes")


def _show(x) -> str:
    """A short text of `x`; a mutated dataclass may lack the fields its repr reads."""
    try:
        return str(x)[:60]
    except Exception:  # noqa: BLE001
        return f"a malformed {type(x).__name__}"


def _paths_ok(paths) -> bool:
    """Planner paths (tuples of str keys / int list indices) build one nested state_dict:
    no path is a prefix of another, and the children of a node are all keys or all indices."""
    kinds: dict = {}
    for p in paths:
        if not isinstance(p, (tuple, list)) or not p or not isinstance(p[0], str) or \
                not all(isinstance(x, str) or (isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 20)
                        for x in p):
            return False
        for i in range(1, len(p)):
            kinds.setdefault(tuple(p[:i]), set()).add(type(p[i]))
    leaves = {tuple(p) for p in paths}
    return all(len(v) == 1 for v in kinds.values()) and not (leaves & set(kinds)) and len(leaves) == len(paths)


def _itemsize(dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def load_metadata(path, check_files=False, name=".metadata"):
    """The DCP `Metadata` of directory `path`, unpickled without running code and checked.

    Args:
      path: a local DCP checkpoint directory.
      check_files: also check that every rank file the metadata names is there and holds
        the bytes it lists (before anything is allocated from the metadata's sizes).
      name: the metadata file's name (``__R.metadata`` for torch's per-rank metadata).

    Returns:
      The `Metadata` (``storage_meta`` filled in as torch's reader does).

    Raises:
      CheckpointError: no ``.metadata`` (the save did not finish), a pickle naming a class a
        DCP save never writes, or inconsistent structure (one line).
    """
    f = os.path.join(os.fspath(path), name)
    if not os.path.isfile(f):
        raise CheckpointError(f"{path}: no {name} file; the DCP save did not finish (DCP writes .metadata "
                              "last) or this is not a DCP directory: load the previous checkpoint")
    size = os.path.getsize(f)
    if size > MAX_METADATA_BYTES:
        raise CheckpointError(f"{f}: {size} bytes, more than a DCP .metadata file can hold ({MAX_METADATA_BYTES})")
    try:
        with open(f, "rb") as fh:
            data = fh.read()
        for _ in pickletools.genops(data):   # every length field checked against the bytes there, before
            pass                             # the C unpickler allocates what one says
        md = _Unpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is this file's
        text = str(exc).strip().splitlines()
        raise CheckpointError(f"{f}: refused without running it ({type(exc).__name__}: "
                              f"{(text[0] if text else '')[:120]})") from None
    _check_metadata(md, f)
    if check_files:
        need: dict = {}
        for info in md.storage_data.values():
            need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
        for rel, n in sorted(need.items()):
            p = os.path.join(os.fspath(path), rel)
            if not os.path.isfile(p):
                raise CheckpointError(f"{p}: rank file is missing; the checkpoint is incomplete (copy the whole "
                                      "directory, or save it again)")
            if os.path.getsize(p) < n:
                raise CheckpointError(f"{p}: rank file is truncated ({os.path.getsize(p)} bytes, the metadata needs "
                                      f"{n}); the checkpoint is incomplete")
    if getattr(md, "storage_meta", None) is None:
        md.storage_meta = _md.StorageMeta()
    return md


def _check_metadata(md, f) -> None:
    def bad(what):
        raise CheckpointError(f"{f}: {what}; the .metadata file is corrupt or was not written by a DCP save")
    if not isinstance(md, _md.Metadata):
        bad(f"holds a {type(md).__name__}, not DCP Metadata")
    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        bad("state_dict_metadata is not a dict")
    for k, v in sdm.items():
        if not isinstance(k, str):
            bad(f"state_dict_metadata key {k!r} is not a string")
        if isinstance(v, _md.BytesStorageMetadata):
            continue
        if not isinstance(v, _md.TensorStorageMetadata):
            bad(f"{k!r} has metadata of type {type(v).__name__}")
        props = getattr(v, "properties", None)
        if not isinstance(getattr(props, "dtype", None), torch.dtype):
            bad(f"{k!r} has no torch dtype")
        size, chunks = getattr(v, "size", None), getattr(v, "chunks", None)
        if not is_counts(size) or not isinstance(chunks, list):
            bad(f"{k!r} has size {_show(size)} / chunks {type(chunks).__name__}")
        if not all(isinstance(c, _md.ChunkStorageMetadata) for c in chunks):
            bad(f"{k!r} has a chunk record of another type")
        check_tiling(f, k, list(size), [(f"{k}@{_show(getattr(c, 'offsets', None))}", getattr(c, "offsets", None),
                                         getattr(c, "sizes", None)) for c in chunks])
    sd = getattr(md, "storage_data", None)
    if not isinstance(sd, dict):
        bad("storage_data is not a dict")
    for idx, info in sd.items():
        if not isinstance(idx, _md.MetadataIndex) or not isinstance(getattr(idx, "fqn", None), str) \
                or idx.fqn not in sdm or not hasattr(idx, "offset") or not (idx.offset is None or is_counts(idx.offset)):
            bad(f"storage_data names {_show(idx)}, which state_dict_metadata does not hold")
        rel = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(rel, str) or not rel or rel in (".", "..") \
                or os.path.basename(rel) != rel or "\\" in rel or "\0" in rel:
            bad(f"storage for {idx.fqn!r} is in {str(rel)[:60]!r}, not a file of this directory")
        if not is_count(getattr(info, "offset", None)) or not is_count(getattr(info, "length", None)):
            bad(f"storage for {idx.fqn!r} has offset {str(getattr(info, 'offset', None))[:20]} / length "
                f"{str(getattr(info, 'length', None))[:20]}")
        if getattr(info, "transform_descriptors", None) not in (None, [], ()):
            bad(f"storage for {idx.fqn!r} names stream transforms, which guarded DCP checkpoints never use")
        m = sdm[idx.fqn]
        if isinstance(m, _md.TensorStorageMetadata):
            chunk = next((c for c in m.chunks if idx.offset is not None and tuple(c.offsets) == tuple(idx.offset)), None)
            if chunk is None or info.length < math.prod(chunk.sizes) * _itemsize(m.properties.dtype):
                bad(f"storage for {idx.fqn!r} at {str(idx.offset)[:40]} is no chunk of it, or shorter than the chunk")
        elif idx.offset is not None:
            bad(f"storage for bytes item {idx.fqn!r} has tensor offsets")
    for k, m in sdm.items():
        if isinstance(m, _md.TensorStorageMetadata) and any(_md.MetadataIndex(k, c.offsets) not in sd for c in m.chunks):
            bad(f"a chunk of {k!r} has no storage")
        if isinstance(m, _md.BytesStorageMetadata) and _md.MetadataIndex(k) not in sd:
            bad(f"bytes item {k!r} has no storage")
    pd = getattr(md, "planner_data", None)
    if not isinstance(pd, (dict, type(None))):
        bad("planner_data is not a dict")
    maps = {k: v for k, v in (pd or {}).items() if k != "__jaxguard__"}
    if not all(isinstance(k, str) and k in sdm for k in maps) or not _paths_ok(list(maps.values())):
        bad("planner_data holds paths that do not form one state_dict")


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _update_fields_ok(cfg) -> bool:
    """A shard's config is an object whose next-update fields (what the load compares with
    the optimizer's param groups) are there and have their types: lr a number or
    ``[lo, hi]``, betas two numbers, eps and weight_decay numbers."""
    if not isinstance(cfg, dict):
        return False
    if cfg and cfg.get("certify") is not False and not all(k in cfg for k in ("lr", "betas", "eps")):
        return False    # a certified shard names its next update (the load compares it)
    lr, betas = cfg.get("lr", 0.0), cfg.get("betas", [0.0, 0.0])
    return (_number(lr) or (isinstance(lr, list) and len(lr) == 2 and all(map(_number, lr)))) and \
        isinstance(betas, list) and len(betas) == 2 and all(map(_number, betas)) and \
        _number(cfg.get("eps", 0.0)) and _number(cfg.get("weight_decay", 0.0))


def check_manifest(man, metadata) -> None:
    """Check the structure of a jaxguard DCP manifest against its `metadata` (one line).

    Args:
      man: the ``__jaxguard__`` planner data (format already checked).
      metadata: its DCP `Metadata`.

    Raises:
      CheckpointError: a missing or ill-typed field, or a shard outside its moment.
    """
    def bad(what):
        raise CheckpointError(f"the checkpoint's jaxguard manifest {what}; the .metadata file is corrupt")
    for k in ("moments", "tensors", "bytes"):
        if not isinstance(man.get(k), dict):
            bad(f"has no {k} table")
    for k in ("tensors", "bytes"):
        if not all(isinstance(a, str) and isinstance(b, str) for a, b in man[k].items()):
            bad(f"{k} table holds a non-string entry")
    sdm = getattr(metadata, "state_dict_metadata", {}) or {}
    chunk_keys = {f"{k}@{','.join(str(int(o)) for o in c.offsets)}" for k, m in sdm.items()
                  if isinstance(m, _md.TensorStorageMetadata) for c in m.chunks}
    if set(man["bytes"]) != {k for k, m in sdm.items() if isinstance(m, _md.BytesStorageMetadata)} or \
            set(man["tensors"]) != chunk_keys:
        bad("does not list the same items as the DCP metadata")
    shard_keys = [s.get("key") for e in man["moments"].values() if isinstance(e, dict)
                  for s in (e.get("shards") if isinstance(e.get("shards"), list) else []) if isinstance(s, dict)]
    if sorted(map(str, shard_keys)) != sorted(k for k in sdm if k.startswith("__jaxguard__/")):
        bad("does not name every guarded shard of the DCP metadata once")
    maps = [v for k, v in (metadata.planner_data or {}).items() if k != "__jaxguard__"]
    for prefix, e in man["moments"].items():
        if not isinstance(e, dict):
            bad(f"entry {str(prefix)[:60]!r} is not a record")
        for k in ("m_key", "v_key", "param"):
            if not isinstance(e.get(k), str):
                bad(f"entry {str(prefix)[:60]!r} has no string {k}")
        for k in ("m_path", "v_path"):
            p = e.get(k)
            if not isinstance(p, list) or not p or not all(isinstance(x, (str, int)) and not isinstance(x, bool)
                                                           for x in p):
                bad(f"entry {str(prefix)[:60]!r} has no {k}")
        shape, shards = e.get("shape"), e.get("shards")
        if not is_counts(shape) or not isinstance(shards, list):
            bad(f"entry {str(prefix)[:60]!r} has shape {str(shape)[:40]} / shards {type(shards).__name__}")
        p = sdm.get(e["param_key"]) if isinstance(e.get("param_key"), str) else None
        if not isinstance(p, _md.TensorStorageMetadata) or list(p.size) != shape:
            bad(f"entry {str(prefix)[:60]!r} has shape {shape[:8]}, not its parameter's")
        maps += [e["m_path"], e["v_path"]]
        for s in shards:
            if not isinstance(s, dict) or not isinstance(s.get("key"), str) or s["key"] not in sdm \
                    or not is_count(s.get("bytes")) \
                    or not all(isinstance(s.get(k), str) for k in ("sha256", "decoded_sha256")) \
                    or not isinstance(s.get("stats"), dict) or not _update_fields_ok(s.get("config", {})) \
                    or not all(is_count(s["stats"].get(k)) for k in ("coordinates", "escapes", "payload_bytes")):
                bad(f"entry {str(prefix)[:60]!r} has a shard record {str(s)[:60]!r} that is incomplete")
        check_tiling("the jaxguard manifest in .metadata", str(prefix), shape, [(s["key"], s.get("offsets"), s.get("sizes")) for s in shards])
    if not _paths_ok(maps):
        bad("holds moment paths that do not form one state_dict with the other items")
