"""Guarded Adam/AdamW moments in ``torch.distributed.checkpoint`` (FSDP2/DTensor, resharding).

    msd, osd = get_state_dict(model, optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path,
             planner=GuardedSavePlanner(tau=0.01, clip=0.2))      # or dcp.async_save
    state = {"model": msd, "optim": osd}                           # any world size
    dcp.load(state, checkpoint_id=path, planner=GuardedLoadPlanner(checkpoint_id=path))

Save: each rank encodes **its own local shards** of every ``exp_avg``/``exp_avg_sq`` pair
(DTensor local tensors, or whole tensors in a plain process) with `jaxguard.encode_many`,
certified against the local shard of the parameter saved in the same call and the lr,
betas, eps, weight decay and step of its param group. Each shard becomes one jaxguard
container (docs/format.md), written as a DCP bytes item ``__jaxguard__/<prefix>@<offsets>``;
the moment tensors themselves are not written. Everything else (weights, ``step``, param
groups) goes through DCP unchanged. The planner records in the DCP metadata
(``metadata.planner_data["__jaxguard__"]``, the *manifest*): for every moment its global
shape and the offsets/sizes, SHA-256 and decoded-moments SHA-256 of every shard; a
SHA-256 of the content of every stored tensor chunk and of every stored bytes item.

Load: each rank reads every stored chunk and shard its targets overlap (through the
storage reader, during DCP's planning step), checks each against the manifest, decodes
the shards (numpy reader, bit-exact) and only then, in ``finish_plan`` (which DCP runs
only after every rank planned without error), copies the requested regions into the
targets. A missing, truncated or altered rank file therefore fails on the rank that
reads it with a one-line `CheckpointError` naming the file, DCP raises it on every rank,
and no model or optimizer tensor has been written on any rank.

Numerical contract: for every coordinate the loaded moments equal the saved ones bitwise
or the first native update after resume (op model ``torch-adam``/``torch-adamw``,
``torch.optim.Adam(foreach=False, fused=False)``, bias corrections at ``step + 1``)
differs from the uncompressed resume by at most ``tau * lr`` for every gradient
``|g| <= clip`` (`jaxguard.core.guard`). The certificate is per coordinate, so it does not
depend on the world size the checkpoint is loaded at. Weights, steps and param groups
load bit-identically to a plain DCP save.
"""
from __future__ import annotations

__all__ = ["FORMAT", "SHARD_PREFIX", "manifest_of", "GuardedSavePlanner", "GuardedFileSystemReader",
           "GuardedLoadPlanner", "read_metadata", "load_full", "restore_dir", "compress_dir", "inspect_dir",
           "verify_dir", "first_update_audit"]

import contextlib
import dataclasses
import hashlib
import io
import math
import os
import time
import warnings

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list, _create_read_items, _create_write_items
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.checkpoint.utils import find_state_dict_object
try:
    from torch.distributed.tensor import DTensor
except ImportError:   # torch 2.4: DTensor was public only as torch.distributed._tensor
    from torch.distributed._tensor import DTensor

from jaxguard import audit as jg_audit
from jaxguard import uncovered, writer
from jaxguard.format.spec import DEFAULT_CLIP, DEFAULT_TAU
from jaxguard.format import container, reader, storage
from jaxguard.errors import CheckpointError, ConfigError, ContainerError, JaxguardError, JaxguardWarning, UnsupportedOptimizerError
from jaxguard.core.config import save_spec

from torch_compat import state as _state
from torch_compat.dcp_metadata import check_manifest, load_metadata

FORMAT = "jaxguard-dcp/1"
MANIFEST_KEY = "__jaxguard__"
SHARD_PREFIX = "__jaxguard__/"
MOMENTS = ("exp_avg", "exp_avg_sq")
NOT_GUARDED = ("{path} is a plain DCP checkpoint (no jaxguard manifest); convert it with "
               "`jaxguard compress {path} -o DIR2` first")


# ---------------------------------------------------------------- small helpers
def _offsets_key(fqn, offsets) -> str:
    return fqn if offsets is None else f"{fqn}@{','.join(str(int(o)) for o in offsets)}"


def _tensor_sha256(t: torch.Tensor) -> str:
    t = t.detach().cpu().contiguous()
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest() if t.numel() else \
        hashlib.sha256(b"").hexdigest()


def _one_line(exc) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def _optimizer_roots(nested) -> dict:
    """{path tuple: optimizer state_dict} for every dict holding 'state' and 'param_groups'."""
    out = {}

    def walk(obj, path):
        if isinstance(obj, dict):
            if isinstance(obj.get("state"), dict) and isinstance(obj.get("param_groups"), (list, tuple)):
                out[path] = obj
                return
            for k, v in obj.items():
                walk(v, path + (k,))

    walk(nested, ())
    return out


def _group_of(osd, fqn, root):
    for gi, g in enumerate(osd["param_groups"]):
        if fqn in list(g.get("params", ())):
            return gi, g
    raise CheckpointError(f"optimizer state {'.'.join(map(str, root))}.state[{fqn!r}] belongs to no param group; "
                          "save the optimizer state_dict from get_state_dict(model, optimizer)")


def _chunk_items(fqn, obj):
    """[(offsets, sizes, MetadataIndex)] of the local chunks DCP would write for `obj`."""
    return [(tuple(int(o) for o in it.tensor_data.chunk.offsets), tuple(int(s) for s in it.tensor_data.chunk.sizes),
             it.index) for it in _create_write_items(fqn, obj)]


def manifest_of(metadata):
    """The jaxguard manifest recorded in DCP `metadata`.

    Args:
      metadata: a DCP `Metadata`.

    Returns:
      The manifest dict, or None for a plain DCP checkpoint.

    Raises:
      CheckpointError: a manifest of another format version.
    """
    pd = getattr(metadata, "planner_data", None)
    man = pd.get(MANIFEST_KEY) if isinstance(pd, dict) else None
    if man is None:
        return None
    if not isinstance(man, dict) or man.get("format") != FORMAT:
        raise CheckpointError(f"the checkpoint's jaxguard manifest is {str(man.get('format') if isinstance(man, dict) else man)[:40]!r}, "
                              f"this version reads {FORMAT!r}; upgrade jaxguard")
    check_manifest(man, metadata)
    return man


