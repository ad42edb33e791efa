"""The manifest of a sharded checkpoint directory: its names, its schema, and the checks that
read it as untrusted input (no JAX: JSON, the storage layer and the reader's dtype names).

A sharded checkpoint (`jaxguard.sharded`) is one container per process plus ``manifest.json``::

    DIR/process_00000.<SAVE>.jaxguard   one container v1 (docs/format.md) per process
    DIR/process_00000.<SAVE>.jaxguard.index.json   its index, until the manifest is committed
    DIR/manifest.json                   written last, by the primary process, in one atomic replace

The manifest holds the tree (dotted leaf paths, global shapes, dtypes), the sites' guard
configurations, every shard's file, global start offset, shape, byte range and SHA-256, and each
file's size and trailing SHA-256.  `check_tiling` is the one rule that a set of shards (or DCP
chunks: `torch_compat.dcp_metadata` calls it too) covers a leaf exactly once.
"""
from __future__ import annotations

__all__ = ["MANIFEST", "SCHEMA", "VERSION", "INDEX_SUFFIX", "MAX_MANIFEST_BYTES", "MAX_ELEMENTS", "path_text",
           "file_name", "index_name", "owned_save_id", "is_manifest_tmp", "is_count", "is_counts", "check_tiling",
           "read_manifest", "parse_manifest", "validate_manifest", "check_coverage", "check_files", "element_count"]

import json
import math
import os
import re

from jaxguard.errors import CheckpointError, ContainerError
from jaxguard.format import reader, storage

MANIFEST = "manifest.json"
SCHEMA = "jaxguard-sharded"
VERSION = 1
INDEX_SUFFIX = ".index.json"
MAX_MANIFEST_BYTES = 1 << 30
MAX_ELEMENTS = 1 << 48      # per leaf: more is no real array, only a manifest that would make us allocate it
MAX_COUNT = 1 << 62
_SAVE_ID = re.compile(r"^[0-9a-f]{24}$")
# a process file or its index (either layout), or the temporary name storage writes it under
_OWNED = re.compile(r"^\.?process_(\d{5})(?:\.([0-9a-f]{24}))?\.jaxguard(?:\.index\.json)?(?:\.[0-9a-f]+\.tmp)?$")
_FILE = re.compile(r"^process_\d{5}(?:\.[0-9a-f]{24})?\.jaxguard$")
_MANIFEST_TMP = re.compile(r"^\.manifest\.json\.[0-9a-f]+\.tmp$")


def path_text(path) -> str:
    """Args: path: a local path, `os.PathLike` or fsspec URL.  Returns: it as a string."""
    return os.fspath(path) if isinstance(path, os.PathLike) else str(path)


def file_name(process: int, save_id: str | None = None) -> str:
    """The name of one process's container file.

    Args:
      process: a process index.
      save_id: the save's id (`new_save_id`); None gives the older layout's name.

    Returns:
      ``process_NNNNN.<save_id>.jaxguard`` (``process_NNNNN.jaxguard`` without an id).
    """
    return f"process_{process:05d}.jaxguard" if save_id is None else f"process_{process:05d}.{save_id}.jaxguard"


def index_name(process: int, save_id: str | None = None) -> str:
    """Args: process, save_id: as `file_name`.  Returns: the name of that file's index."""
    return file_name(process, save_id) + INDEX_SUFFIX


def owned_save_id(name: str):
    """Whether `name` is a process file, an index or a temporary one of theirs, and of which save.

    Args:
      name: a file name in a checkpoint directory.

    Returns:
      False for a name no save owns; None for the older layout's; else the save id.
    """
    m = _OWNED.match(name)
    return m.group(2) if m else False


def is_manifest_tmp(name: str) -> bool:
    """Args: name: a file name.  Returns: whether it is a temporary manifest (an interrupted commit's)."""
    return bool(_MANIFEST_TMP.match(name))


