"""The entropy stage of codec ``log8-rel-zstd``: log8-rel's codes, stored as zstd frames.

A ``log8-rel-zstd`` entry holds exactly the codes, block parameters and escapes the guard
certified for ``log8-rel``; this module only stores them in fewer bytes, losslessly, with
zstd (RFC 8878, the ``zstandard`` package: Huffman-coded literals over 8-bit codes).  Numpy
only, like the whole format layer; ``zstandard`` is imported when a frame is written or
read, so that the reader of every other codec needs numpy alone.

Sections of one entry of ``n`` coordinates in ``nb = max(1, ceil(n/256))`` blocks
(docs/format.md has the byte layout):

* ``m_codes``, ``v_codes``: streams of n bytes, the low 8 bits of each coordinate's m field
  ``q + L_b`` (``L_b = 2**(bm_b - 1) - 1``: 127 for an 8-bit block) and of its v code.
* ``params``: a stream of float32 block parameters in byte planes: ``scale, lo, r`` per
  block (12 nb bytes); when some block's ``wlo, rr`` are not ``sqrt(lo), sqrt(r)``
  (float32, correctly rounded), ``wlo, rr`` follow (20 nb bytes).
* ``escape_index``: a stream of the escapes' LEB128 gap varints (`jaxguard.format.packed`),
  and ``escape_pairs`` (float32 m, v per escape), as logrel-aw's.
* only when some block is wider than 8 bits: ``widths`` (a stream of nb bytes
  ``(bm << 4) | bv``, each 8..12), and ``m_high`` / ``v_high`` (streams of one byte per
  coordinate of the blocks whose m / v width is above 8: ``field >> 8``).

Every section but ``escape_pairs`` is a framed stream (`jaxguard.format.zstd_streams`):
frames decode independently, and the restore decodes an entry's frames on all cores.

Numerical contract
------------------
Nothing here rounds.  The stage is lossless over the bytes it is given (zstd decodes
bit-exactly), the derived parameters are float32 square roots, correctly rounded in numpy,
JAX and torch alike, and the writer stores ``wlo, rr`` explicitly whenever any block's
differ from them; the container's sample check decodes the entry as written and compares
it bit for bit with what the guard certified.
"""
from __future__ import annotations

import numpy as np

from jaxguard.format import packed, zstd_streams
from jaxguard.format.spec import BLOCK
from jaxguard.format.zstd_streams import (FRAME, LEVEL, MAX_STREAM, StreamError, bytes_view,
                                          compress_frames, decode_frame, decode_stream, encode_stream, frame_lengths,
                                          from_planes, join_frames, stream_frames, to_planes)

__all__ = ["CODEC", "FRAME", "LEVEL", "NARROW", "NARROW_WIDTHS", "MAX_STREAM", "BASE_SECTIONS", "WIDE_SECTIONS",
           "StreamError", "frame_lengths", "compress_frames", "join_frames", "encode_stream", "stream_frames",
           "decode_frame", "decode_stream", "to_planes", "from_planes", "block_widths", "entry_sections", "is_wide",
           "join_sections", "read_entry", "FramedCodes", "assemble"]

CODEC = "log8-rel-zstd"
NARROW, WIDEST = 8, packed.MAX_WIDTH
NARROW_WIDTHS = (NARROW << 4) | NARROW
BASE_SECTIONS = ("m_codes", "v_codes", "params", "escape_index", "escape_pairs")
WIDE_SECTIONS = (("widths", "m_high"), ("widths", "v_high"), ("widths", "m_high", "v_high"))


# ---------------------------------------------------------------- one entry
def _sqrt_derived(vp) -> bool:
    with np.errstate(invalid="ignore"):
        return bool((np.sqrt(vp[:, 0]).view(np.uint32) == vp[:, 2].view(np.uint32)).all()
                    and (np.sqrt(vp[:, 1]).view(np.uint32) == vp[:, 3].view(np.uint32)).all())