# ---------------------------------------------------------------- save
class GuardedSavePlanner(DefaultSavePlanner):
    """A `DefaultSavePlanner` that writes every Adam/AdamW moment pair as guarded shards.

    Args:
      tau: the update-difference bound, as a fraction of lr (default: the spec's, 0.01).
      clip: the gradient range ``|g| <= clip`` the certificate covers (default: the spec's, 0.2).
      spec: the guard settings, a `jaxguard.GuardSpec` (default ``GuardSpec()``); `tau`,
        `clip`, `codec`, `bound`, `partition` override its fields when given.
      op_model: the kernel the run resumes on (`torch_compat.state.op_model_of`; None: the
        one torch runs where the state lives).
      lr: the next step's learning rate, if the param groups do not hold it (saved before
        ``scheduler.step()``): a number or ``(lo, hi)`` for every group; a group whose next
        rate is 0 keeps its moments as plain DCP tensors (listed in the manifest's
        ``stored_exactly``).
      uncertifiable: ``"exact"`` (default, `jaxguard.uncovered`): state the guard cannot
        certify (bfloat16/float16 parameters or moments, amsgrad and the other flags
        outside the op models, an optimizer that is not Adam) stays plain DCP tensors,
        listed with the reason in the manifest's ``stored_exactly``, with one warning
        line; ``"refuse"``: such a save raises instead.
      overwrite: save into a directory that already holds a DCP checkpoint (default False:
        refused, since DCP rewrites its rank files in place and an interrupted save then
        leaves neither checkpoint; a directory per step keeps the last one whole).
      **kwargs: passed to `DefaultSavePlanner` (``flatten_state_dict`` must stay True;
        plan caching is refused: the hashes change with every save).

    The state_dict passed to ``dcp.save`` must hold the model's parameters next to the
    optimizer state (``{"model": msd, "optim": osd}`` from ``get_state_dict``): each
    moment shard is certified against the parameter shard it updates.

    Raises:
      ConfigError: a bad tau/clip/codec, or flatten_state_dict/plan caching requested.
      CheckpointError / UnsupportedOptimizerError (wrapped by DCP in a
        ``CheckpointException``): a parameter is missing or shaped otherwise than its
        moments; (``uncertifiable="refuse"``) the state is not float32 Adam/AdamW state.

    Warns:
      JaxguardWarning: (``uncertifiable="exact"``) one line naming what was stored exactly
        and why (`jaxguard.uncovered.warn`).
    """

    def __init__(self, tau: float | None = None, clip: float | None = None, *, spec=None, codec: str | None = None,
                 bound: str | None = None, partition: str | None = None, op_model: str | None = None,
                 overwrite: bool = False, lr=None, uncertifiable: str = "exact", **kwargs):
        if kwargs.get("flatten_state_dict", True) is not True:
            raise ConfigError("GuardedSavePlanner needs flatten_state_dict=True (it finds the moments by their paths)")
        if kwargs.get("enable_plan_caching"):
            raise ConfigError("GuardedSavePlanner does not support enable_plan_caching=True: every save records new hashes")
        super().__init__(**kwargs)
        self.spec = save_spec(spec, tau=tau, clip=clip, codec=codec, bound=bound, partition=partition)
        self.op_model = op_model
        self.lr = lr
        self.uncertifiable = uncovered.policy(uncertifiable)
        self.overwrite = overwrite
        s = self.spec
        self.tau, self.clip, self.codec, self.bound, self.partition = s.tau, s.clip, s.codec, s.bound, s.partition
        self.summary: dict = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        """`DefaultSavePlanner.set_up_planner`, keeping the nested state_dict to find the optimizer in.

        Args:
          state_dict, storage_meta, is_coordinator: as `DefaultSavePlanner.set_up_planner`.
        """
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self._nested = state_dict
        where = getattr(storage_meta, "checkpoint_id", None)
        if not self.overwrite and where is not None and os.path.isfile(os.path.join(os.fspath(where), ".metadata")):
            # DCP rewrites the rank files of a directory in place: a save that stops half way loses the old one
            raise CheckpointError(f"{where} holds a committed DCP checkpoint, which DCP would overwrite in place (a "
                                  "save that stops half way loses it); save each step to its own directory, or "
                                  "pass GuardedSavePlanner(overwrite=True)")

    def create_local_plan(self):
        """Certify and encode this rank's moment shards, then plan the rest as DCP would.

        Returns:
          The local `SavePlan` (the encoded shards as bytes items, the moment tensors dropped).

        Raises:
          CheckpointError, UnsupportedOptimizerError: see the class docstring.
        """
        t0 = time.perf_counter()
        local = self._encode_local_shards()
        plan = super().create_local_plan()
        tensors, blobs = {}, {}
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                blobs[item.index.fqn] = hashlib.sha256(self._blob(item.index.fqn)).hexdigest()
            else:
                obj = find_state_dict_object(self.state_dict, item.index)
                tensors[_offsets_key(item.index.fqn, item.index.offset)] = _tensor_sha256(obj)
        local.update(tensors=tensors, bytes=blobs, seconds=time.perf_counter() - t0)
        self.plan = dataclasses.replace(plan, planner_data={"mappings": plan.planner_data, "jaxguard": local})
        return self.plan

    def _blob(self, fqn) -> bytes:
        if fqn not in self._blobs:
            buf = io.BytesIO()
            torch.save(self.state_dict[fqn], buf)  # what DefaultSavePlanner.transform_object writes
            self._blobs[fqn] = buf.getvalue()
        return self._blobs[fqn]

    def _encode_local_shards(self) -> dict:
        self._blobs: dict = {}
        roots = _optimizer_roots(self._nested)
        refuse = self.uncertifiable == uncovered.REFUSE
        bad_groups = {}
        for root, osd in roots.items():
            for gi, g in enumerate(osd["param_groups"]):
                u = _state.group_uncovered(gi, g, who="GuardedSavePlanner")
                if u is not None and refuse:
                    raise u.error
                bad_groups[(root, gi)] = u
        pairs: dict = {}
        for key, path in list(self.mappings.items()):
            if len(path) >= 3 and path[-1] in MOMENTS and path[-3] == "state" and tuple(path[:-3]) in roots:
                pairs.setdefault((tuple(path[:-3]), path[-2]), {})[path[-1]] = key
        jobs, entries, exact = [], {}, {}
        for (root, fqn), keys in pairs.items():
            if set(keys) != set(MOMENTS):
                raise CheckpointError(f"optimizer state {fqn!r} has {sorted(keys)} but not both exp_avg and exp_avg_sq")
            osd = roots[root]
            gi, group = _group_of(osd, fqn, root)
            u = bad_groups.get((root, gi)) or self._pair_uncovered(fqn, keys, root)
            if u is not None:     # uncertifiable="exact": the pair stays plain DCP tensors, stored exactly
                if refuse:
                    raise u.error
                exact[(root, fqn)] = u.why
                continue
            step = _state.step_count(osd["state"][fqn], fqn)
            update = _state.next_update(group, step, op_model=self.op_model, lr=self.lr,
                                        device_type=osd["state"][fqn]["exp_avg"].device.type)
            if update.stores_exactly:     # next lr 0: the pair stays plain DCP tensors, stored exactly
                exact[(root, fqn)] = _state.EXACT_REASON
                continue
            cfg = _state.writer_config(self.spec, update)
            m_key, v_key = keys["exp_avg"], keys["exp_avg_sq"]
            p_key = self._param_key(fqn, root)
            m, v, p = self.state_dict[m_key], self.state_dict[v_key], self.state_dict[p_key]
            if not (m.shape == v.shape == p.shape):
                raise CheckpointError(f"parameter {fqn!r} has shape {tuple(p.shape)} but its moments "
                                      f"{tuple(m.shape)}; the model and optimizer do not match")
            chunks = [_chunk_items(k, t) for k, t in ((m_key, m), (v_key, v), (p_key, p))]
            if not (len({tuple((o, s) for o, s, _ in c) for c in chunks}) == 1):
                raise CheckpointError(f"the local shards of {fqn!r} and of its moments differ; shard the parameter "
                                      "and the optimizer state alike (FSDP2 does)")
            prefix = m_key[:-len(".exp_avg")]
            entry = {"m_key": m_key, "v_key": v_key, "m_path": list(self.mappings[m_key]),
                     "v_path": list(self.mappings[v_key]), "param": fqn, "param_key": p_key,
                     "shape": [int(d) for d in m.shape], "op_model": cfg.op_model}
            entries[prefix] = entry
            for (off, size, mi), (_, _, vi), (_, _, pi) in zip(*chunks):
                if math.prod(size) == 0:
                    continue
                loc = [_state.encoder_view(find_state_dict_object(self.state_dict, i)) for i in (mi, vi, pi)]
                jobs.append((prefix, entry, off, size, cfg, loc))
        records = [writer.MomentJob(prefix, m, v, p, cfg,
                                    {"param": entry["param"], "offsets": list(off), "global_shape": entry["shape"]})
                   for prefix, entry, off, size, cfg, (m, v, p) in jobs]
        moments = {prefix: {**entry, "shards": []} for prefix, entry in entries.items()}
        totals = {**writer.new_totals(), "container_bytes": 0}
        for (prefix, entry, off, size, cfg, _), e in zip(jobs, writer.encode(records, totals)):
            key = _offsets_key(SHARD_PREFIX + prefix, off)
            data = container.build([e], {"framework": "torch-dcp", "moment": prefix, "offsets": list(off)},
                                   extra_header={"op_model": cfg.op_model, "tau": cfg.tau, "clip": cfg.clip,
                                                 "codec": cfg.codec, "bound": cfg.bound, "partition": cfg.partition})
            header, _ = reader.parse(data)
            self._blobs[key] = data
            self.state_dict[key] = key  # a placeholder: DCP plans a bytes item, resolve_data returns the container
            stats = {k: e.encoded.stats[k] for k in ("coordinates", "escapes", "exact", "payload_bytes", "raw_fp32_bytes")}
            moments[prefix]["shards"].append({
                "key": key, "offsets": list(off), "sizes": list(size), "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(), "decoded_sha256": header["decoded_sha256"],
                "config": cfg.to_json(), "stats": stats})
            totals["container_bytes"] += len(data)
        for (root, fqn), keys in pairs.items():  # even a rank with only empty shards drops the tensors
            if (root, fqn) in exact:
                continue
            for k in keys.values():
                self.state_dict.pop(k, None)
                self.mappings.pop(k, None)
        for (root, gi), u in bad_groups.items():    # an optimizer that is not Adam: its state stays plain too
            if u is not None:
                osd = roots[root]
                exact.update({(root, fqn): u.why for fqn in osd["param_groups"][gi].get("params", ())
                              if fqn in osd["state"] and (root, fqn) not in exact})
        self.summary = totals
        stored = sorted(({"param": ".".join(map(str, root + (fqn,))), "why": why} for (root, fqn), why in exact.items()),
                        key=lambda x: x["param"])
        if self.uncertifiable == uncovered.EXACT:
            uncovered.warn("GuardedSavePlanner", [s for s in stored if s["why"] != _state.EXACT_REASON],
                           of=sum(len(osd["state"]) for osd in roots.values()))
        return {"moments": moments, "totals": totals, "stored_exactly": stored}

    def _pair_uncovered(self, fqn, keys, root):
        """Why the moment pair of `fqn` cannot be certified (not float32 parameter or moments), or None."""
        p = self.state_dict.get(self._param_key(fqn, root))
        for what, key in (("moments", keys["exp_avg"]), ("moments", keys["exp_avg_sq"]), ("parameters", None)):
            t = p if key is None else self.state_dict[key]
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
                dt = str(getattr(t, "dtype", type(t).__name__)).replace("torch.", "")
                return _state.Uncovered(f"{dt} {what} (the guarantee covers float32)", UnsupportedOptimizerError(
                    f"{'parameter' if key is None else key.rsplit('.', 1)[-1]} of {fqn!r} is {dt}; the guarantee "
                    "covers float32 parameters and moments"))
        return None

    def _param_key(self, fqn, root):
        hits = [k for k, path in self.mappings.items()
                if path and path[-1] == fqn and tuple(path[:len(root)]) != root
                and isinstance(self.state_dict.get(k), torch.Tensor)]
        if len(hits) != 1:
            what = "no" if not hits else f"{len(hits)} ({', '.join(hits[:3])})"
            raise CheckpointError(f"GuardedSavePlanner found {what} model entries for parameter {fqn!r}; save the "
                                  "model and optimizer together: dcp.save({'model': msd, 'optim': osd}) with "
                                  "msd, osd = get_state_dict(model, optimizer)")
        return hits[0]

    def create_global_plan(self, all_plans):
        """The coordinator's plan: DCP's, plus the manifest (hashes, shards, totals) in its metadata.

        Args:
          all_plans: every rank's local plan.

        Returns:
          ``(global plans, metadata)``.

        Raises:
          CheckpointError: the ranks' shards do not cover a moment tensor exactly once.
        """
        locals_ = [p.planner_data["jaxguard"] for p in all_plans]
        plans = [dataclasses.replace(p, planner_data=p.planner_data["mappings"]) for p in all_plans]
        global_plan, metadata = super().create_global_plan(plans)
        tensors, blobs, moments = {}, {}, {}
        for rank, plan in enumerate(global_plan):   # deduplicated: the hash of the rank that writes it
            loc = locals_[rank]
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    blobs[item.index.fqn] = loc["bytes"][item.index.fqn]
                else:
                    k = _offsets_key(item.index.fqn, item.index.offset)
                    tensors[k] = loc["tensors"][k]
        for loc in locals_:
            for prefix, entry in loc["moments"].items():
                e = moments.setdefault(prefix, {**entry, "shards": []})
                have = {s["key"] for s in e["shards"]}
                e["shards"] += [s for s in entry["shards"] if s["key"] not in have]
        for prefix, e in moments.items():
            e["shards"].sort(key=lambda s: s["offsets"])
            covered = sum(math.prod(s["sizes"]) for s in e["shards"])
            if covered != math.prod(e["shape"]):
                raise CheckpointError(f"the ranks' shards of {prefix!r} cover {covered} of {math.prod(e['shape'])} "
                                      "coordinates; every coordinate must be saved by exactly one shard")
        manifest = {"format": FORMAT, "tau": self.tau, "clip": self.clip, "codec": self.codec, "bound": self.bound,
                    "partition": self.partition, "world_size": len(all_plans), "torch_version": torch.__version__,
                    "moments": moments, "tensors": tensors, "bytes": blobs,
                    "totals": {k: sum(loc["totals"][k] for loc in locals_) for k in locals_[0]["totals"]},
                    "stored_exactly": sorted({x["param"]: x for loc in locals_ for x in loc.get("stored_exactly", ())
                                              }.values(), key=lambda x: x["param"]),
                    "encode_seconds_per_rank": [loc["seconds"] for loc in locals_]}
        pd = dict(metadata.planner_data or {})
        pd[MANIFEST_KEY] = manifest
        metadata = dataclasses.replace(metadata, planner_data=pd)
        self.metadata = metadata
        return global_plan, metadata

    def resolve_data(self, write_item):
        """Args: write_item: a planned item.  Returns: its bytes (a guarded shard's container) or tensor."""
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(self._blob(write_item.index.fqn))
        return super().resolve_data(write_item)


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
        self.tensors[_offsets_key(read_item.storage_index.fqn, read_item.storage_index.offset)] = buf
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
                                  f"{_offsets_key(item.storage_index.fqn, item.storage_index.offset)!r}; the .metadata file is inconsistent")
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
                                  f"finish, or altered): {_one_line(exc)[:90]}") from None
        for item, _ in pairs:
            fqn = item.storage_index.fqn
            if item.type == LoadItemType.TENSOR:
                k = _offsets_key(fqn, item.storage_index.offset)
                want = None if manifest is None else manifest["tensors"].get(k)
                if manifest is not None and want != _tensor_sha256(stager.tensors[k]):
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
                    raise CheckpointError(f"{path}: guarded shard {fqn!r} does not decode ({_one_line(exc)})") from None
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
                                      f"({_one_line(exc)})") from None
    return stager.tensors, objects, shards


