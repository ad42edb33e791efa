"""Load: every overlapping chunk and shard read and verified during planning, the targets
written only in ``finish_plan`` (`GuardedLoadPlanner`), and the next-update check."""
from __future__ import annotations

__all__ = ['GuardedFileSystemReader', 'GuardedLoadPlanner', 'check_next_update']

import math
import os
import warnings

import numpy as np
import torch

from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list, _create_read_items
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.checkpoint.utils import find_state_dict_object
try:
    from torch.distributed.tensor import DTensor
except ImportError:   # torch 2.4: DTensor was public only as torch.distributed._tensor
    from torch.distributed._tensor import DTensor

from jaxguard.errors import CheckpointError, ConfigError, JaxguardWarning
from torch_compat import state as _state
from torch_compat.dcp_metadata import load_metadata
from torch_compat.dcp.layout import group_of, offsets_key, optimizer_roots, manifest_of
from torch_compat.dcp.verified_read import read_verified


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


def _where_dcp_reads(metadata) -> str:
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
        self._told = checkpoint_id is not None    # False: the path is the metadata's (_where_dcp_reads)
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
            self._checkpoint_id, self._told = _where_dcp_reads(metadata), False
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
            src = narrow_tensor_by_index(tensors[offsets_key(ri.storage_index.fqn, ri.storage_index.offset)],
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
    roots = optimizer_roots(state_dict)
    for root, osd in roots.items():
        entries, members = [], [[] for _ in osd["param_groups"]]
        for e in manifest.get("moments", {}).values():
            if tuple(e.get("m_path") or ())[:-3] != root or not e.get("shards"):
                continue
            try:
                gi, _ = group_of(osd, e["param"], root)
            except CheckpointError:
                continue
            members[gi].append(len(entries))
            entries.append({"name": f"optimizer/state/{len(entries)}", "kind": "moments",
                            "config": e["shards"][0].get("config")})
        sd = {"param_groups": [{"params": m} for m in members]}
        _state.check_next_update({"entries": entries}, sd, osd["param_groups"], str(where), strict=strict)
