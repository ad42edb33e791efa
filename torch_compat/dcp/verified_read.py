"""Reading what a rank's targets overlap, each stored chunk and shard checked against
the manifest before anything is decoded (`read_verified`)."""
from __future__ import annotations

__all__ = ['read_verified']

import hashlib
import io
import os

import torch

from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from jaxguard.format import container, reader
from jaxguard.errors import CheckpointError, ContainerError
from torch_compat.dcp.layout import offsets_key, one_line, tensor_sha256


# ---------------------------------------------------------------- load
class _Stager(LoadPlanner):
    """Receives what the storage reader reads, into fresh buffers (never the targets)."""

    def __init__(self, md):
        self.md, self.tensors, self.blobs = md, {}, {}

    def set_up_planner(self, *a, **k):
        pass

    def create_local_plan(self):
        return LoadPlan([])

    def create_global_plan(self, plans):
        return plans

    def finish_plan(self, plan):
        return plan

    def load_bytes(self, read_item, value):
        self.blobs[read_item.storage_index.fqn] = value.read()

    def resolve_tensor(self, read_item):
        md = self.md[read_item.storage_index.fqn]
        buf = torch.empty(tuple(read_item.lengths), dtype=md.properties.dtype)
        self.tensors[offsets_key(read_item.storage_index.fqn, read_item.storage_index.offset)] = buf
        return buf

    def commit_tensor(self, read_item, tensor):
        pass


def _stage_items(md, keys):
    """ReadItems that read whole stored chunks / bytes items `keys` ({(kind, fqn, offsets)})."""
    items = []
    for kind, fqn, off in sorted(keys, key=lambda k: (k[0], k[1], k[2] or ())):
        if kind == "b":
            mi = MetadataIndex(fqn)
            items.append(ReadItem(LoadItemType.BYTE_IO, mi, torch.Size([0]), mi, torch.Size([0]), torch.Size([0])))
            continue
        tmd = md[fqn]
        chunk = next((c for c in tmd.chunks if tuple(c.offsets) == tuple(off)), None)
        if chunk is None:
            raise CheckpointError(f"the checkpoint metadata lists no chunk of {fqn!r} at offsets {list(off)}")
        mi = MetadataIndex(fqn, off)
        zeros = torch.Size([0] * len(chunk.sizes))
        items.append(ReadItem(LoadItemType.TENSOR, mi, zeros, mi, zeros, torch.Size(chunk.sizes)))
    return items


def read_verified(storage_reader, metadata, manifest, keys, *, describe=None):
    """Read `keys` through `storage_reader` into fresh buffers and check every hash.

    Args:
      storage_reader: a set-up StorageReader (``set_up_storage_reader`` called).
      metadata: the checkpoint's DCP metadata.
      manifest: its jaxguard manifest, or None (plain DCP: nothing to check against).
      keys: {("t", fqn, offsets) | ("b", fqn, None)} stored chunks and bytes items.

    Returns:
      (tensors {key: Tensor}, objects {fqn: object}, shards {key: (m, v) float32 arrays}).

    Raises:
      CheckpointError: one line naming the file that is missing, truncated, unreadable
        or whose content does not match the manifest.
    """
    md = metadata.state_dict_metadata
    storage = getattr(storage_reader, "storage_data", None) or metadata.storage_data or {}
    base = os.fspath(getattr(storage_reader, "path", "") or "")
    by_file: dict = {}
    for item in _stage_items(md, keys):
        info = storage.get(item.storage_index)
        if info is None:
            raise CheckpointError(f"{base or 'the checkpoint'}: the metadata lists no storage for "
                                  f"{offsets_key(item.storage_index.fqn, item.storage_index.offset)!r}; the .metadata file is inconsistent")
        by_file.setdefault(getattr(info, "relative_path", "?"), []).append((item, info))
    stager = _Stager(md)
    shards = {}
    objects = {}
    shard_info = {s["key"]: s for e in (manifest or {}).get("moments", {}).values() for s in e["shards"]}
    for rel, pairs in sorted(by_file.items()):
        path = os.path.join(base, rel) if base else rel
        if base and os.path.isdir(base):
            if not os.path.isfile(path):
                raise CheckpointError(f"{path}: rank file is missing; the checkpoint is incomplete (copy the whole "
                                      "directory, or save it again)")
            need = max(getattr(info, "offset", 0) + getattr(info, "length", 0) for _, info in pairs)
            have = os.path.getsize(path)
            if have < need:
                raise CheckpointError(f"{path}: rank file is truncated ({have} bytes, the metadata needs {need}); "
                                      "the checkpoint is incomplete")
        try:
            storage_reader.read_data(LoadPlan([it for it, _ in pairs]), stager).wait()
        except Exception as exc:  # noqa: BLE001 - any reader failure is this file's fault
            raise CheckpointError(f"{path}: does not match .metadata (overwritten in place by a save that did not "
                                  f"finish, or altered): {one_line(exc)[:90]}") from None
        for item, _ in pairs:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.TENSOR:
                k = offsets_key(fqn, item.storage_index.offset)
                want = None if manifest is None else manifest["tensors"].get(k)
                if manifest is not None and want != tensor_sha256(stager.tensors[k]):
                    raise CheckpointError(f"{path}: tensor {k!r} does not match the SHA-256 recorded at save; the "
                                          "file was altered or is corrupt")
                continue
            data = stager.blobs.pop(fqn)
            if fqn in shard_info:
                s = shard_info[fqn]
                if len(data) != s["bytes"] or hashlib.sha256(data).hexdigest() != s["sha256"]:
                    raise CheckpointError(f"{path}: guarded shard {fqn!r} does not match the SHA-256 recorded at "
                                          "save; the file was altered or is corrupt")
                try:
                    header, payload = reader.parse(data)
                    tables = reader.read_tables(header, payload)
                    (m, v), = container.entries_by_name(header, payload, tables, verify_decoded=True).values()
                except (reader.ReaderError, ContainerError, ValueError) as exc:
                    raise CheckpointError(f"{path}: guarded shard {fqn!r} does not decode ({one_line(exc)})") from None
                if header.get("decoded_sha256") != s["decoded_sha256"]:
                    raise CheckpointError(f"{path}: guarded shard {fqn!r} decodes to moments whose SHA-256 differs "
                                          "from the one recorded at save")
                shards[fqn] = (m, v)
                continue
            if manifest is not None and hashlib.sha256(data).hexdigest() != manifest["bytes"].get(fqn):
                raise CheckpointError(f"{path}: item {fqn!r} does not match the SHA-256 recorded at save; the file "
                                      "was altered or is corrupt")
            try:
                objects[fqn] = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001
                raise CheckpointError(f"{path}: item {fqn!r} is not plain data and was refused without running it "
                                      f"({one_line(exc)})") from None
    return stager.tensors, objects, shards