def _overlap(a_off, a_size, b_off, b_size):
    lo = [max(x, y) for x, y in zip(a_off, b_off)]
    hi = [min(x + s, y + t) for x, s, y, t in zip(a_off, a_size, b_off, b_size)]
    return None if any(h <= l for l, h in zip(lo, hi)) else (lo, hi)


def _window(lo, hi, origin):
    """The slices of the region [lo, hi) inside an array whose first element sits at `origin`."""
    return tuple(slice(l - o, h - o) for l, h, o in zip(lo, hi, origin))


def _warn_other_device(entry, fqn, target, where) -> bool:
    """Warn (one line, `JaxguardWarning`) when a moment is restored onto
    another kind of device than its certified op model's kernel runs on (a CUDA model onto
    a CPU tensor, or the reverse).  The load planner sees the target tensors, not the
    optimizer's foreach/fused flags: ``torch_compat.load`` checks those.  Returns whether
    it warned (the planner warns once per load)."""
    from jaxguard.core.opmodel import GPU_OP_MODELS
    model = entry.get("op_model")   # manifests written before it have none
    device = getattr(getattr(target, "device", None), "type", None)
    if not model or device in (None, "meta"):
        return False
    certified = "cuda" if model in GPU_OP_MODELS else "cpu"
    if (device == "cpu") != (certified == "cpu"):
        warnings.warn(f"{where}: {fqn} was certified for {model} ({certified}) but is restored onto {device}: the "
                      f"tau guarantee holds for that kernel only; resume on it, or save the original state again "
                      f"with GuardedSavePlanner(op_model=...) for the kernel this run uses", JaxguardWarning,
                      stacklevel=3)
        return True
    return False


