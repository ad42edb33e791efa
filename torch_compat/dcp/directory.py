"""The CLI's verbs on a DCP directory, in one process: read its metadata, load it whole,
restore to a torch checkpoint, compress a plain DCP directory, inspect, verify, audit."""
from __future__ import annotations

__all__ = [ 'read_metadata', 'load_full', 'restore_dir', 'compress_dir',
           'inspect_dir', 'verify_dir', 'first_update_audit']

import contextlib
import os
import time
import warnings

import torch
import torch.distributed.checkpoint as dcp

from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
try:
    from torch.distributed.tensor import DTensor
except ImportError:   # torch 2.4: DTensor was public only as torch.distributed._tensor
    from torch.distributed._tensor import DTensor

from jaxguard import audit as jg_audit
from jaxguard.format.spec import DEFAULT_CLIP, DEFAULT_TAU
from jaxguard.format import storage
from jaxguard.errors import CheckpointError, JaxguardError, JaxguardWarning
from torch_compat import state as _state
from torch_compat.dcp_metadata import load_metadata
from torch_compat.dcp.layout import MANIFEST_KEY, NOT_GUARDED, SHARD_PREFIX, one_line, optimizer_roots, manifest_of
from torch_compat.dcp.save_planner import GuardedSavePlanner
from torch_compat.dcp.verified_read import read_verified
from torch_compat.dcp.load_planner import GuardedFileSystemReader, GuardedLoadPlanner


# ---------------------------------------------------------------- offline: whole directories in one process
def _is_dcp_dir(path) -> bool:
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
        raise CheckpointError(f"torch.distributed.checkpoint failed: {one_line(first)}") from None


def _to_torch_checkpoint(state: dict) -> dict:
    """Nested DCP state (get_state_dict layout) -> the CKPT layout of `jaxguard compress`:
    the optimizer state_dict with integer indices and ``param_names`` under "optimizer".

    Args:
      state: from `load_full`.

    Returns:
      The CKPT dict, or `state` unchanged when it holds no single top-level optimizer.
    """
    roots = optimizer_roots(state)
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
    ckpt = _to_torch_checkpoint(load_full(path))
    save_torch(output, ckpt)
    return {"output": os.fspath(output), "keys": sorted(map(str, ckpt)), "seconds": time.perf_counter() - t0}


def compress_dir(src, dst, *, spec=None, tau=None, clip=None, codec=None, op_model=None,
                 uncertifiable="refuse") -> dict:
    """``jaxguard compress DIR -o DIR2``: a plain DCP directory -> a guarded one (one rank file).

    Args:
      src: the plain DCP directory.
      dst: a new (or empty) output directory.
      spec, tau, clip, codec, op_model: as `GuardedSavePlanner`.
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
    planner = GuardedSavePlanner(tau=tau, clip=clip, spec=spec, codec=codec, op_model=op_model,
                                 uncertifiable=uncertifiable)
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
