"""``jaxguard restore`` without importing torch: the container's tree written in torch.save's
zip format by the standard library and numpy (its reader, which ``jaxguard compress`` uses,
is `jaxguard.format.torchzip`).

`torch_compat.state.restore_tree` + ``torch.save`` (the other restore path) imports torch
(1.4-4 s), builds every tensor, and ``torch.save`` copies each one into the file again.  Here
the pickle of the tree (`data.pkl`) is written from the container's header before any data,
the raw entries pass from the container (mapped read-only) into the file as they are, and the
moments are decoded on a thread pool one window ahead of the writer, into buffers lent again
once written, so decoding, hashing, CRC-32 and the writes share the cores and the process
touches little memory for the first time (what a restore costs on a VM:
the restore profile at commit ef4a91c).  Each zip record is laid down once, its CRC-32
computed beforehand (`_Records`).  What torch.load returns is the same object, tensor for tensor and
bit for bit, as ``torch.save(restore_tree(path)[0])`` (tests/cli/test_restore_fast.py).

Every check of `restore_tree` runs: the trailer's and the payload's SHA-256 (in threads,
`reader.parse_deferred`), the layout, every raw entry's dtype and range, every moments
entry's decode, and the decoded-moments SHA-256; the output is renamed into place only after
all of them passed (`container.atomic_write_with`), so a file that fails leaves nothing.

The file: records ``data.pkl``, ``.format_version`` (1), ``.storage_alignment`` (64),
``byteorder`` (little), ``data/<key>`` (stored, 64-byte aligned, one storage per tensor,
keys in pickling order), ``version`` (3), ``.data/serialization_id``: what torch 2.x writes.
The pickle is protocol 2 with only the globals torch's ``weights_only`` loader allows
(``torch._utils._rebuild_tensor_v2``, ``collections.OrderedDict``, ``torch.<Type>Storage``).
"""
from __future__ import annotations

__all__ = ["AHEAD_BYTES", "CHUNK", "GROUP", "SUB", "WINDOW", "RANS_WINDOW", "CRC_BESIDE_FROM", "restore"]

import os
import pickle
import queue
import stat
import struct
import threading
import zipfile
import zlib

import numpy as np

from jaxguard.errors import CheckpointError, ContainerError
from jaxguard.format import integrity, reader
from jaxguard.format.torchzip import STORAGES, Unsupported

ALIGN = 64
# Decoded moments the decoder thread may hand ahead of the writer, in bytes (at least one
# entry).  A checkpoint whose parameters come first (GPT-2: 498 MB of them before its 124M
# moments) is written for ~0.8 s before the writer takes a moment; two entries ahead, the
# decoder sat idle through that and the writer then waited 2.3 s for it.
AHEAD_BYTES = 1 << 28