class GuardedFileSystemReader(FileSystemReader):
    """torch's `FileSystemReader`, reading ``.metadata`` without running code.

    torch's ``FileSystemReader.read_metadata`` is a plain ``pickle.load`` of ``.metadata``,
    and ``dcp.load`` calls it before any planner sees the checkpoint: a directory someone
    else hands in runs whatever code its pickle names.  This reader unpickles it with only
    the classes a DCP save writes and checks its structure and rank files first
    (`torch_compat.dcp_metadata.load_metadata`); everything else is torch's reader::

        r = GuardedFileSystemReader(path)
        dcp.load(state, storage_reader=r, planner=GuardedLoadPlanner(storage_reader=r))

    It reads plain DCP checkpoints as well as guarded ones (local paths only).

    Raises (from ``read_metadata``, which ``dcp.load`` wraps in a ``CheckpointException``):
      CheckpointError: no ``.metadata`` (the save did not finish), a pickle naming a class a
        DCP save never writes (nothing runs), inconsistent structure, or a rank file the
        metadata names missing or shorter than it says (one line).
    """

    def read_metadata(self, *args, **kwargs):
        """The checkpoint's `Metadata` (as torch's reader: ``storage_meta.load_id`` set).

        Args:
          *args, **kwargs: as `FileSystemReader.read_metadata` (``rank=`` reads torch's
            per-rank ``__R.metadata``).

        Returns:
          The `Metadata`.

        Raises:
          CheckpointError: see the class docstring.
        """
        name = os.path.basename(os.fspath(self._get_metadata_path(kwargs.get("rank"))))
        md = load_metadata(self.path, check_files=True, name=name)
        md.storage_meta.load_id = self.load_id
        return md