def block_widths(arrays, nb):
    """(bm, bv) int64 per block: the ``widths`` array of a widened encoding, else all 8.

    Args:
      arrays: the encoding's arrays (``widths`` present only when a block is widened).
      nb: the number of blocks.
    """
    w = arrays.get("widths")
    if w is None:
        full = np.full(nb, NARROW, np.int64)
        return full, full
    return packed.split_widths(np.asarray(w, np.uint8))


def _row_coords(rows, n):
    """Flat coordinates of blocks `rows` (the last block's padding left out)."""
    c = (np.asarray(rows, np.int64)[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)
    return c[c < n]


def _low_bytes(q, widths, signed, n, low=True):
    """(low bytes uint8 [n] or None, the high bytes ``field >> 8`` of the coordinates of the
    blocks wider than 8 in order, or None): the stored m fields ``q + L_b`` / v codes, every
    code checked against its block's width.  `low`: False for the high bytes only."""
    q = np.asarray(q).reshape(-1)
    what = "m" if signed else "v"
    if widths is None:                       # every block 8 bits: the low byte is the field itself
        if not low:
            return None, None
        lo, hi = (-127, 127) if signed else (0, 255)
        if q.dtype != (np.int8 if signed else np.uint8):
            if q.size and (q.min() < lo or q.max() > hi):
                raise packed.PackError(f"an 8-bit block's {what} code is outside {lo}..{hi}")
            q = q.astype(np.int8 if signed else np.uint8)
        elif signed and (q == -128).any():
            raise packed.PackError("an 8-bit block's m code is -128, outside -127..127")
        low = q.view(np.uint8) + np.uint8(127) if signed else q.view(np.uint8)
        return np.ascontiguousarray(low), None
    # blocks of mixed widths: 8-bit blocks take the fast path (int16 arithmetic wraps mod 2**16,
    # so the low byte of q + 127 is right); the few wider blocks are recomputed alone
    nb = widths.size
    full = np.zeros(nb * BLOCK, q.dtype)
    full[:n] = q
    qb = full.reshape(nb, BLOCK)
    lim = (1 << (widths - 1)) - 1 if signed else (1 << widths) - 1
    lo = -lim if signed else np.zeros(nb, np.int64)
    if (qb.max(axis=1) > lim).any() or (qb.min(axis=1) < lo).any():
        raise packed.PackError(f"a {what} code does not fit its block's width")
    rows = np.flatnonzero(widths > NARROW)
    coords = _row_coords(rows, n)
    f = q[coords].astype(np.int64) + (np.repeat(lim[rows], BLOCK)[:coords.size] if signed else 0)
    if not low:
        return None, (f >> 8).astype(np.uint8)
    lows = ((q.astype(np.int16) + np.int16(127)) if signed else q).astype(np.uint8)
    lows[coords] = (f & 0xFF).astype(np.uint8)
    return lows, (f >> 8).astype(np.uint8)


def entry_sections(arrays, n: int, level: int = LEVEL, code_streams=None) -> dict:
    """The sections of one ``log8-rel-zstd`` moments entry (module docstring).

    Args:
      arrays: the encoded arrays of log8-rel's codes: ``m_codes`` [n] (int8, or int16 with
        ``widths``), ``v_codes`` [n] (uint8 / uint16), ``m_params`` [nb, 1], ``v_params``
        [nb, 4] float32 (lo, r, wlo, rr), ``escape_index``, ``escape_m``, ``escape_v``, and
        optionally ``widths`` [nb] (``(bm << 4) | bv``, 8..12; all ``0x88``: none wider).
      n: coordinates.
      level: the zstd level.
      code_streams: the ``m_codes`` and ``v_codes`` streams (the codes' low bytes) already
        built (`join_sections`).

    Returns:
      dict section name -> uint8 / float32 array, in the header's order.

    Raises:
      packed.PackError: a code outside its block's width, or widths outside 8..12.
    """
    nb = max(1, -(-n // BLOCK))
    mp = np.asarray(arrays["m_params"], np.float32).reshape(nb, -1)
    vp = np.asarray(arrays["v_params"], np.float32).reshape(nb, 4)
    wide = is_wide(arrays)
    bm, bv = _check_widths(np.asarray(arrays["widths"], np.uint8), "widths") if wide else (None, None)
    low_m, high_m = _low_bytes(arrays["m_codes"], bm, True, n, low=code_streams is None)
    low_v, high_v = _low_bytes(arrays["v_codes"], bv, False, n, low=code_streams is None)
    if code_streams is not None:
        out = dict(code_streams)
    else:
        out = {"m_codes": encode_stream(low_m, level), "v_codes": encode_stream(low_v, level)}
    cols = [mp[:, 0], vp[:, 0], vp[:, 1]] + ([] if _sqrt_derived(vp) else [vp[:, 2], vp[:, 3]])
    out["params"] = encode_stream(to_planes(np.concatenate(cols)), level)
    if wide:
        out["widths"] = encode_stream(np.asarray(arrays["widths"], np.uint8), level)
        for key, high in (("m_high", high_m), ("v_high", high_v)):
            if high.size:
                out[key] = encode_stream(high, level)
    out["escape_index"] = encode_stream(packed.varint_encode(np.asarray(arrays["escape_index"], np.int64)), level)
    out["escape_pairs"] = np.stack([np.asarray(arrays["escape_m"], np.float32),
                                    np.asarray(arrays["escape_v"], np.float32)], axis=1).reshape(-1)
    return out


def is_wide(arrays) -> bool:
    """Whether an encoding has a block wider than 8 bits (a ``widths`` array not all 0x88).

    Args:
      arrays: the encoding's arrays.
    """
    w = arrays.get("widths")
    return w is not None and bool((np.asarray(w, np.uint8) != NARROW_WIDTHS).any())


def join_sections(parts, arrays, n: int, level: int = LEVEL):
    """The sections of a tensor encoded in consecutive pieces, from the pieces' sections.

    The code streams of pieces whose lengths are whole frames are their frames joined (no
    second compression: they hold one byte a coordinate, whatever the widths); the other
    sections are built from the joined `arrays`.

    Args:
      parts: ``[(n_i, sections_i)]`` of the pieces in order (`entry_sections`).
      arrays, n: the joined encoding's arrays and coordinates.
      level: the zstd level.

    Returns:
      The joined sections, or None when the pieces cannot be joined so (a piece other
      than the last not a whole number of frames).
    """
    if any(k % zstd_streams.FRAME for k, _ in parts[:-1]) or sum(k for k, _ in parts) != n:
        return None
    streams = {}
    for key in ("m_codes", "v_codes"):
        frames = []
        for _, sec in parts:
            buf = np.asarray(sec[key], np.uint8)
            _, fr = stream_frames(buf, key)
            frames += [buf[a:a + s] for a, s, _ in fr]
        streams[key] = join_frames(n, frames)
    return entry_sections(arrays, n, level, code_streams=streams)


def _check_widths(w, what):
    bm, bv = packed.split_widths(w)
    bad = (bm < NARROW) | (bm > WIDEST) | (bv < NARROW) | (bv > WIDEST)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise packed.PackError(f"{what}: block {i} has widths byte {int(w[i]):#04x}; m and v widths must be "
                               f"{NARROW}..{WIDEST}")
    return bm, bv


def read_entry(name: str, sections: dict, payload, n: int, lazy: bool = False) -> dict:
    """One ``log8-rel-zstd`` entry's codes in log8-rel's fixed form.

    Args:
      name: the entry's name (for messages).
      sections: ``{section: [begin, end)}`` of the entry (names checked by the reader).
      payload: the container payload (bytes-like).
      n: coordinates.
      lazy: ``m_codes`` and ``v_codes`` as `FramedCodes`, decoded when sliced (every other
        section, the high bytes of wider blocks included, is read and checked here).

    Returns:
      dict ``m_codes`` (int8, or int16 when a block is wider than 8 bits), ``v_codes``
      (uint8 / uint16), ``m_params`` [nb, 1], ``v_params`` [nb, 4] (lo, r, wlo, rr),
      ``escape_index``, ``escape_pairs`` [e, 2] float32.

    Raises:
      StreamError, packed.PackError: a malformed section (one line naming it).
    """
    pay = bytes_view(payload)
    (bm, em), (bv, ev) = sections["m_codes"], sections["v_codes"]
    if lazy:
        low_m = FramedCodes(pay[bm:em], n, True, f"{name}.m_codes")
        low_v = FramedCodes(pay[bv:ev], n, False, f"{name}.v_codes")
    else:
        low_m = decode_stream(pay[bm:em], f"{name}.m_codes", n)
        low_v = decode_stream(pay[bv:ev], f"{name}.v_codes", n)
    return assemble(name, sections, pay, n, low_m, low_v)


class FramedCodes:
    """One code stream of an entry, decoded frame by frame when sliced: the restore's pool
    decodes each chunk's own frames (`read_entry` with ``lazy=True``).  ``codes[a:b]`` is
    int8 m codes (``signed``) or uint8 v codes; once `widened` (an entry with blocks wider
    than 8 bits), int16 / uint16 codes, the wider blocks' fields joined with their high bytes
    (a range of 8-bit blocks only still comes back as 8-bit codes: the same values).

    Args:
      stream: the section's bytes; n: coordinates; signed: m (fields ``q + 127``) or v;
      what: how errors name the section.
    """

    def __init__(self, stream, n: int, signed: bool, what: str):
        self.stream, self.n, self.signed, self.what = bytes_view(stream), n, signed, what
        _, self.frames = stream_frames(self.stream, what, n)
        self.dtype = np.dtype(np.int8 if signed else np.uint8)
        self.size = n
        self.wide = None

    def widened(self, widths, high):
        """This stream's codes joined with the high bytes of its wider blocks.

        Args:
          widths: the stream's width per block (int, 8..12); high: the checked high bytes
            (`_high_bytes`) of the coordinates of the blocks wider than 8, in order.
        """
        self.wide = _WideBlocks(widths, high, self.n)
        self.dtype = np.dtype(np.int16 if self.signed else np.uint16)
        return self

    def __len__(self):
        return self.n

    def _frame(self, j):
        start, stored, d = self.frames[j]
        return np.frombuffer(decode_frame(self.stream, start, stored, d, self.what), np.uint8)

    def __getitem__(self, sl):
        size = zstd_streams.FRAME              # decoded bytes per frame
        if not isinstance(sl, slice):          # positions: only their frames are decoded
            idx = np.asarray(sl, np.int64)
            low = np.empty(idx.shape, np.uint8)
            flat, dst = idx.reshape(-1), low.reshape(-1)
            if flat.size and (flat.min() < 0 or flat.max() >= self.n):
                raise IndexError(f"{self.what}: positions outside 0..{self.n - 1}")
            which = flat // size
            for j in np.unique(which):
                at = np.flatnonzero(which == j)
                dst[at] = self._frame(int(j))[flat[at] - int(j) * size]
            return self._codes(low, flat)
        a, b, step = sl.indices(self.n)
        if step != 1:
            return self[np.arange(a, b, step)]
        f0, f1 = a // size, -(-b // size)
        if f1 - f0 == 1:
            low = self._frame(f0)[a - f0 * size:b - f0 * size]
        else:
            low = np.empty(max(0, (f1 - f0) * size), np.uint8)
            pos = 0
            for j in range(f0, f1):
                part = self._frame(j)
                low[pos:pos + part.size] = part
                pos += part.size
            low = low[a - f0 * size:b - f0 * size]
        return self._codes(low, (a, max(a, b)))

    def _codes(self, low, where):
        if self.wide is not None and not (isinstance(where, tuple) and self.wide.none_in(*where)):
            return self.wide.join(low, where, self.signed, self.what)
        return _m_codes(low, self.what) if self.signed else low   # a range of 8-bit blocks: 8-bit codes


def _m_codes(low_m, what):
    """int8 m codes from the low bytes of 8-bit blocks' fields (``q + 127``; 255 refused)."""
    mq = (low_m - np.uint8(127)).view(np.int8)
    if mq.size and mq.min() == -128:
        i = int(np.argmax(mq == -128))
        raise StreamError(f"{what}: coordinate {i} of the range has m field 255, outside 0..254")
    return mq


class _WideBlocks:
    """The blocks of one stream wider than 8 bits and their high bytes (``field >> 8`` of
    each of their coordinates, in order), joined with any range's or positions' low bytes."""

    def __init__(self, widths, high, n):
        self.widths, self.high = widths, high
        held = np.where(widths > NARROW, BLOCK, 0)
        if held.size and held[-1]:
            held[-1] = n - (held.size - 1) * BLOCK      # the last block's padding holds none
        self.high_at = np.cumsum(held) - held           # where each block's high bytes start
        self.wide_before = np.concatenate([[0], np.cumsum(widths > NARROW)])

    def none_in(self, a, b):
        """Whether coordinates [a, b) lie in 8-bit blocks only."""
        return self.wide_before[-(-b // BLOCK)] == self.wide_before[a // BLOCK]

    def join(self, low, where, signed, what):
        """Codes (int16 m / uint16 v) from the low bytes `low` of coordinates `where`: a
        range ``(a, b)`` or an int array of positions."""
        if isinstance(where, tuple) and self.none_in(*where) and not (signed and low.size and low.max() == 255):
            # a range of 8-bit blocks only (a stream none of whose blocks is wider): the
            # fields themselves, m's less 127 (a field 255 is named below)
            if not signed:
                return low.astype(np.uint16)
            q = low.astype(np.int16)
            q -= np.int16(127)
            return q
        if isinstance(where, tuple):
            a, b = where
            r0 = a // BLOCK
            rows = r0 + np.flatnonzero(self.widths[r0:-(-b // BLOCK)] > NARROW)
            coords = (rows[:, None] * BLOCK + np.arange(BLOCK)).reshape(-1)
            coords = coords[(coords >= a) & (coords < b)]
            at = coords - a

            def position(j):
                return a + j
        else:
            at = np.flatnonzero(self.widths[where // BLOCK] > NARROW)
            coords = where[at]

            def position(j):
                return where[j]
        rows = coords // BLOCK
        high = self.high[self.high_at[rows] + coords - rows * BLOCK]
        f = low[at].astype(np.int64) | (high.astype(np.int64) << 8)
        if not signed:
            q = low.astype(np.uint16)
            q[at] = f
            return q
        bad = np.flatnonzero(low == 255)                 # an 8-bit block's field 255 (q = 128)
        bad = bad[self.widths[position(bad) // BLOCK] == NARROW]
        lm = (1 << (self.widths[rows] - 1)) - 1
        over = np.flatnonzero(f > 2 * lm)
        if bad.size or over.size:
            i = int(position(bad[0])) if bad.size else int(coords[over[0]])
            val = 255 if bad.size else int(f[over[0]])
            raise StreamError(f"{what}: coordinate {i} has m field {val}, outside its "
                              f"{int(self.widths[i // BLOCK])}-bit block's range")
        q = low.astype(np.int16)
        q -= np.int16(127)
        q[at] = f - lm
        return q


def assemble(name, sections, payload, n, low_m, low_v) -> dict:
    """The fixed form of an entry from the decoded low bytes of its codes (`read_entry`;
    the restore decodes large entries' code frames on its pool) and its other sections.

    Args:
      name, sections, payload, n: as for `read_entry`.
      low_m, low_v: the low bytes of the m and v codes: decoded (uint8, n each) or still
        framed (`FramedCodes`, decoded later by the caller's pool).
    """
    pay = bytes_view(payload)
    nb = max(1, -(-n // BLOCK))

    def sec(key):
        b, e = sections[key]
        return pay[b:e]

    # the float32 columns straight from their byte planes (`from_planes`): byte i of column
    # c's value of block b is plane byte [i, c, b]
    planes = decode_stream(sec("params"), f"{name}.params", (12 * nb, 20 * nb)).reshape(4, -1, nb)
    mp = np.empty((nb, 1), "<f4")
    mp.view(np.uint8)[...] = planes[:, 0].T
    vp = np.empty((nb, 4), "<f4")              # lo, r, wlo, rr: one copy of the columns stored
    by_byte = vp.view(np.uint8).reshape(nb, 4, 4)
    if planes.shape[1] == 5:
        by_byte[...] = planes[:, 1:].transpose(2, 1, 0)
    else:
        by_byte[:, :2] = planes[:, 1:].transpose(2, 1, 0)
        lo_r = vp[:, :2]
        if lo_r.min() >= 0:                    # no negative or NaN parameter: no invalid square root to silence
            np.sqrt(lo_r, out=vp[:, 2:4])
        else:
            with np.errstate(invalid="ignore"):
                np.sqrt(lo_r, out=vp[:, 2:4])
    codes = {"m_params": mp, "v_params": vp}
    if "widths" in sections:
        w = decode_stream(sec("widths"), f"{name}.widths", nb)
        bm, bv = _check_widths(w, f"{name}.widths")
        if not ((bm > NARROW).any() or (bv > NARROW).any()):
            raise StreamError(f"{name}.widths: every block is {NARROW} bits wide; an entry without wider blocks "
                              "has no widths section")
        for key, low, widths, signed in (("m", low_m, bm, True), ("v", low_v, bv, False)):
            high = _high_bytes(name, sections, sec, f"{key}_high", widths, n)
            if isinstance(low, FramedCodes):
                codes[f"{key}_codes"] = low.widened(widths, high)
            else:
                codes[f"{key}_codes"] = _WideBlocks(widths, high, n).join(low, (0, n), signed, f"{name}.m_codes")
    elif isinstance(low_m, FramedCodes):
        codes["m_codes"], codes["v_codes"] = low_m, low_v
    else:
        codes["m_codes"], codes["v_codes"] = _m_codes(low_m, f"{name}.m_codes"), low_v
    gaps = decode_stream(sec("escape_index"), f"{name}.escape_index", limit=packed.MAX_VARINT_BYTES * n)
    idx = packed.varint_decode(gaps, n, f"{name}.escape_index") if len(gaps) else np.zeros(0, np.int64)
    pairs = sec("escape_pairs")
    if len(pairs) != 8 * idx.size:
        raise StreamError(f"{name}.escape_pairs: {len(pairs)} bytes where {idx.size} x 8 are needed")
    codes["escape_index"] = idx
    codes["escape_pairs"] = np.frombuffer(pairs, "<f4").reshape(-1, 2)
    return codes


def _high_bytes(name, sections, sec, key, widths, n):
    """The checked ``m_high`` / ``v_high`` bytes of an entry with widths (one per coordinate
    of the blocks wider than 8 bits, in order; none when no block of the stream is)."""
    rows = np.flatnonzero(widths > NARROW)
    count = _row_coords(rows, n).size if rows.size else 0
    if count == 0:
        if key in sections:
            raise StreamError(f"{name}.{key}: present but no block's {key[0]} width is above {NARROW}; remove it")
        return np.zeros(0, np.uint8)
    if key not in sections:
        raise StreamError(f"{name}: a block's {key[0]} width is above {NARROW} but the entry has no {key}")
    high = decode_stream(sec(key), f"{name}.{key}", count)
    w_on = np.repeat(widths[rows], BLOCK)[:count]
    if (high >= (1 << (w_on - NARROW))).any():
        raise StreamError(f"{name}.{key}: a high part is outside its block's width")
    return high
