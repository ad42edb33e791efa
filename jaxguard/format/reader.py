"""Numpy-only reader for jaxguard container v1 (no JAX, torch or optax needed).

    python -m jaxguard.reader FILE [--json]

verifies the file and prints ``{"ok": ..., "decoded_sha256": ...}``.  The format is
specified in docs/format.md.  Loading never unpickles: the header is JSON and every
array is read with `numpy.frombuffer` from a declared, bounds-checked byte range.

Numerical contract: decoding uses only float32 multiplies (linear8: ``q*scale``; log8:
``lo * r**(q-1)`` by fixed-order binary powering; log8-rel: ``(q*scale) * w`` with
``w = wlo * rr**(qv-1)`` formed like log8; block8: ``table[q]*absmax``; bf16: a
16-bit shift), which numpy, JAX and torch all round identically, so the decoded moments
hash to the ``decoded_sha256`` the writer recorded.

What each codec id means (code dtypes, block parameters, layout, decode, tables) comes
from the registry, `jaxguard.format.spec`; this module holds the layout readers and picks
the numpy decode (`jaxguard.format.decoders`' `DECODERS`, keyed by the registry's
``decode`` field).
"""
from __future__ import annotations

__all__ = ["MAGIC", "VERSION", "PREFIX", "TRAILER", "BLOCK", "DTYPES", "ReaderError", "DECODERS", "decoder",
           "decode_codes", "parse", "parse_deferred", "read_tables", "read_raw", "read_moments", "read_codes",
           "decode_rans_entries", "check_layout", "shape_size", "skeleton_ref", "decoded_digest", "verify_bytes", "verify_file", "main"]

import json
import struct
import sys

import numpy as np

from jaxguard.errors import CheckpointError
from jaxguard.format import entropy, packed, rans, spec
from jaxguard.format.decoders import DECODERS
from jaxguard.format.integrity import (HASHES, check_header_hash, decoded_mismatch, hash_label, hasher, header_hash,
                                       prefix_hash)
from jaxguard.format.spec import ReaderError

MAGIC = b"JAXGUARD"
VERSION = 1
PREFIX = struct.Struct("<8sIIQ")   # magic, version, flags, header length
TRAILER = 32                       # the integrity hash (32 bytes) of everything before it
MAX_HEADER = 1 << 30
BLOCK = spec.BLOCK

DTYPES = {"float32": "<f4", "float64": "<f8", "float16": "<f2", "bfloat16": "<u2", "int64": "<i8",
          "int32": "<i4", "int16": "<i2", "int8": "i1", "uint8": "u1", "uint16": "<u2", "uint32": "<u4", "uint64": "<u8", "bool": "?"}


def decoder(codec):
    """The numpy decode function of a registered codec id.

    Args:
      codec: a codec id; its registry entry's ``decode`` field picks the function.

    Returns:
      ``fn(n, m_codes, v_codes, m_params, v_params, tables) -> (m~, v~)``.

    Raises:
      ReaderError: the id is not registered, or its decode has no numpy implementation.
    """
    try:
        base = spec.get(codec).decode
    except spec.UnknownCodecError as exc:
        raise ReaderError(str(exc)) from None
    if base not in DECODERS:
        raise ReaderError(f"codec {codec!r} decodes as {base!r}, which this reader cannot decode "
                          f"(it decodes {', '.join(DECODERS)})")
    return DECODERS[base]


def decode_codes(codec, n, m_codes, v_codes, m_params, v_params, tables):
    """Decoded (m~, v~) float32 of `n` coordinates from a codec's fixed-layout codes.

    Args:
      codec: a registered codec id (its registry ``decode`` picks the arithmetic).
      n: number of coordinates.
      m_codes, v_codes: per-coordinate codes (dtypes as in the registry).
      m_params, v_params: float32 block parameters, ``[nb, m_params]`` / ``[nb, v_params]``.
      tables: the stored tables by name (`read_tables`), for codecs that use them.

    Returns:
      (m~, v~), float32 arrays of `n` values each (escapes not yet applied).

    Raises:
      ReaderError: the codec is not registered or has no numpy decode.
    """
    return decoder(codec)(n, m_codes, v_codes, m_params, v_params, tables)