def where_dcp_reads(metadata) -> str:
    """The checkpoint directory DCP's metadata names (``storage_meta.checkpoint_id``, which
    torch's `FileSystemWriter` records), for a `GuardedLoadPlanner` given no place.

    Args:
      metadata: the `Metadata` ``dcp.load`` read.

    Returns:
      The local directory, holding a ``.metadata``.

    Raises:
      CheckpointError: (one line naming ``checkpoint_id=``) no path recorded (another
        storage writer, torch < 2.4), a URL, or no DCP checkpoint there now.
    """
    cid = getattr(getattr(metadata, "storage_meta", None), "checkpoint_id", None)
    fix = "pass GuardedLoadPlanner(checkpoint_id=path) with the path given to dcp.load"
    if cid is None:
        raise CheckpointError("GuardedLoadPlanner(): the checkpoint's metadata does not say where it is (no "
                              f"storage_meta.checkpoint_id: another storage writer than FileSystemWriter); {fix}")
    path = os.fspath(cid)
    if "://" in path:
        raise CheckpointError(f"GuardedLoadPlanner(): the checkpoint's metadata names {path}, which the planner's "
                              f"local reader cannot read; pass storage_reader= (the reader given to dcp.load)")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"GuardedLoadPlanner(): the checkpoint's metadata says it was saved at {path}, which "
                              f"holds no DCP checkpoint from here (moved since, or a relative path saved from another "
                              f"directory); {fix}")
    return path


class GuardedLoadPlanner(DefaultLoadPlanner):
    """Load a checkpoint written with `GuardedSavePlanner` at any world size, all or nothing.

    The planner reads and verifies the stored data while DCP plans (before any target is
    written), which DCP's planner API gives it no reader for.  It reads where DCP's metadata
    says the checkpoint is (``Metadata.storage_meta.checkpoint_id``, which torch's
    `FileSystemWriter` records, torch >= 2.4), or where it is told:

        dcp.load(state, checkpoint_id=path, planner=GuardedLoadPlanner())
        dcp.load(state, checkpoint_id=path, planner=GuardedLoadPlanner(checkpoint_id=path))
        r = GuardedFileSystemReader(path)      # or another StorageReader
        dcp.load(state, storage_reader=r, planner=GuardedLoadPlanner(storage_reader=r))

    With no argument the metadata's path must still hold the checkpoint that was read (the
    same save id; a directory moved since, or saved under a relative path from another
    working directory, is refused in one line naming ``checkpoint_id=``).

    ``dcp.load`` unpickles ``.metadata`` through its storage reader before the planner sees
    anything, and torch's `FileSystemReader` does that with plain ``pickle.load`` (code in a
    pickle someone else wrote runs).  With ``checkpoint_id=`` the planner checks ``.metadata``
    with jaxguard's restricted reader at construction, before ``dcp.load`` is called; with
    ``storage_reader=`` it cannot (the reader is dcp.load's), so pass a
    `GuardedFileSystemReader`: given torch's plain `FileSystemReader` (or a subclass of it
    such as ``FsspecReader``), the planner warns (`JaxguardWarning`) that the
    metadata was already unpickled without restriction.  Other readers are not checked.

    Args:
      checkpoint_id: the checkpoint directory given to ``dcp.load`` (read through a
        `FileSystemReader` of the planner's own); None: the metadata's.
      storage_reader: the storage reader given to ``dcp.load`` (the same object: it is set
        up by DCP); at most one of the two.
      allow_partial_load: as `DefaultLoadPlanner`.
      strict: a param group the load installs with other hyperparameters (lr, betas, eps,
        weight decay) than its moments were certified for raises instead of warning
        (`check_next_update`).

    Every stored chunk and guarded shard a rank's targets overlap is read, hashed and
    decoded during DCP's planning step; targets are written in ``finish_plan``, which DCP
    calls only when every rank planned without error. A plain DCP checkpoint loads the
    same way (nothing to verify it against, and bytes items are still never unpickled).

    Raises (wrapped by DCP in a ``CheckpointException`` listing the failing ranks):
      CheckpointError: a rank file is missing, truncated or altered (one line naming the
        file); a key is missing; shapes differ; `storage_reader` is not the reader
        ``dcp.load`` reads with, or `checkpoint_id` holds another checkpoint; neither
        argument and no local ``storage_meta.checkpoint_id`` holding the checkpoint read.
      ConfigError (at construction): both `checkpoint_id` and `storage_reader`.
    """

    def __init__(self, checkpoint_id: str | os.PathLike | None = None, *,
                 storage_reader: StorageReader | None = None, allow_partial_load: bool = False, strict: bool = False):
        if checkpoint_id is not None and storage_reader is not None:
            raise ConfigError("GuardedLoadPlanner reads the checkpoint where dcp.load does: pass checkpoint_id= (the "
                              "path given to dcp.load) or storage_reader= (the reader given to it), not both")
        if storage_reader is not None and not isinstance(storage_reader, StorageReader):
            raise ConfigError(f"storage_reader is a {type(storage_reader).__name__}; pass the "
                              "torch.distributed.checkpoint StorageReader given to dcp.load")
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True, allow_partial_load=allow_partial_load)
        if checkpoint_id is not None and "://" not in os.fspath(checkpoint_id):
            load_metadata(checkpoint_id)   # before dcp.load unpickles it: one line, no code run
        self._checkpoint_id = checkpoint_id
        self._told = checkpoint_id is not None    # False: the path is the metadata's (where_dcp_reads)
        self._given_reader = storage_reader
        self._apply: list = []
        self.strict = strict

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        """`DefaultLoadPlanner.set_up_planner`, finding the storage reader and the manifest.

        Args:
          state_dict, metadata, is_coordinator: as `DefaultLoadPlanner.set_up_planner`.

        Raises:
          CheckpointError: the checkpoint's manifest is of another format version.
        """
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if isinstance(self._given_reader, FileSystemReader) and \
                not isinstance(self._given_reader, GuardedFileSystemReader):
            import warnings
            from jaxguard.errors import JaxguardWarning
            warnings.warn(f"dcp.load read {getattr(self._given_reader, 'path', 'the checkpoint')}/.metadata with "
                          f"torch's {type(self._given_reader).__name__} (a plain pickle.load) before "
                          "GuardedLoadPlanner saw it: a .metadata someone else wrote could have run code; pass "
                          "storage_reader=torch_compat.dcp.GuardedFileSystemReader(path)", JaxguardWarning,
                          stacklevel=2)
        if self._given_reader is None and self._checkpoint_id is None:
            self._checkpoint_id, self._told = where_dcp_reads(metadata), False
        self._reader = self._given_reader or self._own_reader(metadata, is_coordinator)
        sm = getattr(metadata, "storage_meta", None)
        ours, theirs = getattr(self._given_reader, "load_id", None), getattr(sm, "load_id", None)
        if ours is not None and theirs is not None and ours != theirs:   # FileSystemReader stamps its load_id
            raise CheckpointError("GuardedLoadPlanner(storage_reader=...) is not the storage reader dcp.load is "
                                  "reading with; pass the same object to both")
        self.manifest = manifest_of(metadata)

    def _own_reader(self, metadata, is_coordinator):
        """A `FileSystemReader` of `checkpoint_id`, set up, after checking that it holds the
        checkpoint whose metadata ``dcp.load`` read (the same save id)."""
        path = os.fspath(self._checkpoint_id)
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise CheckpointError(f"GuardedLoadPlanner(checkpoint_id={path!r}): no DCP checkpoint there (no "
                                  ".metadata); pass the path given to dcp.load, or storage_reader= for other storage")
        fs = GuardedFileSystemReader(path)
        mine = getattr(getattr(fs.read_metadata(), "storage_meta", None), "save_id", None)
        want = getattr(getattr(metadata, "storage_meta", None), "save_id", None)
        if mine is not None and want is not None and mine != want:
            where = (f"GuardedLoadPlanner(checkpoint_id={path!r})" if self._told else
                     f"GuardedLoadPlanner(): {path}, where the checkpoint's metadata says it was saved,")
            raise CheckpointError(f"{where} holds another checkpoint than the one dcp.load is reading; pass "
                                  "checkpoint_id= with the path given to dcp.load")
        fs.set_up_storage_reader(metadata, is_coordinator)
        return fs

    def create_local_plan(self):
        """Read and verify everything this rank's targets need, before anything is written.

        Returns:
          An empty `LoadPlan` (`finish_plan` copies the verified data into the targets).

        Raises:
          CheckpointError: see the class docstring.
        """
        man = self.manifest
        md = self.metadata.state_dict_metadata
        moment_of = {}
        for prefix, e in (man or {}).get("moments", {}).items():
            moment_of[e["m_key"]] = (prefix, 0)
            moment_of[e["v_key"]] = (prefix, 1)
        regular, targets, keys = [], [], set()
        warned = False
        for fqn, obj in self.state_dict.items():
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue
            if fqn in moment_of:
                prefix, which = moment_of[fqn]
                e = man["moments"][prefix]
                if not isinstance(obj, torch.Tensor) or list(obj.shape) != e["shape"]:
                    raise CheckpointError(f"{fqn} has shape {list(getattr(obj, 'shape', []))} here but "
                                          f"{e['shape']} in the checkpoint; the model differs")
                warned = warned or _warn_other_device(e, fqn, obj, self._checkpoint_id or "the checkpoint")
                for chunk in _create_chunk_list(obj):
                    off, size = tuple(chunk.offsets), tuple(chunk.sizes)
                    hits = [s for s in e["shards"] if _overlap(off, size, s["offsets"], s["sizes"])]
                    keys.update(("b", s["key"], None) for s in hits)
                    targets.append((fqn, off, size, hits, which))
                continue
            if fqn not in md:
                if self.allow_partial_load:
                    continue
                raise CheckpointError(f"{fqn!r} is not in the checkpoint; load with a state_dict of the model and "
                                      "optimizer that were saved, or allow_partial_load=True")
            m = md[fqn]
            if isinstance(m, TensorStorageMetadata) and getattr(obj, "size", None) is not None and m.size != obj.size():
                raise CheckpointError(f"{fqn} has shape {list(obj.size())} here but {list(m.size)} in the checkpoint")
            for ri in _create_read_items(fqn, m, obj):
                regular.append(ri)
                keys.add(("b", ri.storage_index.fqn, None) if ri.type == LoadItemType.BYTE_IO else
                         ("t", ri.storage_index.fqn, tuple(ri.storage_index.offset)))
        tensors, objects, shards = read_verified(self._reader, self.metadata, man, keys)
        apply = []
        for ri in regular:
            if ri.type == LoadItemType.BYTE_IO:
                apply.append(("obj", ri.dest_index.fqn, objects[ri.storage_index.fqn]))
                continue
            src = narrow_tensor_by_index(tensors[_offsets_key(ri.storage_index.fqn, ri.storage_index.offset)],
                                         ri.storage_offsets, ri.lengths)
            dst = self.transform_tensor(ri, self.lookup_tensor(ri.dest_index)).detach()
            if dst.size() != src.size():
                raise CheckpointError(f"{ri.dest_index.fqn}: region {list(dst.size())} here, {list(src.size())} stored")
            apply.append(("copy", dst, src))
        for fqn, off, size, hits, which in targets:
            dst_all = find_state_dict_object(self.state_dict, MetadataIndex(fqn, off)).detach()
            covered = 0
            for s in hits:
                lo, hi = _overlap(off, size, s["offsets"], s["sizes"])
                arr = shards[s["key"]][which]
                src = torch.from_numpy(np.ascontiguousarray(arr[_window(lo, hi, s["offsets"])]))
                dst = dst_all[_window(lo, hi, off)]
                apply.append(("copy", dst, src))
                covered += math.prod(h - l for l, h in zip(lo, hi))
            if covered != math.prod(size):
                raise CheckpointError(f"the checkpoint's guarded shards cover {covered} of the {math.prod(size)} "
                                      f"coordinates of {fqn} this rank needs; the manifest is inconsistent")
        self._apply = apply
        return LoadPlan([])   # everything is read and verified already; finish_plan writes it

    def finish_plan(self, new_plan):
        """Copy the verified data into the state_dict, then compare the param groups it
        installs with what their moments were certified for (`check_next_update`).

        Args:
          new_plan: DCP's.

        Returns:
          `new_plan`.

        Raises:
          CheckpointError: (``strict``) a param group that will step otherwise than certified.
        """
        for kind, a, b in self._apply:
            if kind == "copy":
                a.copy_(b)
            elif self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[a], b)
            else:
                self.state_dict[a] = b
        self._apply = []
        check_next_update(self.manifest, self.original_state_dict if self.flatten_state_dict else self.state_dict,
                          where=self._checkpoint_id or "the checkpoint", strict=self.strict)
        return new_plan


