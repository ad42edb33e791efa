"""Container v1 writer, and loading on top of the numpy-only reader.

Layout (docs/format.md): ``JAXGUARD`` magic, u32 version, u32 flags, u64 header length,
JSON header, payload, SHA-256 of everything before it.  Writes are atomic: a temporary
file in the target directory, fsync, rename, fsync of the directory.

Which sections an entry gets (its layout) and which stored tables it needs come from the
codec registry, `jaxguard.format.spec`.  Like the whole format layer, this module imports
only the standard library, numpy, `jaxguard.errors` and `jaxguard.format`.
"""
from __future__ import annotations

__all__ = ["Raw", "Pieces", "Moments", "checked_entry", "numpy_dtype_name", "build", "write_stream",
           "HASH_BESIDE_FROM", "PayloadSink", "IN_PLACE_AFTER", "BEHIND_FROM", "SAMPLE_EVERY", "atomic_write",
           "atomic_write_with", "read", "entries_by_name"]

import functools
import hashlib
import io
import json
import mmap
import os
import tempfile
import threading
from typing import Any, NamedTuple

import numpy as np

from jaxguard.format import entropy, packed, rans, reader, spec, storage
from jaxguard.errors import ContainerError

SCHEMA = "jaxguard-container"


class Raw(NamedTuple):
    """A container entry stored exactly: `array` as it is (``dtype``: the container dtype
    name when it is not numpy's, e.g. ``"bfloat16"`` for uint16 bits; None: numpy's name)."""

    name: str
    array: Any
    dtype: str | None = None


class Pieces:
    """A flat float32 array kept as its consecutive pieces: the certified values of a tensor
    certified a slab-sized piece at a time (`jaxguard.core.guard.join_pieces`).  The writer
    hashes the pieces in order and gathers its sampled blocks from them, so the tensor's
    values are never joined into fresh memory (8 bytes a coordinate: 0.76 GB of GPT-2's
    moments, about 1 CPU-second of page faults and copies); ``np.asarray`` joins them.

    Args:
      parts: 1-D arrays in order.
    """

    def __init__(self, parts):
        self.parts = [np.asarray(p).reshape(-1) for p in parts]
        self.offsets = np.cumsum([0] + [p.size for p in self.parts]).astype(np.int64)
        self.size = int(self.offsets[-1])
        self.shape = (self.size,)
        self.dtype = np.result_type(*self.parts) if self.parts else np.dtype(np.float32)

    def __len__(self):
        return self.size

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate(self.parts) if self.parts else np.zeros(0, self.dtype)
        return out if dtype is None else out.astype(dtype, copy=False)

    def take(self, idx) -> np.ndarray:
        """The values at flat positions, gathered piece by piece (``np.asarray(self)[idx]``).

        Args:
          idx: an int array of positions in ``[0, size)``.

        Returns:
          An array of `idx`'s shape.
        """
        idx = np.asarray(idx, np.int64)
        out = np.empty(idx.shape, self.dtype)
        flat, dst = idx.reshape(-1), out.reshape(-1)
        if flat.size > 1 and not (flat[1:] >= flat[:-1]).all():
            order = np.argsort(flat, kind="stable")
            dst[order] = self.take(flat[order])
            return out
        # sorted positions: each piece's are one run, found by bisection (no sort, no masks)
        cuts = np.searchsorted(flat, self.offsets)
        for i, part in enumerate(self.parts):
            a, b = cuts[i], cuts[i + 1]
            if b > a:
                dst[a:b] = part[flat[a:b] - self.offsets[i]]
        return out


def _parts(x):
    """The consecutive flat pieces of certified values (a `Pieces`, or one array)."""
    return x.parts if isinstance(x, Pieces) else [np.asarray(x).reshape(-1)]


def _take(x, idx):
    return x.take(idx) if isinstance(x, Pieces) else x[idx]


class Moments(NamedTuple):
    """A guarded moment pair: `encoded` is a `jaxguard.core.encoded.Encoded` (arrays, codec,
    shape, stats and, from the one writer `jaxguard.writer`, the certified values ``decoded``);
    `info` is the entry's ``config`` (the `GuardConfig` JSON plus the adapter's fields)."""

    name: str
    encoded: Any
    info: dict