# ---------------------------------------------------------------- parsing
def _range(payload_len, rng, what):
    if (not isinstance(rng, list) or len(rng) != 2 or not all(isinstance(x, int) for x in rng)
            or not 0 <= rng[0] <= rng[1] <= payload_len):
        raise ReaderError(f"{what}: byte range {rng!r} is not inside the payload of {payload_len} bytes")
    return rng


def parse(data: bytes):
    """Check the envelope of `data`: magic, version, flags, both SHA-256, header, layout.

    Args:
      data: the whole container (bytes, bytearray or a memoryview).

    Returns:
      (header dict, payload memoryview).

    Raises:
      ReaderError: one line saying what failed.
    """
    if len(data) < PREFIX.size + TRAILER:
        raise ReaderError(f"file is {len(data)} bytes, too short to be a jaxguard container")
    magic, version, flags, hlen = PREFIX.unpack_from(data, 0)
    if magic != MAGIC:
        raise ReaderError("not a jaxguard container (bad magic); pass a file written by jaxguard")
    if version != VERSION:
        raise ReaderError(f"container format version {version} is not supported by this reader (supports {VERSION})")
    name = prefix_hash(flags)
    view = memoryview(data)   # slices of a view do not copy the file
    trailer = hasher(name, all_cores=True)
    trailer.update(view[:-TRAILER])
    if trailer.digest() != bytes(view[-TRAILER:]):
        raise ReaderError(f"file checksum mismatch: the file is corrupt or truncated (trailing {hash_label(name)})")
    if hlen > MAX_HEADER or PREFIX.size + hlen + TRAILER > len(data):
        raise ReaderError(f"header length {hlen} does not fit in the file")
    try:
        header = json.loads(bytes(data[PREFIX.size:PREFIX.size + hlen]).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, huge ints, deep nesting
        raise ReaderError(f"header is not valid JSON: {str(exc)[:120]}") from None
    if not isinstance(header, dict) or not isinstance(header.get("entries"), list):
        raise ReaderError("header has no 'entries' list")
    check_header_hash(header, name)
    payload = memoryview(data)[PREFIX.size + hlen:len(data) - TRAILER]
    if header.get("payload_bytes") != len(payload):
        raise ReaderError(f"payload is {len(payload)} bytes but the header declares {header.get('payload_bytes')}")
    digest = hasher(name, all_cores=True)
    digest.update(payload)
    if digest.hexdigest() != header.get("payload_sha256"):
        raise ReaderError(f"payload {hash_label(name)} mismatch")
    check_layout(header, len(payload))
    return header, payload


def _digest_thread(buf, name):
    """A started thread computing the `name` digest of `buf` (both hashes release the GIL):
    ``.join()`` then ``.digest``."""
    import threading

    def run():
        h = hasher(name)
        h.update(buf)
        th.digest = h.digest()
    th = threading.Thread(target=run, name="jaxguard-hash", daemon=True)
    th.digest = None
    th.start()
    return th


def parse_deferred(data):
    """`parse` whose two digests (the trailer's and the payload's) run in background threads
    while the caller decodes: the same checks, reported in the same order, but the caller
    must call ``wait()`` before it trusts anything it decoded (and before it commits any
    output); ``wait()`` raises the trailer's mismatch first, then the payload's.

    An error in the envelope, header or layout is reported as `parse` reports it (`parse`
    is run again, so that the first failing check in `parse`'s order names it).

    Args:
      data: the whole container (bytes, bytearray or a memoryview).

    Returns:
      (header dict, payload memoryview, wait).

    Raises:
      ReaderError: one line saying what failed.
    """
    if len(data) < PREFIX.size + TRAILER:
        parse(data)
    magic, version, flags, hlen = PREFIX.unpack_from(data, 0)
    if (magic != MAGIC or version != VERSION or flags not in HASHES or hlen > MAX_HEADER
            or PREFIX.size + hlen + TRAILER > len(data)):
        header, payload = parse(data)    # raises what parse names first
        return header, payload, lambda: None
    name = HASHES[flags]
    hasher(name)                         # a missing `blake3` package is named before any thread starts
    view = memoryview(data)
    payload = view[PREFIX.size + hlen:len(data) - TRAILER]
    whole, pay = _digest_thread(view[:-TRAILER], name), _digest_thread(payload, name)
    header = None

    def wait():
        whole.join()
        if whole.digest != bytes(view[-TRAILER:]):
            raise ReaderError(f"file checksum mismatch: the file is corrupt or truncated (trailing {hash_label(name)})")
        pay.join()
        if header is None or pay.digest.hex() != header.get("payload_sha256"):
            raise ReaderError(f"payload {hash_label(name)} mismatch")

    try:
        try:
            header = json.loads(bytes(data[PREFIX.size:PREFIX.size + hlen]).decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise ReaderError(f"header is not valid JSON: {str(exc)[:120]}") from None
        if not isinstance(header, dict) or not isinstance(header.get("entries"), list):
            raise ReaderError("header has no 'entries' list")
        check_header_hash(header, name)
        if header.get("payload_bytes") != len(payload):
            raise ReaderError(f"payload is {len(payload)} bytes but the header declares {header.get('payload_bytes')}")
        check_layout(header, len(payload))
    except ReaderError:
        whole.join()
        pay.join()
        parse(data)      # the error parse names first (a checksum before the header's)
        raise
    return header, payload, wait


MOMENT_SECTIONS = spec.FIXED_SECTIONS
AW_SECTIONS = spec.PACKED_SECTIONS


def codec_spec(entry):
    """The registry entry of a moments entry's codec.

    Args:
      entry: a moments entry of a container header.

    Returns:
      Its `jaxguard.format.spec.CodecSpec`.

    Raises:
      ReaderError: the codec is not a string or not registered (naming the registered ids).
    """
    codec = entry.get("codec")
    if not isinstance(codec, str):
        raise ReaderError(f"entry {entry.get('name')!r} has a non-string codec")
    try:
        return spec.get(codec)
    except spec.UnknownCodecError:
        raise ReaderError(f"entry {entry.get('name')!r} has unknown codec {codec[:80]!r}; "
                          f"registered: {', '.join(spec.CODECS)}") from None


def _sections(entry):
    if not isinstance(entry.get("name"), str):
        raise ReaderError("an entry of the header has no string 'name'")
    if entry.get("kind") == "raw":
        return {"data": entry.get("offsets")}
    if entry.get("kind") == "moments":
        sec = entry.get("sections")
        cs = codec_spec(entry)
        allowed = spec.LAYOUTS[cs.layout]
        if not isinstance(sec, dict) or not any(sorted(sec) == sorted(names) for names in allowed):
            if len(allowed) == 1:
                raise ReaderError(f"entry {entry.get('name')!r} must have exactly the sections {', '.join(allowed[0])}")
            common = [k for k in allowed[0] if all(k in names for names in allowed)]
            alts = list(dict.fromkeys(k for names in allowed for k in names if k not in common))
            raise ReaderError(f"entry {entry.get('name')!r} ({cs.id}) must have exactly the sections "
                              f"{', '.join(common)} and one of {', '.join(alts)}"
                              + (f" ({' or '.join('+'.join(k for k in names if k not in common) for names in allowed)})"
                                 if len(alts) > 2 else ""))
        return sec
    raise ReaderError(f"entry {entry.get('name')!r} has unknown kind {entry.get('kind')!r}")


def _tables(header):
    tables = header.get("tables") or {}
    if not isinstance(tables, dict) or not all(k in spec.TABLES for k in tables):
        raise ReaderError(f"header 'tables' must be an object with keys {'/'.join(spec.TABLES)}")
    return tables


def check_layout(header, payload_len):
    """Check that the header's tables and sections tile the payload exactly: every range
    inside it, no hole, no overlap, no trailing byte.

    Args:
      header: the parsed JSON header (untrusted: its ranges are checked before any is read).
      payload_len: the payload's length in bytes.

    Raises:
      ReaderError: a range out of the payload, a hole, an overlap or trailing bytes.
    """
    ranges = []
    for name, rng in _tables(header).items():
        ranges.append(tuple(_range(payload_len, rng, f"table {name}")))
    for entry in header["entries"]:
        if not isinstance(entry, dict):
            raise ReaderError("an entry of the header is not an object")
        for sec, rng in _sections(entry).items():
            ranges.append(tuple(_range(payload_len, rng, f"{entry.get('name')!r}.{sec}")))
    ranges.sort()
    pos = 0
    for b, e in ranges:
        if b != pos:
            raise ReaderError(f"payload has a hole or overlap at byte {pos} (next section starts at {b})")
        pos = e
    if pos != payload_len:
        raise ReaderError(f"payload has {payload_len - pos} trailing bytes no section claims")


def _array(payload, rng, dtype, count, what):
    b, e = rng
    item = np.dtype(dtype).itemsize
    if (e - b) != count * item:
        raise ReaderError(f"{what}: {e - b} bytes where {count} x {item} are needed")
    return np.frombuffer(payload[b:e], dtype=dtype, count=count)


MAX_ELEMENTS = 1 << 40


def shape_size(entry):
    """An entry's declared shape and element count, checked.

    Args:
      entry: the entry's header record (untrusted).

    Returns:
      ``(shape, n)``: the shape (a list of ints) and the product of its dimensions.

    Raises:
      ReaderError: a shape that is not a list of at most 32 non-negative ints, or more
        elements than the reader accepts (`MAX_ELEMENTS`).
    """
    shape = entry.get("shape")
    if (not isinstance(shape, list) or len(shape) > 32
            or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < MAX_ELEMENTS for d in shape)):
        raise ReaderError(f"entry {entry.get('name')!r} has an invalid shape {str(shape)[:80]}")
    n = 1
    for d in shape:
        n *= d
    if n >= MAX_ELEMENTS:
        raise ReaderError(f"entry {entry.get('name')!r} declares {n} elements, more than the reader accepts")
    return shape, n


def read_tables(header, payload):
    """The stored tables (e.g. the dynamic8 maps) a container carries.

    Args:
      header, payload: as `parse` returns them.

    Returns:
      {name: float32 array}.

    Raises:
      ReaderError: a table entry of the wrong size or out of the payload.
    """
    tables = {}
    for name, rng in _tables(header).items():
        tables[name] = _array(payload, rng, "<f4", spec.TABLE_SIZE, f"table {name}").astype(np.float32)
    return tables


def read_raw(entry, payload):
    """A raw (pass-through) entry as an array of its stored dtype and shape.

    Args:
      entry: its header entry. payload: the payload.

    Returns:
      ndarray (bfloat16 entries come back as their uint16 bits).

    Raises:
      ReaderError: an unsupported dtype, a bad shape or byte range.
    """
    shape, n = shape_size(entry)
    dt = DTYPES.get(entry.get("dtype"))
    if dt is None:
        raise ReaderError(f"entry {entry.get('name')!r} has unsupported dtype {entry.get('dtype')!r}")
    return _array(payload, entry["offsets"], dt, n, entry["name"]).reshape(shape)


def read_moments(entry, payload, tables, rans_symbols=None):
    """Decoded (m~, v~) float32 arrays of one moments entry.

    Args:
      entry: a moments entry of a header checked by `parse`.
      payload: the payload (`parse`).
      tables: the stored tables (`read_tables`).
      rans_symbols: this entry's item of `decode_rans_entries` (its ``mv_rans`` section
        already decoded with the container's other rANS sections), or None to decode here.

    Returns:
      (m~, v~), float32 arrays of the entry's shape, escapes applied.

    Raises:
      ReaderError: anything in the entry that does not match the format.
    """
    shape, n = shape_size(entry)
    codes = read_codes(entry, payload, tables, rans_symbols)
    m, v = decode_codes(entry["codec"], n, codes["m_codes"], codes["v_codes"], codes["m_params"],
                        codes["v_params"], tables)
    # the decodes return fresh arrays; copy only one that is not ours to write the escapes into
    whole = np.frombuffer(payload, np.uint8)
    m, v = (x if x.flags.writeable and not np.may_share_memory(x, whole) else x.copy() for x in (m, v))
    idx, pairs = codes["escape_index"], codes["escape_pairs"]
    m[idx] = pairs[:, 0]
    v[idx] = pairs[:, 1]
    return m.reshape(shape), v.reshape(shape)


def read_codes(entry, payload, tables, rans_symbols=None, lazy=False):
    """The codes of one moments entry in the fixed form every decode takes.

    A packed entry (``logrel-aw``, or ``logrel-ans`` in either of its forms) is unpacked,
    and a ``log8-rel-zstd`` entry's streams decoded (`jaxguard.format.entropy`), to the
    fixed form of its decode (``log8-rel``): codes per coordinate, parameters ``[nb, k]``
    float32.

    Args:
      entry: a moments entry of a header checked by `parse`.
      payload: the payload (`parse`).
      tables: the stored tables (`read_tables`); checked against the codec's needs.
      rans_symbols: as for `read_moments`.
      lazy: a ``log8-rel-zstd`` entry's codes as `entropy.FramedCodes`, decoded frame by
        frame when sliced (``codes["m_codes"][a:b]``: the restore decodes each chunk's
        frames in its own task); other entries as usual.

    Returns:
      dict with ``m_codes``, ``v_codes`` (n each), ``m_params``, ``v_params`` ([nb, k]),
      ``escape_index`` (int positions) and ``escape_pairs`` ([e, 2] float32).

    Raises:
      ReaderError: anything in the entry that does not match the format.
    """
    _, n = shape_size(entry)
    cs = codec_spec(entry)
    missing = [t for t in cs.tables if t not in tables]
    if missing:
        raise ReaderError(f"{cs.id} entries need the {'/'.join(cs.tables)} tables")
    nb = max(1, -(-n // BLOCK))
    name = entry["name"]
    if cs.layout == "zstd":
        try:
            return entropy.read_entry(name, entry["sections"], payload, n, lazy=lazy)
        except (entropy.StreamError, packed.PackError) as exc:
            raise ReaderError(str(exc)) from None
    if cs.layout in ("packed", "ans"):
        try:
            return _read_packed(name, entry["sections"], payload, n, nb, rans_symbols)
        except packed.PackError as exc:
            raise ReaderError(f"{name}.{exc}") from None
        except rans.RansError as exc:
            raise ReaderError(str(exc)) from None
    return _read_fixed(cs, name, entry["sections"], payload, n, nb)


def _read_fixed(cs, name, s, payload, n, nb):
    wm, wv = cs.m_params, cs.v_params
    codes = {"m_codes": _array(payload, s["m_codes"], cs.m_code_dtype, n, f"{name}.m_codes"),
             "v_codes": _array(payload, s["v_codes"], cs.v_code_dtype, n, f"{name}.v_codes"),
             "m_params": _array(payload, s["m_params"], "<f4", nb * wm, f"{name}.m_params").reshape(nb, wm),
             "v_params": _array(payload, s["v_params"], "<f4", nb * wv, f"{name}.v_params").reshape(nb, wv)}
    idx = _escape_positions(name, s, payload, n)
    codes["escape_index"] = idx
    codes["escape_pairs"] = _array(payload, s["escape_pairs"], "<f4", 2 * idx.size,
                                   f"{name}.escape_pairs").reshape(-1, 2)
    return codes


def _escape_positions(name, s, payload, n):
    if "escape_index" in s:
        b, e = s["escape_index"]
        return packed.varint_decode(np.frombuffer(payload[b:e], np.uint8), n, "escape_index")
    mask = _array(payload, s["escape_mask"], "u1", -(-n // 8), f"{name}.escape_mask")
    # escapes are rare: unpack only the mask's nonzero bytes (not an n-byte temporary)
    at = np.flatnonzero(mask)
    bits = np.unpackbits(mask[at][:, None], axis=1, bitorder="little")
    pos = (at[:, None] * 8 + np.arange(8))[bits.astype(bool)]
    if pos.size and pos[-1] >= n:
        raise ReaderError(f"{name}.escape_mask has bits set past the end of the tensor")
    return pos


def _entry_widths(name, s, payload, n, nb):
    return packed.check_widths(_array(payload, s["widths"], "u1", nb, f"{name}.widths"))


def _rans_top(buf):
    """Bits of a field the ``mv_rans`` buffer codes: whole fields (kind 4, up to 12 bits), or
    (kinds 1-3, older files) the top 8 bits, the rest in ``m_low`` / ``v_low``."""
    return rans.kind_max_width(buf[0]) if len(buf) else packed.RANS_WIDTH


def _rans_item(name, s, payload, n, nb):
    """(buffer, alphabet widths [2, nb], n) of an entry's ``mv_rans`` section, for
    `rans.decode_streams_many`."""
    bm, bv = _entry_widths(name, s, payload, n, nb)
    b, e = s["mv_rans"]
    buf = np.frombuffer(payload[b:e], np.uint8)
    return buf, np.minimum(np.stack([bm, bv]), _rans_top(buf)), n


def decode_rans_entries(entries, payload):
    """Decode the ``mv_rans`` sections of many entries in one `rans.decode_streams_many` lane loop.

    Args:
      entries: moments entries of a header checked by `parse` (others are skipped).
      payload: the payload (`parse`).

    Returns:
      dict entry position in `entries` -> that entry's ``rans_symbols`` for
      `read_moments`.  Empty when a section is malformed: each entry then decodes on
      its own, so that the error names it.
    """
    items, where = [], []
    try:
        for k, entry in enumerate(entries):
            s = entry.get("sections") if entry.get("kind") == "moments" else None
            if isinstance(s, dict) and "mv_rans" in s and codec_spec(entry).layout == "ans":
                _, n = shape_size(entry)
                items.append(_rans_item(entry["name"], s, payload, n, max(1, -(-n // BLOCK))))
                where.append(k)
        if len(items) < 2:
            return {}
        return dict(zip(where, rans.decode_streams_many(items, "mv_rans", lane_tails=True)))
    except (ReaderError, packed.PackError, rans.RansError):
        return {}


def _join_low(name, s, payload, n, key, high, widths, top):
    """A stream's codes from its rANS-coded top `top` bits and (blocks wider than that, files
    of rANS kind 1-3) the ``m_low`` / ``v_low`` section: uint8 codes if no block is wider
    than 8 bits, else uint16."""
    low_w = np.maximum(widths - top, 0)
    if not low_w.any():
        if key in s:
            raise ReaderError(f"{name}.{key}: the section is present but no block is wider than "
                              f"{top} bits (the mv_rans buffer codes whole fields); remove it")
        return high if widths.max(initial=0) > rans.NARROW_WIDTH else high.astype(np.uint8)
    if key not in s:
        raise ReaderError(f"{name}: a block is wider than {top} bits but the entry has no {key} "
                          "section; the writer stores the low bits there")
    low = packed.unpack(_array(payload, s[key], "u1", packed.packed_len(low_w, n), f"{name}.{key}"), low_w, n)
    return packed.join_high_low(high, low.reshape(high.shape), low_w).astype(np.uint16)


def _read_packed(name, s, payload, n, nb, rans_symbols=None):
    """Unpack one logrel-aw / logrel-ans entry (layout: jaxguard.format.packed, and
    jaxguard.format.rans for an ``mv_rans`` section) to log8-rel's fixed form."""
    bm, bv = _entry_widths(name, s, payload, n, nb)
    lm = (1 << (bm - 1)) - 1
    if "mv_rans" in s:
        if rans_symbols is None:
            rans_symbols = rans.decode_streams(*_rans_item(name, s, payload, n, nb), what=f"{name}.mv_rans", lane_tails=True)
        (mc, vq), tails = rans_symbols
        b, e = s["mv_rans"]
        top = _rans_top(payload[b:e])
        mc, vq = (_join_low(name, s, payload, n, key, high, widths, top)
                  for key, high, widths in (("m_low", mc, bm), ("v_low", vq, bv)))
        mc = mc.astype(np.int16)
        vq = vq.reshape(-1)[:n]
        scale = packed.u16_to_scale(tails)
        what = f"{name}.mv_rans"
    else:
        streams = []
        for key, widths in (("m_codes", bm), ("v_codes", bv)):
            streams.append(_array(payload, s[key], "u1", packed.packed_len(widths, n), f"{name}.{key}"))
        mc = packed.unpack(streams[0], bm, n).reshape(nb, BLOCK).astype(np.int16)
        vq = packed.unpack(streams[1], bv, n)[:n]
        scale = packed.u16_to_scale(_array(payload, s["m_params"], "<u2", nb, f"{name}.m_params"))
        what = f"{name}.m_codes"
    if n < nb * BLOCK:        # padding of the last block is not stored: offset code of q = 0
        mc.reshape(-1)[n:] = lm[-1]
    if (mc > 2 * lm[:, None]).any():
        blk = int(np.flatnonzero((mc > 2 * lm[:, None]).any(1))[0])
        raise ReaderError(f"{what}: block {blk} has code {2 ** int(bm[blk]) - 1}, outside its {int(bm[blk])}-bit range")
    mq = (mc - lm[:, None]).astype(np.int8 if bm.max() <= 8 else np.int16).reshape(-1)[:n]
    wp = _array(payload, s["v_params"], "<f4", 2 * nb, f"{name}.v_params").reshape(nb, 2)
    lo, r = packed.lo_r(wp[:, 0], wp[:, 1])
    idx = _escape_positions(name, s, payload, n)
    pairs = _array(payload, s["escape_pairs"], "<f4", 2 * idx.size, f"{name}.escape_pairs").reshape(-1, 2)
    return {"m_codes": mq, "v_codes": vq, "m_params": scale[:, None],
            "v_params": np.stack([lo, r, wp[:, 0], wp[:, 1]], axis=1), "escape_index": idx, "escape_pairs": pairs}


def skeleton_ref(node, held):
    """The entry a node of a container's tree names (``{"__tensor__": name}``,
    ``{"__moment__": name, ...}``, or a numpy array or scalar's ``{"__ndarray__": name}`` /
    ``{"__npscalar__": name}``), checked against the entries the container holds.

    Args:
      node: one node of the header's tree (any JSON value).
      held: the entry names the container holds (a mapping or set).
    Returns:
      The entry name, or None for a node that names none.
    Raises:
      CheckpointError: the node names an entry the container does not hold (one line).
    """
    if not isinstance(node, dict):
        return None
    ref = next((node[k] for k in ("__tensor__", "__moment__", "__ndarray__", "__npscalar__") if k in node), None)
    if ref is not None and (not isinstance(ref, str) or ref not in held):
        raise CheckpointError(f"the container's tree names a tensor {str(ref)[:80]!r} it does not hold; the file is "
                              "inconsistent (was it edited?)")
    return ref


def decoded_digest(header, payload, hash_name=None):
    """The digest over every moments entry's decoded (m~, v~), little-endian float32, in order.

    Args:
      header, payload: as `parse` returns them.
      hash_name: the integrity hash (`HASHES`); default the one the header declares.

    Returns:
      The hex digest the writer stored as ``decoded_sha256`` (with the header's hash).

    Raises:
      ReaderError: an entry that does not decode.
    """
    tables = read_tables(header, payload)
    h = hasher(hash_name or header_hash(header))
    pre = decode_rans_entries(header["entries"], payload)
    for k, entry in enumerate(header["entries"]):
        if entry.get("kind") == "moments":
            m, v = read_moments(entry, payload, tables, pre.get(k))
            h.update(np.ascontiguousarray(m, "<f4"))
            h.update(np.ascontiguousarray(v, "<f4"))
    return h.hexdigest()


def verify_bytes(data: bytes) -> dict:
    """Full check: envelope, checksums, layout, decode, decoded-moments hash.

    Args:
      data: the whole container.

    Returns:
      {"ok": True, "hash": the integrity hash, "decoded_sha256": ..., "entries": count}.

    Raises:
      ReaderError: the first check that failed.
    """
    header, payload = parse(data)
    digest = decoded_digest(header, payload)
    if digest != header.get("decoded_sha256"):
        raise ReaderError(decoded_mismatch(header))
    return {"ok": True, "hash": header_hash(header), "decoded_sha256": digest, "entries": len(header["entries"])}


def verify_file(path) -> dict:
    """`verify_bytes` of a local file.

    Args:
      path: the container.

    Returns:
      As `verify_bytes`.

    Raises:
      ReaderError: as `verify_bytes`; OSError: the file cannot be read.
    """
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ReaderError(f"cannot read {path}: {exc.strerror}") from None
    return verify_bytes(data)


def main(argv=None) -> int:
    """``python -m jaxguard.reader FILE [--json]``: verify FILE with numpy only.

    Args:
      argv: the arguments (default ``sys.argv[1:]``).

    Returns:
      0 if the file verifies, 2 on a usage error or a refused file (one line on stderr).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    files = [a for a in argv if a != "--json"]
    if len(files) != 1:
        print("usage: python -m jaxguard.reader FILE [--json]", file=sys.stderr)
        return 2
    try:
        res = verify_file(files[0])
    except ReaderError as exc:
        res = {"ok": False, "error": str(exc)}
    if as_json:
        print(json.dumps(res))
    else:
        print(f"ok: {res['hash']}, decoded_sha256 {res['decoded_sha256']}" if res["ok"] else f"error: {res['error']}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