def check_next_update(manifest, state_dict, *, where="the checkpoint", strict=False) -> None:
    """Warn (one `JaxguardWarning` line) or, with `strict`, raise when a param group of the
    optimizer state in `state_dict` (as a load installs it) would step with other
    hyperparameters than its guarded moments were certified for
    (`torch_compat.state.check_next_update`).

    Args:
      manifest: the checkpoint's jaxguard manifest (`manifest_of`), or None.
      state_dict: the nested state_dict being loaded (``{"optim": osd, ...}``).
      where: how to name the checkpoint.
      strict: raise instead of warning.

    Raises:
      CheckpointError: (``strict``) the first difference, naming both values.
    """
    if not manifest:
        return
    roots = _optimizer_roots(state_dict)
    for root, osd in roots.items():
        entries, members = [], [[] for _ in osd["param_groups"]]
        for e in manifest.get("moments", {}).values():
            if tuple(e.get("m_path") or ())[:-3] != root or not e.get("shards"):
                continue
            try:
                gi, _ = _group_of(osd, e["param"], root)
            except CheckpointError:
                continue
            members[gi].append(len(entries))
            entries.append({"name": f"optimizer/state/{len(entries)}", "kind": "moments",
                            "config": e["shards"][0].get("config")})
        sd = {"param_groups": [{"params": m} for m in members]}
        _state.check_next_update({"entries": entries}, sd, osd["param_groups"], str(where), strict=strict)