# ---------------------------------------------------------------- the pickle (protocol 2)
class _Pickle:
    def __init__(self):
        self.out = [pickle.PROTO + b"\x02"]
        self.storages = []          # (entry name, which: None | "m" | "v", container dtype, shape)
        self.storage_index = {}     # (entry name, which) -> its place in `storages`: a tied weight's two keys, one storage

    def plain(self, x):
        """A JSON value as ``from_skeleton`` returns it (no tags inside)."""
        w = self.out.append
        if x is None:
            w(pickle.NONE)
        elif x is True:
            w(pickle.NEWTRUE)
        elif x is False:
            w(pickle.NEWFALSE)
        elif isinstance(x, int):
            if 0 <= x < 256:
                w(pickle.BININT1 + bytes([x]))
            elif 0 <= x < 65536:
                w(pickle.BININT2 + struct.pack("<H", x))
            elif -2**31 <= x < 2**31:
                w(pickle.BININT + struct.pack("<i", x))
            else:
                enc = pickle.encode_long(x)
                if len(enc) >= 256:
                    raise Unsupported("an integer too long for LONG1")
                w(pickle.LONG1 + bytes([len(enc)]) + enc)
        elif isinstance(x, float):
            w(pickle.BINFLOAT + struct.pack(">d", x))
        elif isinstance(x, str):
            b = x.encode("utf-8", "surrogatepass")
            w(pickle.BINUNICODE + struct.pack("<I", len(b)) + b)
        elif isinstance(x, list):
            w(pickle.EMPTY_LIST)
            if x:
                w(pickle.MARK)
                for v in x:
                    self.plain(v)
                w(pickle.APPENDS)
        elif isinstance(x, dict):
            w(pickle.EMPTY_DICT)
            if x:
                w(pickle.MARK)
                for k, v in x.items():
                    self.plain(k)
                    self.plain(v)
                w(pickle.SETITEMS)
        else:
            raise Unsupported(type(x).__name__)

    def tuple_(self, items):
        if not items:
            self.out.append(pickle.EMPTY_TUPLE)
            return
        self.out.append(pickle.MARK)
        for v in items:
            self.plain(v)
        self.out.append(pickle.TUPLE)

    def tensor(self, name, which, dtype, shape):
        storage = STORAGES.get(dtype)
        if storage is None:
            raise Unsupported(f"dtype {dtype}")
        numel = int(np.prod(shape, dtype=np.int64)) if shape else 1
        stride, acc = [], 1
        for d in reversed(shape):
            stride.append(acc)
            acc *= max(d, 1)
        w = self.out.append
        w(pickle.GLOBAL + b"torch._utils\n_rebuild_tensor_v2\n")
        w(pickle.MARK)
        w(pickle.MARK)
        self.plain("storage")
        w(pickle.GLOBAL + b"torch\n" + storage.encode() + b"\n")
        index = self.storage_index.get((name, which))
        if index is None:
            index = self.storage_index[(name, which)] = len(self.storages)
            self.storages.append((name, which, dtype, tuple(shape)))
        self.plain(str(index))
        self.plain("cpu")
        self.plain(numel)
        w(pickle.TUPLE)
        w(pickle.BINPERSID)
        self.plain(0)
        self.tuple_(list(shape))
        self.tuple_(stride[::-1])
        w(pickle.NEWFALSE)
        w(pickle.GLOBAL + b"collections\nOrderedDict\n")
        w(pickle.EMPTY_TUPLE)
        w(pickle.REDUCE)
        w(pickle.TUPLE)
        w(pickle.REDUCE)

    def tree(self, sk, entries):
        """`torch_compat.state.from_skeleton`'s object, pickled."""
        if isinstance(sk, dict):
            ref = reader.skeleton_ref(sk, entries)
            if "__tensor__" in sk:
                e = entries[ref]
                if e["kind"] != "raw":
                    raise Unsupported("a __tensor__ naming a moments entry")
                return self.tensor(ref, None, e.get("dtype"), e["shape"])
            if "__moment__" in sk:
                e = entries[ref]
                if e["kind"] != "moments":
                    raise Unsupported("a __moment__ naming a raw entry")
                return self.tensor(ref, "m" if sk["which"] == "m" else "v", "float32", e["shape"])
            w = self.out.append
            if "__dict__" in sk:
                w(pickle.EMPTY_DICT)
                if sk["__dict__"]:
                    w(pickle.MARK)
                    for k, v in sk["__dict__"]:
                        self.plain(k)
                        self.tree(v, entries)
                    w(pickle.SETITEMS)
                return
            if "__list__" in sk:
                w(pickle.EMPTY_LIST)
                if sk["__list__"]:
                    w(pickle.MARK)
                    for v in sk["__list__"]:
                        self.tree(v, entries)
                    w(pickle.APPENDS)
                return
            if "__tuple__" in sk:
                if not sk["__tuple__"]:
                    w(pickle.EMPTY_TUPLE)
                    return
                w(pickle.MARK)
                for v in sk["__tuple__"]:
                    self.tree(v, entries)
                w(pickle.TUPLE)
                return
            if "__float__" in sk:
                return self.plain(float(sk["__float__"]))
            if any(k in sk for k in ("__ndarray__", "__npscalar__", "__namespace__")):
                raise Unsupported("numpy values or an argparse.Namespace")   # torch_compat.restore_tree + torch.save
        return self.plain(sk)

    def bytes(self):
        return b"".join(self.out) + pickle.STOP


# ---------------------------------------------------------------- the decoder thread
CHUNK = 1 << 20    # coordinates of one decode task (a whole number of blocks)
GROUP = 1 << 16    # entries of up to this many coordinates are decoded several to a task (up to
                   # `CHUNK` a task): the hand-offs of a task per tiny entry cost more than its decode
SUB = 1 << 16      # coordinates decoded at once inside a task: cache-sized temporaries, reused by malloc
WINDOW = 1 << 23   # coordinates decoded ahead of the writer (bounds the memory held)
RANS_WINDOW = 1 << 22   # coordinates whose rANS sections are decoded in one lane loop
CRC_GROUP = 1 << 23   # bytes of raw entries per CRC-32 task (a task per tiny tensor cost more than its CRC)
CRC_BESIDE_FROM = 1 << 20   # bytes of a decoded moment from which its CRC-32 runs beside the decoded hash