def checked_entry(e):
    """`e` if it is a container entry (`Raw` or `Moments`).

    Args:
      e: what a writer was handed as an entry.

    Returns:
      `e`.

    Raises:
      ContainerError: anything else (e.g. the untyped tuples of older code), in one line.
    """
    if isinstance(e, (Raw, Moments)):
        return e
    raise ContainerError(f"a container entry is a {type(e).__name__}; pass jaxguard.format.container.Raw or "
                         "Moments (jaxguard.writer builds them from MomentJob / Raw records)")


def _le_bytes(arr) -> np.ndarray:
    """`arr`'s bytes as a flat uint8 array: little-endian, C order, any dtype (bfloat16 too)."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)


class _Sections:
    """One entry's sections, laid out back to back in a buffer the writer reuses from
    entry to entry (`body`).

    The sections used to be appended to a fresh ``io.BytesIO`` per entry: two copies a
    section holding the GIL (``tobytes``, then the write) and fresh memory for every
    entry, ~250 MB of page faults on GPT-2's moments.  Here each section is copied once,
    by numpy (which releases the GIL for large copies), into memory the previous entries
    already faulted in."""

    def __init__(self, scratch):
        self.parts, self.size, self.scratch = [], 0, scratch

    def add(self, arr) -> list:
        """Append an array's bytes, little-endian, C order (any dtype, bfloat16 too).

        Args:
          arr: a numpy array.

        Returns:
          ``[start, end]``, its byte range in the entry.
        """
        flat = _le_bytes(arr)
        b = self.size
        self.parts.append(flat)
        self.size += flat.size
        return [b, self.size]

    def body(self) -> np.ndarray:
        """Returns: the sections as one uint8 array, valid until the next entry's `body`."""
        if self.scratch[0].size < self.size:
            self.scratch[0] = np.empty(max(self.size, self.scratch[0].size * 5 // 4), np.uint8)
        out = self.scratch[0][:self.size]
        b = 0
        for part in self.parts:
            out[b:b + part.size] = part
            b += part.size
        self.parts = []
        return out


def numpy_dtype_name(arr) -> str:
    """The container dtype name of `arr` (numpy's name, e.g. ``"float32"``).

    Args:
      arr: a numpy array (or anything with a ``dtype``).

    Returns:
      Its dtype name, one of `jaxguard.format.reader.DTYPES`.

    Raises:
      ContainerError: a dtype the container cannot store (the message lists those it can).
    """
    name = np.dtype(arr.dtype).name
    if name not in reader.DTYPES:
        raise ContainerError(f"dtype {name} cannot be stored; supported: {', '.join(reader.DTYPES)}")
    return name


def build(entries, meta: dict, *, extra_header: dict | None = None) -> bytes:
    """The bytes of a container holding `entries`, in memory.

    Args:
      entries: a list of `Raw` (stored as is) and `Moments` (a guarded moment pair) entries.
      meta: a JSON-able dict stored as the header's ``meta``.
      extra_header: more top-level header fields (e.g. the op model, the replay variant).

    Returns:
      The whole container (prefix, header, payload, trailing SHA-256).

    Raises:
      ContainerError: a dtype that cannot be stored, an entry the numpy reader refuses as
        written, or certified values (`Encoded.decoded`) that the reader's decode of the
        sampled blocks disagrees with.
    """
    out, scratch = io.BytesIO(), io.BytesIO()
    _write(out, scratch, entries, meta, extra_header)
    return out.getvalue()


def write_stream(path, entries, meta: dict, *, extra_header: dict | None = None,
                 expected_entries: int | None = None) -> int:
    """Write a container to `path` atomically from an *iterable* of entries (as for
    `build`), consuming them one at a time: each entry's sections go to a scratch file in
    the target directory (the temporary directory for an fsspec URL) as soon as it is
    produced, so memory holds one entry, not the payload.  The header (offsets, both
    SHA-256) is written first and the scratch payload copied after it; a large local
    container (payload over `IN_PLACE_AFTER` bytes, `expected_entries` known) moves to the
    output file once, with room left for the header, and the rest of its payload is
    written there directly (`_InPlace`): one write of the payload instead of two.

    Args:
      path: a local path (its directory must exist) or an fsspec URL.
      entries: an iterable of entries as for `build`.
      meta, extra_header: as for `build`.
      expected_entries: how many entries `entries` yields (None: ``len(entries)`` for a
        list, else unknown and the payload goes through the scratch file).

    Returns:
      The size of the written file in bytes.

    Raises:
      ContainerError: as `build`; the target is then left as it was.
    """
    directory = None
    if not storage.is_url(path):
        directory = os.path.dirname(os.path.abspath(storage.local_path(path))) or "."
        if not os.path.isdir(directory):
            raise ContainerError(f"output directory {directory} does not exist; create it first")
    size = []
    prefix = "." + os.path.basename(os.fspath(path)) + "."
    if expected_entries is None and isinstance(entries, (list, tuple)):
        expected_entries = len(entries)
    with tempfile.TemporaryFile(prefix=prefix, suffix=".payload", dir=directory) as scratch:
        atomic_write_with(path, lambda fh: size.append(_write(fh, scratch, entries, meta, extra_header,
                                                              expected_entries=expected_entries)))
    return size[0]


# A write of at least this many bytes is hashed in a thread while it is written.  A GPT-2
# compress writes its 498 MB of parameters after the last moments, with nothing left to run
# beside it: 0.73 s with the SHA-256 after each write (2-core AMD EPYC).
HASH_BESIDE_FROM = 1 << 22


class PayloadSink:
    """Appends arrays to a container's scratch payload, hashing as it goes (the one place
    the writer copies an entry's bytes out of the caller's arrays).

    Args:
      fh: the binary file object the payload goes to.
    """

    def __init__(self, fh):
        self.fh, self.pos, self.sha = fh, 0, hashlib.sha256()

    def write(self, data) -> list:
        """Append `data`.

        Args:
          data: bytes-like.

        Returns:
          ``[start, end]``, its byte range in the payload.
        """
        b = self.pos
        if memoryview(data).nbytes >= HASH_BESIDE_FROM:   # the two release the GIL: one core each
            hashing = _InThread(functools.partial(self.sha.update, data), "jaxguard-hash")
            try:
                self.fh.write(data)
            finally:
                hashing.join()
        else:
            self.fh.write(data)
            self.sha.update(data)
        self.pos += len(data)
        return [b, self.pos]

    def add(self, arr) -> list:
        """Append an array's bytes, little-endian, C order (any dtype, bfloat16 too).

        Args:
          arr: a numpy array.

        Returns:
          ``[start, end]``, its byte range in the payload.
        """
        return self.write(_le_bytes(arr))


COPY_CHUNK = 1 << 24
# A streamed local container whose payload passes this many bytes is moved to the output
# file (room left for the header) and written there from then on (`_InPlace`); smaller
# ones are copied from the scratch file after the header, byte for byte as before.  At
# 256 MiB a GPT-2 compress (262 MiB of payload) crossed it with its last entries and still
# copied nearly all of it (0.64 s); from 32 MiB it copies 0.04 s, and the header's room
# (646 KB for a 216 KB header) is 0.08% of the 773 MB file.
IN_PLACE_AFTER = 1 << 25


def _write(out, scratch, entries, meta, extra_header, *, expected_entries=None) -> int:
    pay = PayloadSink(scratch)
    in_place = _InPlace.possible(out, scratch, expected_entries)
    header_entries = []
    tables, table_arrays = {}, {}
    decoded = _BehindHash()
    sample = _SampleCheck(table_arrays)
    reused = [np.empty(0, np.uint8)]   # every moments entry's sections (`_Sections.body`)
    # a list is scanned first so that the tables lead the payload (the layout `build`
    # always wrote); a stream adds them before its first entry that uses them
    if isinstance(entries, (list, tuple)):
        for e in map(checked_entry, entries):
            if isinstance(e, Moments):
                _add_tables(pay, tables, table_arrays, _codec_spec(e.encoded.codec, e.name).tables)
    for i, e in enumerate(map(checked_entry, entries)):
        if in_place is not None and not in_place.active and pay.pos >= max(IN_PLACE_AFTER, in_place.next_try):
            in_place.start(pay, header_entries, meta, seen=i)
        name = e.name
        if isinstance(e, Raw):
            arr = np.asarray(e.array)
            dtype = e.dtype or numpy_dtype_name(arr)
            header_entries.append({"name": name, "kind": "raw", "dtype": dtype, "shape": list(arr.shape),
                                   "offsets": pay.add(arr)})
            continue
        enc, info = e.encoded, e.info
        a = enc.arrays
        n = enc.n
        cs = _codec_spec(enc.codec, name)
        _add_tables(pay, tables, table_arrays, cs.tables)
        local = _Sections(reused)     # this entry's sections, decoded by the reader before they are written
        if cs.layout in ("packed", "ans"):
            sections = _aw_sections(local, enc, rans_coded=cs.layout == "ans")
        elif cs.layout == "zstd":
            sections = _zstd_sections(local, enc)
        else:
            mask = np.zeros(n, bool)
            mask[a["escape_index"]] = True
            pairs = np.stack([a["escape_m"], a["escape_v"]], axis=1).astype(np.float32)
            sections = {
                "m_codes": local.add(a["m_codes"]), "v_codes": local.add(a["v_codes"]),
                "m_params": local.add(a["m_params"].astype(np.float32)),
                "v_params": local.add(a["v_params"].astype(np.float32)),
                "escape_mask": local.add(np.packbits(mask, bitorder="little")), "escape_pairs": local.add(pairs),
            }
        entry = {"name": name, "kind": "moments", "codec": enc.codec, "shape": list(enc.shape),
                 "sections": sections, "config": info, "stats": _jsonable(enc.stats)}
        body = local.body()
        m, v = _decoded_moments(entry, body, table_arrays, getattr(enc, "decoded", None), n, sample)
        # m~ then v~, hashed while the next entries are written: a copy where the reader's
        # decode is a view of `body`, which the next entry overwrites
        decoded.update([part.copy() if np.may_share_memory(part, body) else part
                        for part in (np.ascontiguousarray(x, "<f4") for x in (*_parts(m), *_parts(v)))])
        del m, v
        b0 = pay.write(body)[0]
        del body
        entry["sections"] = {k: [b0 + r[0], b0 + r[1]] for k, r in sections.items()}
        header_entries.append(entry)
    sample.flush()
    decoded = decoded.finish()
    header = {"schema": SCHEMA, "version": reader.VERSION, **(extra_header or {}), "meta": meta,
              "tables": tables, "entries": header_entries, "payload_bytes": pay.pos,
              "payload_sha256": pay.sha.hexdigest(), "decoded_sha256": decoded.hexdigest()}
    hbytes = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if in_place is not None and in_place.active:
        return in_place.finish(hbytes, pay.pos)
    trailer = hashlib.sha256()
    head = reader.PREFIX.pack(reader.MAGIC, reader.VERSION, 0, len(hbytes)) + hbytes
    out.write(head)
    trailer.update(head)
    _copy_scratch(scratch, out, trailer)
    out.write(trailer.digest())
    return len(head) + pay.pos + reader.TRAILER


BEHIND_FROM = 1 << 20   # bytes of an entry's decoded values hashed in a thread of their own


class _InThread(threading.Thread):
    """``fn()`` started in a daemon thread; `join` waits for it and raises what it raised."""

    def __init__(self, fn, name):
        super().__init__(name=name, daemon=True)
        self.fn, self.error = fn, None
        self.start()

    def run(self):
        try:
            self.fn()
        except BaseException as exc:  # noqa: BLE001 - raised by join, in the caller's thread
            self.error = exc

    def join(self, timeout=None):
        super().join(timeout)
        if self.error is not None:
            raise self.error


class _BehindHash:
    """A SHA-256 fed in a thread of its own, one entry behind the writer: the decoded hash
    (8 bytes a coordinate, the writer's largest) runs while the entry's payload is hashed
    and written.  `update` waits for the previous entry's arrays first, so at most one
    entry's arrays are held; `finish` waits and returns the hashlib object."""

    def __init__(self):
        self.sha, self.thread = hashlib.sha256(), None

    def _wait(self):
        if self.thread is not None:
            thread, self.thread = self.thread, None
            thread.join()

    def _hash(self, arrays):
        for a in arrays:
            self.sha.update(a)

    def update(self, arrays) -> None:
        """Hash `arrays` (bytes-like, in order) after everything given before."""
        self._wait()
        if sum(memoryview(a).nbytes for a in arrays) < BEHIND_FROM:   # a thread costs more than it saves
            self._hash(arrays)
        else:
            self.thread = _InThread(functools.partial(self._hash, arrays), "jaxguard-hash")

    def finish(self):
        """Returns: the hashlib object, once every update is in."""
        self._wait()
        return self.sha


class _InPlace:
    """The payload of a large streamed container written into the output file itself.

    Once the payload passes `IN_PLACE_AFTER`, what the scratch file holds is copied to
    the output at ``PREFIX + room`` and the rest of the payload is written there directly.
    ``room`` is the header's estimated size (what is known of it, and the entries still to
    come at 1.5 times the mean size so far); the header is padded to it with spaces (JSON
    allows trailing whitespace, so readers are unchanged), or, if it outgrew the room,
    the payload is moved forward by the difference in the file.  The trailer's SHA-256 is
    then read back from the page cache: one write of the payload and two reads, where the
    scratch route wrote it twice.  Declined (the scratch route kept) when the room would
    exceed 1/16 of the payload so far (tried again when it doubled)."""

    def __init__(self, out, scratch, expected, fd):
        self.out, self.scratch, self.expected, self.fd = out, scratch, expected, fd
        self.active, self.room, self.next_try = False, 0, 0

    @classmethod
    def possible(cls, out, scratch, expected):
        if expected is None or scratch is None or not hasattr(os, "preadv"):
            return None
        try:
            fd = out.fileno()
            if not out.seekable() or out.tell() != 0:
                return None
        except (AttributeError, OSError, io.UnsupportedOperation):   # in memory (build, fsspec URLs)
            return None
        return cls(out, scratch, expected, fd)

    def start(self, pay, header_entries, meta, seen) -> None:
        """Move the payload to the output and write there from now on, unless the room
        is too large for the payload so far (then tried again once the payload doubled)."""
        done = len(json.dumps(header_entries, separators=(",", ":"), allow_nan=False))
        known = done + len(json.dumps(meta, separators=(",", ":"), allow_nan=False)) + 4096
        remaining = max(int(self.expected) - seen, 0)
        room = known + int(1.5 * remaining * done / max(seen, 1)) + 4096
        if 16 * room > pay.pos:
            self.next_try = 2 * max(pay.pos, 1)
            return
        self.scratch.flush()
        self.out.seek(reader.PREFIX.size + room)
        _copy_scratch(self.scratch, self.out)
        self.scratch.truncate(0)
        pay.fh, self.room, self.active = self.out, room, True

    def finish(self, hbytes, payload_bytes):
        """Write the header and the trailer around the payload in place; returns the file's size."""
        start = reader.PREFIX.size + self.room
        self.out.flush()
        if len(hbytes) > self.room:     # the header outgrew its room: move the payload forward
            _move_forward(self.fd, start, payload_bytes, len(hbytes) - self.room)
        else:
            hbytes = hbytes + b" " * (self.room - len(hbytes))
        head = reader.PREFIX.pack(reader.MAGIC, reader.VERSION, 0, len(hbytes)) + hbytes
        _pwrite_full(self.fd, head, 0)
        # the disk takes the header and payload while their SHA-256 is read back: the
        # caller's fsync after the trailer then has 32 bytes left (GPT-2: 0.23-0.30 s less)
        early = _InThread(functools.partial(os.fsync, self.fd), "jaxguard-fsync")
        try:
            trailer = hashlib.sha256(head)
            _hash_range(self.fd, len(head), payload_bytes, trailer)
        finally:
            early.join()
        self.out.seek(len(head) + payload_bytes)
        self.out.write(trailer.digest())
        return len(head) + payload_bytes + reader.TRAILER


def _hash_range(fd, start, length, sha) -> None:
    """Add bytes ``[start, start + length)`` of `fd` to `sha`: through read-only mappings of
    `COPY_CHUNK` bytes at a time (no copy out of the page cache: 0.45 s against 0.58 s for
    773 MB; one window at a time, so the mapped pages never add more than that to the
    resident size), else `os.preadv`."""
    end = start + length
    pos = start
    try:
        while pos < end:
            base = pos - pos % mmap.ALLOCATIONGRANULARITY
            size = min(end, base + COPY_CHUNK) - base
            with mmap.mmap(fd, size, access=mmap.ACCESS_READ, offset=base) as window:
                view = memoryview(window)
                try:
                    sha.update(view[pos - base:size])
                finally:
                    view.release()
            pos = base + size
        return
    except (OSError, ValueError):   # no mapping here (a pipe, a special file): read it
        if pos != start:
            raise
    buf = memoryview(bytearray(min(COPY_CHUNK, max(length, 1))))
    while pos < end:
        n = _pread_full(fd, buf[:min(len(buf), end - pos)], pos)
        sha.update(buf[:n])
        pos += n


def _copy_scratch(scratch, out, sha=None) -> None:
    """Append the scratch payload, from its start, to `out` (and to `sha` if given)."""
    scratch.seek(0)
    while True:
        chunk = scratch.read(COPY_CHUNK)
        if not chunk:
            break
        out.write(chunk)
        if sha is not None:
            sha.update(chunk)


def _pread_full(fd, buf, offset) -> int:
    """Fill `buf` from `fd` at `offset` (a short read is continued); returns len(buf)."""
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n <= 0:
            raise ContainerError(f"the container being written ended early at byte {offset + got} on reading it back")
        got += n
    return got


def _pwrite_full(fd, data, offset) -> None:
    """Write all of `data` to `fd` at `offset` (a short write is continued)."""
    data = memoryview(data)
    while data:
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _move_forward(fd, start, length, by):
    """Move bytes ``[start, start + length)`` of `fd` to ``start + by`` (from the end back,
    so a range overlapping its destination is copied whole)."""
    buf = memoryview(bytearray(min(COPY_CHUNK, max(length, 1))))
    pos = start + length
    while pos > start:
        n = min(len(buf), pos - start)
        pos -= n
        _pread_full(fd, buf[:n], pos)
        _pwrite_full(fd, buf[:n], pos + by)


# the writer's agreement check decodes every SAMPLE_EVERY-th block (and each entry's
# first and last) with the numpy reader
SAMPLE_EVERY = 64
SAMPLE_BATCH = 1 << 12     # sampled blocks decoded per reader call (entries batched per codec)


def _decoded_moments(entry, body, tables, certified, n, sample):
    """The (m~, v~) the decoded hash records for one moments entry as written.

    With the guard's certified values at hand (`Encoded.decoded`) those are hashed, so the
    hash records what was certified; the numpy reader reads the entry as written and a
    sample of its blocks goes to `sample` (a `_SampleCheck`), which decodes it and compares
    bit for bit.  Without them (another writer) the reader decodes the whole entry."""
    name = entry["name"]
    try:
        if certified is None or isinstance(certified, dict):
            m, v = reader.read_moments(entry, body, tables)
        else:   # a zstd entry's codes decoded frame by frame, only at the sampled positions
            codes = reader.read_codes(entry, body, tables, lazy=True)
    except reader.ReaderError as exc:
        raise ContainerError(f"the reader refused entry {name!r} as written: {exc}") from None
    if certified is None:
        return m, v
    if isinstance(certified, dict):   # a sample of what a jitted encode certified (jaxguard.jit_state)
        _check_sampled(name, m, v, certified)
        return m, v
    m, v = (x if isinstance(x, Pieces) else np.asarray(x).reshape(-1) for x in certified)
    if m.dtype != np.float32 or v.dtype != np.float32 or m.size != n or v.size != n:
        raise ContainerError(f"entry {name!r}: its certified values are {m.dtype}[{m.size}] and {v.dtype}[{v.size}], "
                             f"expected float32[{n}]; encode it again with jaxguard.core.guard.encode")
    if n:
        try:
            sample.add(name, entry["codec"], codes, m, v, n)
        except entropy.StreamError as exc:   # a lazily read zstd frame the reader refuses
            raise ContainerError(f"the reader refused entry {name!r} as written: {exc}") from None
    return m, v


def _check_sampled(name, m, v, certified):
    """The reader's decode `m`, `v` of an entry against the certified values at
    ``certified["positions"]`` (``"m"``, ``"v"``), bit for bit."""
    pos = np.asarray(certified["positions"], np.int64)
    cm, cv = (np.asarray(certified[k], np.float32).reshape(-1) for k in ("m", "v"))
    m, v = np.asarray(m).reshape(-1), np.asarray(v).reshape(-1)
    if cm.size != pos.size or cv.size != pos.size or (pos.size and (pos.min() < 0 or pos.max() >= m.size)):
        raise ContainerError(f"entry {name!r}: its certified sample does not match the entry ({pos.size} positions, "
                             f"{cm.size} and {cv.size} values, {m.size} coordinates); encode it again")
    bad = (m[pos].view(np.uint32) != cm.view(np.uint32)) | (v[pos].view(np.uint32) != cv.view(np.uint32))
    if bad.any():
        j = int(np.argmax(bad))
        i = int(pos[j])
        raise ContainerError(f"entry {name!r}: the numpy reader decodes coordinate {i} (block {i // spec.BLOCK}) "
                             f"to ({m[i]!r}, {v[i]!r}) but the guard certified ({cm[j]!r}, {cv[j]!r}); "
                             "nothing was written")


class _SampleCheck:
    """Sampled blocks of many entries, decoded by the numpy reader a batch at a time (per
    codec: the reader decodes block by block) and compared with the certified values."""

    def __init__(self, tables):
        self.tables, self.pending, self.blocks = tables, {}, {}

    def add(self, name, codec, codes, m, v, n):
        nb = -(-n // spec.BLOCK)
        blocks = np.arange(0, nb, SAMPLE_EVERY)
        if blocks[-1] != nb - 1:
            blocks = np.append(blocks, nb - 1)
        pos = (blocks[:, None] * spec.BLOCK + np.arange(spec.BLOCK)).reshape(-1)
        at = np.minimum(pos, n - 1)    # past the end: a copy of the last code, never compared
        esc = codes["escape_index"]
        if esc.size:
            b = esc // spec.BLOCK
            sel = np.flatnonzero((b % SAMPLE_EVERY == 0) | (b == nb - 1))
            k = np.searchsorted(blocks, b[sel]) * spec.BLOCK + esc[sel] % spec.BLOCK
            pairs = codes["escape_pairs"][sel]
        else:
            k, pairs = esc[:0], codes["escape_pairs"][:0]
        item = (name, pos, pos < n, codes["m_codes"][at], codes["v_codes"][at], codes["m_params"][blocks],
                codes["v_params"][blocks], k, pairs, _take(m, at), _take(v, at))
        self.pending.setdefault(codec, []).append(item)
        self.blocks[codec] = self.blocks.get(codec, 0) + blocks.size
        if self.blocks[codec] >= SAMPLE_BATCH:
            self.flush(codec)

    def flush(self, codec=None):
        for c in [codec] if codec is not None else list(self.pending):
            items = self.pending.pop(c, [])
            self.blocks[c] = 0
            if items:
                self._check(c, items)

    def _check(self, codec, items):
        cat = [np.concatenate([it[j] for it in items]) for j in range(3, 7)]
        sizes = [it[1].size for it in items]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        try:
            ms, vs = reader.decode_codes(codec, int(sum(sizes)), *cat, self.tables)
        except reader.ReaderError as exc:
            raise ContainerError(f"the reader refused entry {items[0][0]!r} as written: {exc}") from None
        ms, vs = ms.copy(), vs.copy()
        k = np.concatenate([it[7] + s for it, s in zip(items, starts)]).astype(np.int64)
        pairs = np.concatenate([it[8] for it in items])
        ms[k], vs[k] = pairs[:, 0], pairs[:, 1]
        want_m, want_v, inside = (np.concatenate([it[j] for it in items]) for j in (9, 10, 2))
        bad = ((ms.view(np.uint32) != want_m.view(np.uint32)) | (vs.view(np.uint32) != want_v.view(np.uint32))) & inside
        if bad.any():
            j = int(np.argmax(bad))
            e = int(np.searchsorted(starts, j, side="right")) - 1
            name, i = items[e][0], int(items[e][1][j - starts[e]])
            raise ContainerError(f"entry {name!r}: the numpy reader decodes coordinate {i} (block {i // spec.BLOCK}) "
                                 f"to ({ms[j]!r}, {vs[j]!r}) but the guard certified ({want_m[j]!r}, "
                                 f"{want_v[j]!r}); nothing was written")


def _codec_spec(codec, name):
    try:
        return spec.get(codec)
    except spec.UnknownCodecError as exc:
        raise ContainerError(f"entry {name!r}: {exc}") from None


def _add_tables(pay, tables, table_arrays, names):
    """Append the stored tables `names` not yet in the payload (in the registry's order)."""
    for t in names:
        if t not in tables:
            table_arrays[t] = np.asarray(spec.TABLES[t](), np.float32)
            tables[t] = pay.add(table_arrays[t])


KEPT_SECTIONS = "_sections"   # an encoding's sections as its codec built them: (the arrays they came from, sections)


def kept_sections(enc):
    """The sections the guard already built from exactly this encoding's arrays (its payload
    stat; `jaxguard.core.codecs`), or None: the writer then does not build them again.

    Args:
      enc: an `Encoded` (its sections are kept only while its arrays are the very same objects).
    """
    kept = getattr(enc, KEPT_SECTIONS, None)
    if (kept is not None and kept[0].keys() == enc.arrays.keys()
            and all(enc.arrays[k] is a for k, a in kept[0].items())):
        return kept[1]
    return None


def _zstd_sections(pay, enc) -> dict:
    """Sections of a log8-rel-zstd entry (`entropy.entry_sections`, or those kept on the encoding)."""
    arrays = kept_sections(enc)
    try:
        arrays = arrays if arrays is not None else entropy.entry_sections(enc.arrays, enc.n)
    except packed.PackError as exc:
        raise ContainerError(f"cannot store {enc.codec} moments: {exc}") from None
    return {k: pay.add(a) for k, a in arrays.items()}


def _aw_sections(pay, enc, rans_coded=False) -> dict:
    """Sections of a logrel-aw / logrel-ans entry (`packed.entry_sections`), appended to `pay`
    in the order the first release wrote them (the escape positions first).  An encoding
    whose sections the guard already built from these very arrays (logrel-ans: the payload
    stat) is not encoded again."""
    arrays = kept_sections(enc)
    try:
        arrays = arrays if arrays is not None else packed.entry_sections(enc.arrays, enc.n, entropy=rans_coded)
    except (packed.PackError, rans.RansError) as exc:
        raise ContainerError(f"cannot store {enc.codec} moments: {exc}") from None
    esc = next(k for k in arrays if k in spec.ESCAPE_FORMS)
    ranges = {esc: pay.add(arrays[esc])}
    ranges.update((k, pay.add(a)) for k, a in arrays.items() if k != esc)
    return {k: ranges[k] for k in arrays}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        x = float(x)
        return x if np.isfinite(x) else str(x)
    return x


def atomic_write(path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves either the old file or the new one
    (`jaxguard.format.storage.atomic_write`: local paths and fsspec URLs).

    Args:
      path: a local path or an fsspec URL.
      data: the whole file.

    Raises:
      ContainerError: the write failed (one line, e.g. a full disk); no partial file is left.
    """
    storage.atomic_write(path, data)


def atomic_write_with(path, write) -> None:
    """`atomic_write` for a writer (`jaxguard.format.storage.atomic_write_with`): ``write(fh)``
    fills a temporary file beside `path` (e.g. ``torch.save(obj, fh)``), then renamed over it.

    Args:
      path: a local path or an fsspec URL.
      write: ``write(fh)`` writes the file's content to the binary file object `fh`.

    Raises:
      ContainerError: the write failed (one line); no partial file is left.
      Whatever `write` raised otherwise; no partial file is left.
    """
    storage.atomic_write_with(path, write)


def read(path, *, verify_decoded: bool = True):
    """Parse and check a container at a local path or fsspec URL.

    Args:
      path: the container.
      verify_decoded: also decode every moments entry and check the decoded-moments SHA-256.

    Returns:
      (header dict, payload memoryview, tables dict).

    Raises:
      ContainerError: one line naming the file and what failed (bad magic, checksum, layout,
        decoded hash, ...).
    """
    data = storage.read_bytes(path)  # a writable buffer for local files: raw arrays can be used in place
    try:
        header, payload = reader.parse(data)
        if verify_decoded and reader.decoded_digest(header, payload) != header.get("decoded_sha256"):
            raise reader.ReaderError("decoded moments SHA-256 mismatch")
        tables = reader.read_tables(header, payload)
    except reader.ReaderError as exc:
        raise ContainerError(f"{path}: {exc}") from None
    return header, payload, tables


def entries_by_name(header, payload, tables, *, verify_decoded: bool = False) -> dict:
    """{name: ndarray} for raw entries and {name: (m~, v~)} for moments entries.

    With `verify_decoded`, the decoded moments are hashed as they are decoded and checked
    against the header's ``decoded_sha256`` (one decode instead of two).

    Args:
      header, payload, tables: as `read` returns them.
      verify_decoded: check the decoded-moments hash while decoding.

    Returns:
      {name: ndarray} for raw entries and {name: (m~, v~) float32} for moments entries.

    Raises:
      ContainerError: an entry the reader refuses, or a decoded-hash mismatch.
    """
    out = {}
    digest = hashlib.sha256()
    try:
        pre = reader.decode_rans_entries(header["entries"], payload)   # every rANS section in one lane loop
        for k, e in enumerate(header["entries"]):
            if e["kind"] == "raw":
                out[e["name"]] = reader.read_raw(e, payload)
            else:
                m, v = reader.read_moments(e, payload, tables, pre.get(k))
                out[e["name"]] = (m, v)
                if verify_decoded:
                    digest.update(np.ascontiguousarray(m, "<f4").tobytes())
                    digest.update(np.ascontiguousarray(v, "<f4").tobytes())
    except reader.ReaderError as exc:
        raise ContainerError(str(exc)) from None
    if verify_decoded and digest.hexdigest() != header.get("decoded_sha256"):
        raise ContainerError("decoded moments SHA-256 mismatch: the decoder disagrees with the writer")
    return out