# ---------------------------------------------------------------- offline: whole directories in one process
def is_dcp_dir(path) -> bool:
    """Args: path: a path.  Returns: True when it is a directory with a DCP ``.metadata`` file."""
    return os.path.isdir(path) and os.path.isfile(os.path.join(path, ".metadata"))


def read_metadata(path):
    """The metadata of a DCP directory.

    Args:
      path: the directory.

    Returns:
      ``(DCP metadata, jaxguard manifest or None)``.

    Raises:
      CheckpointError: not a directory, no ``.metadata``, or unreadable metadata.
    """
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: no such directory; pass a torch.distributed.checkpoint directory")
    metadata = load_metadata(path, check_files=True)
    return metadata, manifest_of(metadata)


def load_full(path) -> dict:
    """Load a (guarded or plain) DCP directory into one process as a nested state_dict
    of full tensors, verified as `GuardedLoadPlanner` does (like torch's dcp_to_torch_save).

    Args:
      path: the DCP directory.

    Returns:
      The nested state_dict (``get_state_dict`` layout).

    Raises:
      CheckpointError: as `read_metadata` and `GuardedLoadPlanner` (one line).
    """
    metadata, man = read_metadata(path)
    state: dict = {}
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    for k, v in metadata.state_dict_metadata.items():
        if k.startswith(SHARD_PREFIX):
            continue
        value = torch.empty(v.size, dtype=v.properties.dtype) if isinstance(v, TensorStorageMetadata) else None
        set_element(state, paths[k], value) if k in paths else state.__setitem__(k, value)
    for e in (man or {}).get("moments", {}).values():
        for which in ("m_path", "v_path"):
            set_element(state, tuple(e[which]), torch.empty(e["shape"], dtype=torch.float32))
    fs = GuardedFileSystemReader(path)
    with _unwrapped():
        dcp.load(state, storage_reader=fs, planner=GuardedLoadPlanner(storage_reader=fs), no_dist=True)
    return state


@contextlib.contextmanager
def _unwrapped():
    """Re-raise the jaxguard error inside DCP's CheckpointException (one line, as the CLI prints)."""
    from torch.distributed.checkpoint.api import CheckpointException
    try:
        yield
    except CheckpointException as exc:
        inner = [e for e, _ in exc.failures.values()]
        first = next((e for e in inner if isinstance(e, JaxguardError)), inner[0] if inner else exc)
        if isinstance(first, JaxguardError):
            raise first from None
        raise CheckpointError(f"torch.distributed.checkpoint failed: {_one_line(first)}") from None


def to_torch_checkpoint(state: dict) -> dict:
    """Nested DCP state (get_state_dict layout) -> the CKPT layout of `jaxguard compress`:
    the optimizer state_dict with integer indices and ``param_names`` under "optimizer".

    Args:
      state: from `load_full`.

    Returns:
      The CKPT dict, or `state` unchanged when it holds no single top-level optimizer.
    """
    roots = _optimizer_roots(state)
    top = [r for r in roots if len(r) == 1]
    if len(top) != 1:
        return state
    (root,) = top
    osd = roots[root]
    groups, idx, names = [], {}, []
    for g in osd["param_groups"]:
        ids = []
        for fqn in g["params"]:
            idx.setdefault(fqn, len(idx))
            ids.append(idx[fqn])
        groups.append({**g, "params": ids, "param_names": list(g["params"])})
    sd = {"state": {idx[f]: st for f, st in osd["state"].items() if f in idx}, "param_groups": groups}
    out = {k: v for k, v in state.items() if k != root[0]}
    out["optimizer"] = sd
    return out


def restore_dir(path, output) -> dict:
    """``jaxguard restore DIR -o full.pt``: consolidate into one torch checkpoint.

    Args:
      path: the DCP directory.
      output: the torch file to write.

    Returns:
      {"output", "keys", "seconds"}.

    Raises:
      CheckpointError: as `load_full`.
    """
    from torch_compat.state import save_torch
    t0 = time.perf_counter()
    ckpt = to_torch_checkpoint(load_full(path))
    save_torch(output, ckpt)
    return {"output": os.fspath(output), "keys": sorted(map(str, ckpt)), "seconds": time.perf_counter() - t0}


def compress_dir(src, dst, *, spec=None, tau=None, clip=None, codec=None, bound=None, partition=None,
                 op_model=None, uncertifiable="refuse") -> dict:
    """``jaxguard compress DIR -o DIR2``: a plain DCP directory -> a guarded one (one rank file).

    Args:
      src: the plain DCP directory.
      dst: a new (or empty) output directory.
      spec, tau, clip, codec, bound, partition, op_model: as `GuardedSavePlanner`.
      uncertifiable: as `GuardedSavePlanner`, but ``"refuse"`` by default (the CLI is the
        explicit API: ``jaxguard compress --uncertifiable exact`` asks to store exactly).

    Returns:
      The save summary (totals, ``escape_rate``, ``payload_ratio``, ``encode_seconds``, ``output``).

    Raises:
      CheckpointError: `src` already guarded, `dst` not empty or its parent missing, or
        as `GuardedSavePlanner`.
    """
    _, man = read_metadata(src)
    if man is not None:
        raise CheckpointError(f"{src} is a torch.distributed.checkpoint directory whose moments are compressed already "
                              "(GuardedSavePlanner); restore it first or copy it as is")
    if os.path.exists(dst) and (not os.path.isdir(dst) or os.listdir(dst)):
        raise CheckpointError(f"{dst} exists and is not an empty directory; choose a new output directory")
    parent = os.path.dirname(os.path.abspath(dst))
    if not os.path.isdir(parent):
        raise CheckpointError(f"output directory {parent} does not exist; create it first")
    t0 = time.perf_counter()
    state = load_full(src)
    planner = GuardedSavePlanner(tau=tau, clip=clip, spec=spec, codec=codec, bound=bound, partition=partition,
                                 op_model=op_model, uncertifiable=uncertifiable)
    with storage.atomic_directory(dst) as tmp, _unwrapped(), warnings.catch_warnings():
        # the CLI prints what was stored exactly in its summary, not as a Python warning
        warnings.filterwarnings("ignore", message="GuardedSavePlanner: ", category=JaxguardWarning)
        dcp.save(state, storage_writer=FileSystemWriter(tmp), planner=planner, no_dist=True)
    s = jg_audit.compression_summary(planner.summary, planner.summary["container_bytes"])
    s.update(encode_seconds=time.perf_counter() - t0, output=os.fspath(dst),
             stored_exactly=planner.metadata.planner_data[MANIFEST_KEY]["stored_exactly"])
    return s