def _decode_part(cs_id, a, b, codes, tables, m, v):
    """Decode coordinates [a, b) of an entry's fixed-form codes into `m`, `v`, `SUB` at a
    time (the decodes are per block and per coordinate: a block range decodes as it does
    in the whole).  Codes read lazily (a log8-rel-zstd entry's frames) are decoded here,
    in this task."""
    mq, vq = codes["m_codes"][a:b], codes["v_codes"][a:b]
    for s in range(a, b, SUB):
        e = min(s + SUB, b)
        ba, bb = s // reader.BLOCK, -(-e // reader.BLOCK)
        mm, vv = reader.decode_codes(cs_id, e - s, mq[s - a:e - a], vq[s - a:e - a],
                                     codes["m_params"][ba:bb], codes["v_params"][ba:bb], tables)
        m[s:e] = mm
        v[s:e] = vv


class _Buffers:
    """Float32 (m, v) buffers handed back by the writer once written, lent again to later
    entries: a fresh array costs a page fault per page on first touch (~10 us a 4 KiB page
    on the VM this was measured on), a lent one none."""

    def __init__(self):
        self.free = []            # [(capacity, m, v)]
        self.lent = {}            # entry name -> (capacity, m, v)
        self.lock = threading.Lock()

    def take(self, name, n):
        with self.lock:
            fits = [b for b in self.free if b[0] >= n]
            if fits:
                buf = min(fits, key=lambda b: b[0])
                self.free.remove(buf)
            else:
                buf = (n, np.empty(n, np.float32), np.empty(n, np.float32))
            self.lent[name] = buf
        return buf[1][:n], buf[2][:n]

    def give_back(self, name):
        with self.lock:
            buf = self.lent.pop(name, None)
            if buf is not None:
                self.free.append(buf)