def is_count(x, lo: int = 0, hi: int = MAX_COUNT) -> bool:
    """Args: x: a parsed value; lo, hi: its bounds.  Returns: whether `x` is an int (not a bool) in [lo, hi]."""
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def is_counts(xs, n: int | None = None, hi: int = MAX_COUNT) -> bool:
    """Args: xs: a parsed value; n: its length (None: any); hi: each count's bound.
    Returns: whether `xs` is a list or tuple of `is_count` values."""
    return isinstance(xs, (list, tuple)) and (n is None or len(xs) == n) and all(is_count(x, 0, hi) for x in xs)


def element_count(shape, what: str) -> int:
    """The number of elements of `shape`, refused beyond `MAX_ELEMENTS` before anything is allocated.

    Args:
      shape: a list of counts.
      what: what to name in the error.

    Returns:
      The product of `shape`.

    Raises:
      ContainerError: more than `MAX_ELEMENTS` elements.
    """
    n = math.prod(shape)
    if n > MAX_ELEMENTS:
        raise ContainerError(f"{what} has shape {list(shape)} ({n} elements, over {MAX_ELEMENTS}); the manifest "
                             "is corrupt")
    return n


def check_tiling(source: str, name: str, shape, tiles) -> None:
    """The one tiling rule of a stored leaf: every tile lies inside it, no two tiles overlap,
    and together they cover it (their sizes add up to its size; a leaf has at least one tile).

    Numerical contract
    ------------------
    Exact integer arithmetic (Python ints) on the tiles' boxes: inside, pairwise disjoint and
    of the leaf's total size is exactly "every element is stored once", so a reader that
    assembles the leaf from its tiles fills every element and none twice.

    Args:
      source: what to name in the error (a file or directory).
      name: the leaf's name.
      shape: the leaf's shape (counts).
      tiles: ``[(tile name, start offsets, sizes)]``.

    Raises:
      CheckpointError: a tile is malformed or outside the leaf, two tiles overlap, or the
        tiles do not cover it (one line naming the tiles or the leaf).
    """
    got = 0
    for tile, start, sizes in tiles:
        if not is_counts(start, len(shape)) or not is_counts(sizes, len(shape)) or \
                any(a + n > m for a, n, m in zip(start, sizes, shape)):
            raise CheckpointError(f"{source}: shard {str(tile)[:80]!r} lies outside {name[:80]!r} (shape "
                                  f"{list(shape)[:8]}); the checkpoint's metadata is corrupt")
        got += math.prod(sizes)
    total = math.prod(shape)
    if got != total or not tiles:
        raise CheckpointError(f"{source}: the shards of {name[:80]!r} hold {got} of its {total} elements; the "
                              "checkpoint is incomplete or its metadata corrupt (two processes wrote one shard?)")
    _check_disjoint(source, name, tiles)


def _check_disjoint(source, name, tiles):
    """No two non-empty tiles share an element: a sweep along the first dimension compares a
    tile only with the tiles whose rows it meets (one, for the usual row sharding)."""
    boxes = sorted(((list(start), list(sizes), tile) for tile, start, sizes in tiles if math.prod(sizes)),
                   key=lambda b: (b[0], b[1]))
    open_boxes: list = []
    for start, sizes, tile in boxes:
        if start:
            open_boxes = [b for b in open_boxes if b[0][0] + b[1][0] > start[0]]
        for s2, z2, t2 in open_boxes:
            if all(a < b + m and b < a + n for a, n, b, m in zip(start, sizes, s2, z2)):
                raise CheckpointError(f"{source}: shards {str(t2)[:80]!r} and {str(tile)[:80]!r} of {name[:80]!r} "
                                      "overlap; the checkpoint's metadata is corrupt")
        open_boxes.append((start, sizes, tile))


def check_coverage(man: dict, source: str) -> None:
    """Every leaf a manifest stores is tiled by its shards (`check_tiling`).

    Args:
      man: a manifest whose leaves and shards are well formed (`validate_manifest`, or one
        a commit just built).
      source: what to name in errors.

    Raises:
      CheckpointError: as `check_tiling`.
    """
    for leaf in man["state"]["leaves"] + (man.get("params") or []):
        check_tiling(source, leaf["path"], leaf["shape"],
                     [(r["name"], r["start"], r["shape"]) for r in man["shards"].get(leaf["entry"], [])])