def _dir_bytes(path):
    return {f: os.path.getsize(os.path.join(path, f)) for f in sorted(os.listdir(path))
            if os.path.isfile(os.path.join(path, f))}


def inspect_dir(path) -> dict:
    """Header-level summary of a DCP directory (guarded or not).

    Args:
      path: the directory.

    Returns:
      {"format", "files", "bytes_on_disk", "items"} and, when guarded, the contract, the
      shard count, the coordinates/escapes/payload totals, what the shards were certified
      for (``certified_for``, `jaxguard.audit.certified_for`) and ``stored_exactly``.

    Raises:
      CheckpointError: as `read_metadata`.
    """
    metadata, man = read_metadata(path)
    on_disk = _dir_bytes(path)
    files = {getattr(i, "relative_path", None) for i in (metadata.storage_data or {}).values()} | {".metadata"}
    out = {"format": man["format"] if man else "plain-dcp", "files": len(files) - 1,
           "bytes_on_disk": sum(on_disk.get(f, 0) for f in files), "items": len(metadata.state_dict_metadata)}
    if man:
        shards = [s for e in man["moments"].values() for s in e["shards"]]
        n = sum(s["stats"]["coordinates"] for s in shards)
        esc = sum(s["stats"]["escapes"] for s in shards)
        pay = sum(s["stats"]["payload_bytes"] for s in shards)
        out.update({k: man.get(k) for k in ("tau", "clip", "codec", "bound", "partition", "world_size")})
        out.update(moment_tensors=len(man["moments"]), shards=len(shards), coordinates=n, escapes=esc,
                   escape_rate=esc / max(n, 1), payload_bytes=pay, raw_fp32_bytes=8 * n,
                   payload_ratio=pay / max(8 * n, 1), guarded_bytes=sum(s["bytes"] for s in shards))
        out["certified_for"] = jg_audit.certified_for((s.get("config"), s.get("stats")) for s in shards)
        out["stored_exactly"] = [{"param": x, "why": _state.EXACT_REASON} for x in man.get("stored_exactly", ())]
    return out


def verify_dir(path) -> dict:
    """Read every item of every rank file and check it against the manifest.

    Args:
      path: a guarded DCP directory.

    Returns:
      {"ok": True, "files", "tensor_chunks", "bytes_items", "guarded_shards"}.

    Raises:
      CheckpointError: not guarded, or an item that is missing or does not match (one line).
    """
    metadata, man = read_metadata(path)
    if man is None:
        raise CheckpointError(NOT_GUARDED.format(path=path))
    keys = set()
    for idx in (metadata.storage_data or {}):
        m = metadata.state_dict_metadata.get(idx.fqn)
        keys.add(("t", idx.fqn, tuple(idx.offset)) if isinstance(m, TensorStorageMetadata) else ("b", idx.fqn, None))
    fs = FileSystemReader(path)
    fs.read_metadata()
    fs.set_up_storage_reader(metadata, True)
    tensors, objects, shards = read_verified(fs, metadata, man, keys)
    files = {getattr(i, "relative_path", "?") for i in metadata.storage_data.values()}
    return {"ok": True, "files": len(files), "tensor_chunks": len(tensors), "bytes_items": len(objects),
            "guarded_shards": len(shards)}


# ---------------------------------------------------------------- first-update audit after resume
def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def first_update_audit(ref, test, *, tau=DEFAULT_TAU, clip=DEFAULT_CLIP, grid=None, grads=()):
    """The first real optimizer step after two resumes, compared coordinate by coordinate.

    Args:
      ref, test: ``(model, optimizer)`` pairs resumed from the uncompressed and from the
        guarded checkpoint, identically built and sharded (FSDP2 DTensors or plain).
      tau, clip: the contract to check: ``|p_ref - p_test| <= tau * lr`` after one step.
      grid: gradient values; each is applied to every coordinate (default:
        `jaxguard.audit.gradient_grid(clip)`).
      grads: real gradients, a sequence of lists (one tensor per parameter, in
        ``model.parameters()`` order, local or DTensor like the parameter), clamped to
        ``[-clip, clip]`` (the range the guarantee covers; the count clamped is reported).

    Returns:
      {"coordinates" (local to this rank), "gradients", "violations" (coordinates of
      this rank over tau for some gradient), "max_gap_lr", "clamped"}; both pairs are
      left in their resumed state.
    """
    grid = jg_audit.gradient_grid(clip) if grid is None else grid
    pairs = [ref, test]
    params = [list(m.parameters()) for m, _ in pairs]
    lrs = {}
    for g in ref[1].param_groups:
        for p in g["params"]:
            lrs[id(p)] = float(_state.scalar_value(g["lr"], "lr"))
    snaps = []
    for (model, opt), ps in zip(pairs, params):
        snaps.append(([p.detach().clone() for p in ps],
                      [{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in opt.state[p].items()}
                       for p in ps]))
    tally = jg_audit.AuditTally(tau)
    clamped = 0
    cases = [("grid", float(g)) for g in grid] + [("real", list(gs)) for gs in grads]
    for kind, g in cases:
        after = []
        for (model, opt), ps, snap in zip(pairs, params, snaps):
            _restore_snapshot(opt, ps, snap)
            for i, p in enumerate(ps):
                if kind == "grid":
                    p.grad = torch.full_like(p, g)
                else:
                    p.grad = g[i].detach().clamp(-clip, clip).clone()
            opt.step()
            opt.zero_grad(set_to_none=True)
            after.append([_local(p).detach().clone() for p in ps])
        if kind == "real":
            clamped += sum(int((_local(x.detach()).abs() > clip).sum()) for x in g)
        for i, (a, b) in enumerate(zip(*after)):
            tally.add(i, a.cpu().numpy(), b.cpu().numpy(), lrs[id(params[0][i])], label=kind)
    for (model, opt), ps, snap in zip(pairs, params, snaps):
        _restore_snapshot(opt, ps, snap)
    return tally.summary(len(cases), clamped=clamped).to_json(with_clamped=True)


# ---------------------------------------------------------------- the CLI verbs on directories
def _restore_snapshot(opt, ps, snap) -> None:
    """Put parameters and optimizer state back as `first_update_audit` snapshotted them."""
    psnap, ssnap = snap
    with torch.no_grad():
        for p, s, st in zip(ps, psnap, ssnap):
            p.copy_(s)
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    opt.state[p][k].copy_(v)
                else:
                    opt.state[p][k] = v