class _Decoder(threading.Thread):
    """Decodes every moments entry in header order on a pool of `workers` threads (large
    entries split into block ranges, small ones, up to `GROUP` coordinates, several to a
    task), hashing the decoded moments in header order as the writer's ``decoded_sha256``
    was computed; entries are handed to
    the writer in that order, at most about `WINDOW` coordinates ahead of it."""

    def __init__(self, header, payload, tables, workers=None):
        super().__init__(name="jaxguard-restore-decode", daemon=True)
        self.header, self.payload, self.tables = header, payload, tables
        self.workers = workers or min(8, os.cpu_count() or 1)
        self.q = queue.Queue()
        self.queued, self.room = 0, threading.Condition()    # bytes in `q`, and its wait
        self.stop = threading.Event()
        self.digest = integrity.hasher(integrity.header_hash(header))
        self.stash = {}
        self.buffers = _Buffers()

    def _rans_window(self, entries, k, pre):
        """Decode the ``mv_rans`` sections of entries k, k+1, ... (about `RANS_WINDOW`
        coordinates) in one lane loop (`reader.decode_rans_entries`) into `pre`; returns the
        first entry not covered.  A window at a time, so the writer starts after the first
        one and the symbols held stay bounded."""
        j, size = k, 0
        while j < len(entries) and (j == k or size < RANS_WINDOW):
            if entries[j].get("kind") == "moments":
                size += reader.shape_size(entries[j])[1]
            j += 1
        pre.update({k + i: sym for i, sym in reader.decode_rans_entries(entries[k:j], self.payload).items()})
        return j

    def _submit_group(self, pool, group):
        """(entry, futures, finish) of each entry of `group` (``[(entry, rANS symbols)]``,
        small entries in header order), decoded one after the other in one task: a task per
        tiny entry cost more in hand-offs than its decode."""
        def decode_all():
            return [reader.read_moments(e, self.payload, self.tables, sym) for e, sym in group]
        fut = pool.submit(decode_all)
        return [(e, [fut], lambda i=i: fut.result()[i]) for i, (e, _) in enumerate(group)]

    def _submit(self, pool, k, e, pre):
        """(entry, futures, finish) of one entry's decode tasks (one task up to `CHUNK`
        coordinates, else a task per `CHUNK` coordinates)."""
        _, n = reader.shape_size(e)
        if n <= CHUNK:
            fut = pool.submit(reader.read_moments, e, self.payload, self.tables, pre.pop(k, None))
            return e, [fut], lambda: fut.result()
        codes = reader.read_codes(e, self.payload, self.tables, pre.pop(k, None), lazy=True)
        cs_id = e["codec"]
        m, v = self.buffers.take(e["name"], n)
        futs = [pool.submit(_decode_part, cs_id, a, min(a + CHUNK, n), codes, self.tables, m, v)
                for a in range(0, n, CHUNK)]

        def finish():
            for f in futs:
                f.result()
            idx, pairs = codes["escape_index"], codes["escape_pairs"]
            m[idx] = pairs[:, 0]
            v[idx] = pairs[:, 1]
            shape = e["shape"]
            return m.reshape(shape), v.reshape(shape)
        return e, futs, finish

    def run(self):
        from concurrent.futures import ThreadPoolExecutor
        from collections import deque
        try:
            entries = self.header["entries"]
            pre, upto = {}, 0   # rANS symbols decoded ahead of the entries' tasks, a window at a time
            todo = deque((k, e) for k, e in enumerate(entries) if e.get("kind") == "moments")
            with ThreadPoolExecutor(self.workers, thread_name_prefix="jaxguard-decode") as pool, \
                    ThreadPoolExecutor(1, thread_name_prefix="jaxguard-restore-crc") as crcs:
                pending, ahead = deque(), 0
                while todo or pending:
                    group, grouped = [], 0    # entries up to `GROUP` coordinates, `CHUNK` a task
                    while todo and (not pending or ahead < WINDOW) and not self.stop.is_set():
                        k, e = todo.popleft()
                        if k >= upto:
                            upto = self._rans_window(entries, k, pre)
                        n = reader.shape_size(e)[1]
                        small = n <= min(GROUP, CHUNK)
                        if small:
                            group.append((e, pre.pop(k, None)))
                            grouped += n
                        if group and (grouped >= CHUNK or not small):   # a full group, or a large entry next
                            pending.extend(self._submit_group(pool, group))
                            group, grouped = [], 0
                        if not small:
                            pending.append(self._submit(pool, k, e, pre))
                        ahead += n
                    if group:
                        pending.extend(self._submit_group(pool, group))
                    if self.stop.is_set():
                        return
                    e, _, finish = pending.popleft()
                    ahead -= reader.shape_size(e)[1]
                    m, v = finish()
                    m, v = np.ascontiguousarray(m, "<f4"), np.ascontiguousarray(v, "<f4")
                    big = m.nbytes >= CRC_BESIDE_FROM   # CRC-32s beside the hash (a task costs more than a small CRC)
                    beside = [crcs.submit(zlib.crc32, _bytes(x)) for x in (m, v)] if big else []
                    self.digest.update(m)
                    self.digest.update(v)
                    crc = [c.result() for c in beside] or [zlib.crc32(_bytes(x)) for x in (m, v)]
                    self._put((e["name"], ((m, crc[0]), (v, crc[1]))), m.nbytes + v.nbytes)
            self._put(None)
        except BaseException as exc:   # noqa: BLE001 - handed to the writer, which raises it
            self._put(exc)

    def _put(self, item, nbytes=0):
        """Hand `item` to the writer once `AHEAD_BYTES` allow it (an empty queue takes any)."""
        with self.room:
            while self.queued and self.queued + nbytes > AHEAD_BYTES:
                if self.stop.is_set():
                    return
                self.room.wait(0.1)
            self.queued += nbytes
        self.q.put((item, nbytes))

    def _next(self):
        item, nbytes = self.q.get()
        with self.room:
            self.queued -= nbytes
            self.room.notify()
        if isinstance(item, BaseException):
            raise item
        return item

    def take(self, name):
        """``((m~, CRC-32), (v~, CRC-32))`` of moments entry `name` (entries decoded
        before it are kept)."""
        while name not in self.stash:
            item = self._next()
            if item is None:
                raise ContainerError(f"moments entry {name!r} was not decoded")
            self.stash[item[0]] = item[1]
        return self.stash[name]

    def drop(self, name):
        """The writer is done with entry `name`: its buffers may be lent again."""
        self.stash.pop(name, None)
        self.buffers.give_back(name)

    def finish(self):
        """Decode the rest (entries the tree does not name still count in the hash)."""
        while True:
            item = self._next()
            if item is None:
                return self.digest.hexdigest()


# ---------------------------------------------------------------- restore
def _bytes(arr):
    """A C-contiguous array's bytes as a flat uint8 memoryview (no copy)."""
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))


