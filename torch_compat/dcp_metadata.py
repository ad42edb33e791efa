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

import io
import os
import pathlib
import pickle

import torch
from torch.distributed.checkpoint import metadata as _md
from torch.distributed.checkpoint.filesystem import _StorageInfo

from jaxguard.errors import CheckpointError

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


def _nat(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 62


def _nats(xs, n=None) -> bool:
    return isinstance(xs, (list, tuple)) and (n is None or len(xs) == n) and all(_nat(x) for x in xs)


def load_metadata(path):
    """The DCP `Metadata` of directory `path`, unpickled without running code and checked.

    Args:
      path: a local DCP checkpoint directory.

    Returns:
      The `Metadata` (``storage_meta`` filled in as torch's reader does).

    Raises:
      CheckpointError: no ``.metadata`` (the save did not finish), a pickle naming a class a
        DCP save never writes, or inconsistent structure (one line).
    """
    f = os.path.join(os.fspath(path), ".metadata")
    if not os.path.isfile(f):
        raise CheckpointError(f"{path}: no .metadata file; the DCP save did not finish (DCP writes .metadata "
                              "last) or this is not a DCP directory: load the previous checkpoint")
    size = os.path.getsize(f)
    if size > MAX_METADATA_BYTES:
        raise CheckpointError(f"{f}: {size} bytes, more than a DCP .metadata file can hold ({MAX_METADATA_BYTES})")
    try:
        with open(f, "rb") as fh:
            md = _Unpickler(io.BytesIO(fh.read())).load()
    except Exception as exc:  # noqa: BLE001 - any unpickling failure is this file's
        text = str(exc).strip().splitlines()
        raise CheckpointError(f"{f}: refused without running it ({type(exc).__name__}: "
                              f"{(text[0] if text else '')[:120]})") from None
    _check_metadata(md, f)
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
        if not _nats(size) or not isinstance(chunks, list):
            bad(f"{k!r} has size {str(size)[:40]} / chunks {type(chunks).__name__}")
        for c in chunks:
            off, sz = getattr(c, "offsets", None), getattr(c, "sizes", None)
            if not isinstance(c, _md.ChunkStorageMetadata) or not _nats(off, len(size)) or not _nats(sz, len(size)) \
                    or any(o + s > d for o, s, d in zip(off, sz, size)):
                bad(f"{k!r} has a chunk {str(c)[:60]} outside its size {list(size)}")
    sd = getattr(md, "storage_data", None)
    if not isinstance(sd, dict):
        bad("storage_data is not a dict")
    for idx, info in sd.items():
        if not isinstance(idx, _md.MetadataIndex) or not isinstance(idx.fqn, str) or idx.fqn not in sdm \
                or not (idx.offset is None or _nats(idx.offset)):
            bad(f"storage_data names {str(idx)[:60]}, which state_dict_metadata does not hold")
        rel = getattr(info, "relative_path", None)
        if not isinstance(info, _StorageInfo) or not isinstance(rel, str) or not rel or rel in (".", "..") \
                or os.path.basename(rel) != rel or "\\" in rel or "\0" in rel:
            bad(f"storage for {idx.fqn!r} is in {str(rel)[:60]!r}, not a file of this directory")
        if not _nat(getattr(info, "offset", None)) or not _nat(getattr(info, "length", None)):
            bad(f"storage for {idx.fqn!r} has offset {str(getattr(info, 'offset', None))[:20]} / length "
                f"{str(getattr(info, 'length', None))[:20]}")
        if getattr(info, "transform_descriptors", None) not in (None, [], ()):
            bad(f"storage for {idx.fqn!r} names stream transforms, which guarded DCP checkpoints never use")
    if not isinstance(getattr(md, "planner_data", None), (dict, type(None))):
        bad("planner_data is not a dict")


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
        if not _nats(shape) or not isinstance(shards, list):
            bad(f"entry {str(prefix)[:60]!r} has shape {str(shape)[:40]} / shards {type(shards).__name__}")
        for s in shards:
            if not isinstance(s, dict) or not isinstance(s.get("key"), str) or s["key"] not in sdm \
                    or not _nats(s.get("offsets"), len(shape)) or not _nats(s.get("sizes"), len(shape)) \
                    or any(o + n > d for o, n, d in zip(s["offsets"], s["sizes"], shape)) or not _nat(s.get("bytes")) \
                    or not all(isinstance(s.get(k), str) for k in ("sha256", "decoded_sha256")) \
                    or not isinstance(s.get("stats"), dict) \
                    or not all(_nat(s["stats"].get(k)) for k in ("coordinates", "escapes", "payload_bytes")):
                bad(f"entry {str(prefix)[:60]!r} has a shard record {str(s)[:60]!r} that is incomplete or "
                    "outside the moment")