def check_files(man, directory) -> None:
    """Every file the manifest names is there, with the size it records.

    Args:
      man: a manifest (`read_manifest`).
      directory: the checkpoint directory.

    Raises:
      CheckpointError: one line naming the first missing or short file.
    """
    d = path_text(directory)
    for fname, f in man["files"].items():
        p = storage.join(d, fname)
        try:
            got = storage.size(p)
        except (OSError, ContainerError):
            got = None
        if got is None:
            raise CheckpointError(f"{d}: {fname}, named by {MANIFEST}, is missing: the checkpoint is incomplete "
                                  "(a partial copy, or its files were removed); load an earlier checkpoint")
        if got != f["bytes"]:
            raise CheckpointError(f"{d}: {fname} holds {got} bytes where {MANIFEST} records {f['bytes']}: the "
                                  "file is truncated or replaced; load an earlier checkpoint")


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
    d = path_text(path)
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


def _bad(source, what):
    return ContainerError(f"{source}: {what}; the manifest is corrupt or not jaxguard's")


def _check_leaf(leaf, source, raw_only):
    if not isinstance(leaf, dict) or not isinstance(leaf.get("path"), str) or not isinstance(leaf.get("entry"), str):
        raise _bad(source, f"a leaf record {str(leaf)[:80]} has no string path and entry")
    shape = leaf.get("shape")
    if not isinstance(shape, list) or len(shape) > 32 or not is_counts(shape, hi=MAX_ELEMENTS):
        raise _bad(source, f"leaf {leaf['path'][:80]!r} has an invalid shape {str(shape)[:80]}")
    element_count(shape, f"{source}: leaf {leaf['path'][:80]!r}")
    kind = "raw" if raw_only else leaf.get("kind")
    if kind not in ("mu", "nu", "raw"):
        raise _bad(source, f"leaf {leaf['path'][:80]!r} has unknown kind {str(kind)[:40]!r}")
    if not isinstance(leaf.get("dtype"), str) or leaf["dtype"] not in reader.DTYPES:
        raise _bad(source, f"leaf {leaf['path'][:80]!r} has unsupported dtype {str(leaf.get('dtype'))[:40]!r}")


def _check_range(rng, size, what, source):
    if not isinstance(rng, list) or len(rng) != 2 or not is_count(rng[0]) or not is_count(rng[1]) or \
            not rng[0] <= rng[1] <= size:
        raise _bad(source, f"{what} has byte range {str(rng)[:60]} outside its file of {size} bytes")


def validate_manifest(man: dict, source: str = MANIFEST) -> None:
    """Check a parsed manifest before anything is allocated or opened from it: file names
    (no paths), sizes, byte ranges inside their files, leaf shapes and dtypes, the Adam
    sites' records, shard placements inside their leaves, and that the shards tile every leaf.

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
        if not isinstance(f, dict) or not is_count(f.get("bytes")) or not isinstance(f.get("sha256"), str):
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
    sites = state.get("sites", [])
    if not isinstance(sites, list) or not all(
            isinstance(s, dict) and isinstance(s.get("path", ""), str) and isinstance(s.get("config") or {}, dict)
            and isinstance((s.get("config") or {}).get("op_model") or "", str) for s in sites):
        raise _bad(source, "'state' has 'sites' that are not records of a string path and a config object")
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
                if not isinstance(v, list) or len(v) > 32 or not is_counts(v, hi=MAX_ELEMENTS):
                    raise _bad(source, f"shard {r['name'][:80]!r} has an invalid {k} {str(v)[:60]}")
            _check_range(r.get("range"), files[r["file"]]["bytes"], f"shard {r['name'][:80]!r}", source)
    if not is_count(man.get("process_count"), 1, 1 << 20):
        raise _bad(source, f"process_count {str(man.get('process_count'))[:40]} is not a positive count")
    if "save_id" in man and not (isinstance(man["save_id"], str) and _SAVE_ID.match(man["save_id"])):
        raise _bad(source, f"save_id {str(man['save_id'])[:40]!r} is not 24 hex digits")
    if not isinstance(man.get("summary", {}), dict):
        raise _bad(source, "'summary' is not an object")
    check_coverage(man, source)