class _Records:
    """torch.save's zip records laid down in one sequential pass: each local header is
    written once, its CRC-32 and size known beforehand (`zipfile.ZipFile.writestr` writes
    it, then seeks back to write it again after the data: three ``lseek`` calls a record,
    and a page written twice); `zipfile` writes the central directory and end records
    from the same `ZipInfo`s, so the file is byte for byte the one `writestr` writes."""

    def __init__(self, fh):
        self.fh = fh
        self.zf = zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED, allowZip64=True)
        self.pos = self.zf.start_dir

    def add(self, name, buf, crc=None, align=False):
        """Write record `name` holding `buf` (bytes or a flat uint8 memoryview), whose
        CRC-32 is `crc` (None: computed here)."""
        n = len(buf)
        zi = _zinfo(name, self.pos, n, align)
        zi.file_size = zi.compress_size = n
        zi.CRC = zlib.crc32(buf) if crc is None else crc
        zi.header_offset = self.pos
        head = zi.FileHeader(n * 1.05 > zipfile.ZIP64_LIMIT)   # zip64 as writestr decides it
        self.fh.write(head)
        self.fh.write(buf)
        self.pos += len(head) + n
        zf = self.zf
        zf.filelist.append(zi)
        zf.NameToInfo[zi.filename] = zi
        zf.start_dir = self.pos            # where close() writes the central directory
        zf._didModify = True

    def close(self):
        self.zf.close()


def _zinfo(name, offset, size, align):
    zi = zipfile.ZipInfo(f"archive/{name}", date_time=(1980, 1, 1, 0, 0, 0))
    zi.compress_type = zipfile.ZIP_STORED
    zi.external_attr = 0o600 << 16       # what writestr gives a record (?rw-------)
    if align:
        z64 = 20 if size * 1.05 > zipfile.ZIP64_LIMIT else 0
        base = offset + 30 + len(zi.filename.encode("utf-8")) + 4 + z64
        pad = (-base) % ALIGN
        zi.extra = b"FB" + struct.pack("<H", pad) + b"\0" * pad
    return zi


class _Writeback:
    """Starts the disk writes of what was written so far (``fdatasync`` in a thread, every
    `EVERY` bytes), so that the fsync `container.atomic_write_with` makes before its
    rename waits for the last part only; the same durability, overlapped with the work."""

    EVERY = 1 << 28

    def __init__(self, fh):
        try:
            self.fd = fh.fileno()
        except (AttributeError, OSError, ValueError):   # an in-memory buffer (URL outputs)
            self.fd = None
        self.since, self.th = 0, None

    def wrote(self, n):
        self.since += n
        if self.fd is None or self.since < self.EVERY or (self.th is not None and self.th.is_alive()):
            return
        self.since = 0
        self.th = threading.Thread(target=self._sync, name="jaxguard-writeback", daemon=True)
        self.th.start()

    def _sync(self):
        try:
            os.fdatasync(self.fd)
        except OSError:   # the final fsync reports what matters
            pass

    def join(self):
        if self.th is not None:
            self.th.join()


def _read(path):
    """The container's bytes, each read once (hashed and decoded from this one copy).

    A local regular file is mapped read-only (its pages come from the page cache, where a
    file written or read lately already is: no copy, and no fresh memory to fault in); a
    URL, or a file that cannot be mapped, is read through `storage.read_bytes`.  A mapped
    file must not be truncated or rewritten in place while it is restored (jaxguard's
    writers replace a file by rename, never in place); `torch.load(mmap=True)`, which
    `jaxguard compress` uses, asks the same.
    """
    import mmap
    from jaxguard.format import storage
    if storage.is_url(path):
        return storage.read_bytes(path)
    try:
        with open(storage.local_path(path), "rb") as fh:
            st = os.fstat(fh.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                raise OSError("not a regular, non-empty file")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            mapped = mmap.mmap(fh.fileno(), st.st_size, flags=flags, prot=mmap.PROT_READ)
    except (OSError, ValueError, AttributeError, TypeError):   # TypeError: no flags/prot (Windows)
        return storage.read_bytes(path)      # its bytes, or its one-line error naming the file
    return memoryview(mapped)


def restore(path, output) -> bool:
    """Write the torch checkpoint held by container `path` to `output` (torch.save's format).

    Args:
      path: the container (local path or fsspec URL).
      output: the torch file to write (atomically: nothing is left if a check fails).

    Returns:
      True when written; False (nothing written, nothing raised) when the tree holds
      something only torch.save writes (the caller then uses `restore_tree` + torch.save).

    Raises:
      ContainerError: the file is damaged (a hash, the layout, an entry).
      CheckpointError: the container holds another framework's checkpoint or names an
        entry it does not hold.
    """
    from jaxguard.format import container
    data = _read(path)
    try:
        header, payload, wait = reader.parse_deferred(data)
    except reader.ReaderError as exc:
        raise ContainerError(f"{path}: {exc}") from None
    try:
        tables = reader.read_tables(header, payload)
        entries = {}
        raws = {}
        for e in header["entries"]:
            entries[e["name"]] = e
            if e["kind"] == "raw":
                raws[e["name"]] = reader.read_raw(e, payload)   # every raw entry checked, as restore_tree does
    except reader.ReaderError as exc:
        wait_named(wait, path)
        raise ContainerError(str(exc)) from None
    meta = header.get("meta", {})
    if meta.get("framework") != "torch":
        wait_named(wait, path)
        raise CheckpointError(f"{path} holds a {meta.get('framework')!r} checkpoint; use jaxguard.load for optax state "
                              "or `jaxguard migrate` to convert it")
    pk = _Pickle()
    try:
        pk.tree(meta.get("tree"), entries)
    except Unsupported:
        wait_named(wait, path)
        return False
    except CheckpointError:
        wait_named(wait, path)
        raise
    pkl = pk.bytes()
    uses = {}
    for name, which, _, _ in pk.storages:
        if which is not None:
            uses[name] = uses.get(name, 0) + 1

    def write(fh):
        from concurrent.futures import ThreadPoolExecutor
        dec = _Decoder(header, payload, tables)
        dec.start()
        flusher = _Writeback(fh)
        # the raw entries' CRC-32 in a thread of their own, ahead of the writer (zlib
        # releases the GIL): the main thread only writes
        crcs = ThreadPoolExecutor(1, thread_name_prefix="jaxguard-crc")
        raw_buf, raw_crc, group, held = {}, {}, [], 0

        def crc_all(names):
            return {nm: zlib.crc32(raw_buf[nm]) for nm in names}

        for name, which, _, _ in pk.storages:     # one task per ~8 MiB of raw entries, in order
            if which is None and name not in raw_buf:
                raw_buf[name] = _bytes(raws[name])
                group.append(name)
                held += len(raw_buf[name])
                if held >= CRC_GROUP or len(group) >= 512:
                    fut = crcs.submit(crc_all, group)
                    raw_crc.update((nm, fut) for nm in group)
                    group, held = [], 0
        if group:
            fut = crcs.submit(crc_all, group)
            raw_crc.update((nm, fut) for nm in group)
        try:
            zf = _Records(fh)
            try:
                def record(name, buf, align=False, crc=None):
                    zf.add(name, buf, crc, align)
                    flusher.wrote(len(buf))
                record("data.pkl", pkl)
                record(".format_version", b"1")
                record(".storage_alignment", str(ALIGN).encode())
                record("byteorder", b"little")
                for key, (name, which, _, _) in enumerate(pk.storages):
                    if which is None:
                        buf, crc = raw_buf[name], raw_crc[name].result()[name]
                    else:
                        mv = dec.take(name)
                        arr, crc = mv[0] if which == "m" else mv[1]
                        buf = _bytes(arr)
                    record(f"data/{key}", buf, True, crc)
                    if which is not None:
                        uses[name] -= 1
                        if not uses[name]:
                            dec.drop(name)
                record("version", b"3\n")
                record(".data/serialization_id", str(int.from_bytes(os.urandom(16), "big")).zfill(40)[:40].encode())
                digest = dec.finish()
            finally:
                zf.close()
            wait()
            if digest != header.get("decoded_sha256"):
                raise ContainerError(integrity.decoded_mismatch(header))
        except Exception as exc:
            dec.stop.set()
            wait_named(wait, path)      # a damaged file is named by its checksum first
            if isinstance(exc, reader.ReaderError):
                raise ContainerError(str(exc)) from None
            raise
        finally:
            dec.stop.set()
            crcs.shutdown(wait=True, cancel_futures=True)
            flusher.join()

    container.atomic_write_with(output, write)
    return True


def wait_named(wait, path):
    """``wait()`` of `reader.parse_deferred`, its error as a `ContainerError` naming `path`.

    Args:
      wait: the waiter `reader.parse_deferred` returned (joins the hash threads).
      path: the container, for the message.

    Raises:
      ContainerError: a checksum or layout check failed (one line naming `path`).
    """
    try:
        wait()
    except reader.ReaderError as exc:
        raise ContainerError(f"{path}: {exc}") from None
