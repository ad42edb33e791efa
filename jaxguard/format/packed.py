"""Byte layout of the ``logrel-aw`` codec: bit-packed per-block-width codes, compact block
parameters and sparse escape indices.  Numpy only (the reader imports it).

Numerical contract
------------------
Nothing here rounds: packing and unpacking are integer bit manipulations and the block
parameters are rebuilt from their stored bits with correctly rounded float32 multiplies
(``lo = wlo*wlo``, ``r = rr*rr``) and a 16-bit shift (``scale``), so JAX, numpy and torch
obtain the same float32 parameters, and from them (jaxguard.core.codes' log8-rel decode) the
same moments.

Layout of one tensor of ``n`` coordinates in ``nb = max(1, ceil(n/256))`` blocks
(docs/format.md):

* ``widths``: nb bytes, ``(bm << 4) | bv`` with bm, bv in 4..12: the m and v code widths.
* ``m_codes``: for each block in order, its codes (256, or the n - 256*(nb-1) remaining
  ones for the last block) of bm bits (``q + 2**(bm-1) - 1``, the signed code offset to
  0..2**bm - 2), bit j of code i at bit ``i*bm + j`` of the block's ceil(count*bm/8)
  bytes, little bit order (a field of more than 8 bits can span 3 bytes).
* ``v_codes``: the same with bv bits (``q`` in 0..2**bv - 1, 0 = exact zero).
* ``m_params``: nb u16, the high half of the float32 m-scale (a bfloat16 bit pattern).
* ``v_params``: nb x 2 float32: ``wlo, rr``; the reader forms ``lo = wlo*wlo`` and
  ``r = rr*rr``.
* ``escape_index`` (sparse) *or* ``escape_mask`` (a bit per coordinate), whichever is
  smaller: LEB128 varints of the gaps ``idx[0]``, ``idx[k] - idx[k-1] - 1``.

logrel-ans's rANS form codes fields of at most 8 bits (`jaxguard.format.rans`): a block of
width w > 8 contributes the top 8 bits of each field (``field >> (w-8)``) to ``mv_rans`` and
its low ``w-8`` bits to ``m_low`` / ``v_low``, packed as above at width ``max(w-8, 0)``.
"""
from __future__ import annotations

__all__ = ["CODEC", "MAX_WIDTH", "RANS_WIDTH", "PackError", "split_widths", "join_widths", "check_widths",
           "packed_len", "pack", "unpack", "join_high_low", "u16_to_scale", "lo_r", "varint_encode",
           "varint_decode", "payload_bytes", "entry_sections", "entry_sections_many", "entry_payload_bytes"]

import numpy as np

from jaxguard.errors import JaxguardError
from jaxguard.format import rans
from jaxguard.format.spec import BLOCK

CODEC = "logrel-aw"        # the codec of the "packed" layout (its entry: jaxguard.format.spec)
MIN_WIDTH, MAX_WIDTH = 4, 12
RANS_WIDTH = rans.NARROW_WIDTH  # logrel-ans files of rANS kind 3 code the top 8 bits of a wider field there,
#                                 the rest in m_low / v_low (read, no longer written: kind 4 codes whole fields)
MAX_VARINT_BYTES = 7       # 49 bits: more than any tensor the reader accepts (2**40)
SMALL_VARINTS = 32         # up to this many gaps `varint_encode` writes them one by one


class PackError(JaxguardError):
    """A packed section is malformed (the message says which and how)."""


# ---------------------------------------------------------------- widths
def split_widths(wbytes):
    """The m and v code widths of each block from its widths byte (m high nibble, v low).

    Args:
      wbytes: uint8 widths bytes, one per block.

    Returns:
      ``(bm, bv)``: int64 arrays of the m and v widths in bits.
    """
    w = np.asarray(wbytes, np.uint8)
    return (w >> 4).astype(np.int64), (w & 15).astype(np.int64)


def join_widths(bm, bv):
    """One widths byte per block: m width in the high nibble, v width in the low one.

    Args:
      bm, bv: m and v code widths in bits (each 0..15).

    Returns:
      uint8 widths bytes (inverse of `split_widths`).
    """
    return ((np.asarray(bm, np.uint8) << 4) | np.asarray(bv, np.uint8)).astype(np.uint8)


def check_widths(wbytes, what="widths"):
    """`split_widths`, rejecting any width outside MIN_WIDTH..MAX_WIDTH.

    Args:
      wbytes: uint8 widths bytes, one per block.
      what: how the error names the section.

    Returns:
      ``(bm, bv)`` as `split_widths`.

    Raises:
      PackError: a block's m or v width is out of range (names the block and the byte).
    """
    bm, bv = split_widths(wbytes)
    bad = (bm < MIN_WIDTH) | (bm > MAX_WIDTH) | (bv < MIN_WIDTH) | (bv > MAX_WIDTH)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PackError(f"{what}: block {i} has widths byte {int(wbytes[i]):#04x}; m and v widths must be "
                        f"{MIN_WIDTH}..{MAX_WIDTH}")
    return bm, bv


def block_bytes(widths, n):
    """Bytes of each block of a code stream: ceil(count * width / 8), count = 256 except
    for the last block, which holds only the tensor's remaining ``n - 256*(nb-1)`` codes.

    Args:
      widths: one code width (bits) per block.
      n: the tensor's number of codes.

    Returns:
      ``(nbytes, counts)``: int64 arrays, one entry per block.
    """
    widths = np.asarray(widths, np.int64)
    counts = np.full(widths.size, BLOCK, np.int64)
    if widths.size:
        counts[-1] = n - BLOCK * (widths.size - 1)
    return -(-(counts * widths) // 8), counts


def packed_len(widths, n):
    """Bytes of a code stream of n codes whose blocks have these widths.

    Args:
      widths: one code width (bits) per block.
      n: the tensor's number of codes.

    Returns:
      The stream's length in bytes (int).
    """
    return int(block_bytes(widths, n)[0].sum())


# ---------------------------------------------------------------- bit packing (vectorised per width)
def _bits_to_bytes(codes, w):
    if w <= 8:
        bits = np.unpackbits(codes.astype(np.uint8)[..., None], axis=-1, bitorder="little")[..., :w]
    else:                                # the two little-endian bytes of each code, low byte first
        pairs = np.ascontiguousarray(codes.astype("<u2")).view(np.uint8).reshape(*codes.shape, 2)
        bits = np.unpackbits(pairs, axis=-1, bitorder="little")[..., :w]
    return np.packbits(bits.reshape(codes.shape[0], -1), axis=1, bitorder="little")


def _code_dtype(widths):
    return np.uint16 if np.size(widths) and int(np.max(widths)) > 8 else np.uint8


def pack(codes, widths, n):
    """Pack codes LSB-first, each block at its own width; full blocks are packed together
    per width, a partial last block alone.

    Args:
      codes: the first n of [nb*256] unsigned ints, each < 2**width of its block (the
        rest is ignored; padding packs as 0).
      widths: one code width (bits, 0..MAX_WIDTH) per block, nb = len(widths).
      n: the tensor's number of codes.

    Returns:
      The packed uint8 stream, `packed_len(widths, n)` bytes.
    """
    widths = np.asarray(widths, np.int64)
    nb = widths.size
    dt = _code_dtype(widths)
    codes = np.zeros(nb * BLOCK, dt) if n == 0 else np.asarray(codes).reshape(-1).astype(dt)
    codes = np.concatenate([codes[:n], np.zeros(nb * BLOCK - n, dt)]).reshape(nb, BLOCK)
    nbytes, counts = block_bytes(widths, n)
    off = np.concatenate([[0], np.cumsum(nbytes)])
    out = np.zeros(int(off[-1]), np.uint8)
    full = counts == BLOCK
    for w in np.unique(widths[full]):
        if w == 0:
            continue
        sel = np.flatnonzero(full & (widths == w))
        out[off[sel][:, None] + np.arange(32 * w)[None]] = _bits_to_bytes(codes[sel], w)
    if nb and not full[-1] and widths[-1]:
        c, w = int(counts[-1]), int(widths[-1])
        out[off[-2]:off[-1]] = _bits_to_bytes(codes[-1:, :c], w)[0]
    return out


def unpack(stream, widths, n):
    """Packed uint8 stream -> [nb*256] codes (inverse of `pack`; padding codes 0).

    Args:
      stream: the packed uint8 bytes of one code stream.
      widths: one code width (bits, 0..MAX_WIDTH) per block.
      n: the tensor's number of codes.

    Returns:
      Codes of length ``len(widths) * 256``: uint8 when every width is <= 8, else uint16.

    Raises:
      PackError: the stream's length is not what the widths need.
    """
    stream = np.asarray(stream, np.uint8)
    widths = np.asarray(widths, np.int64)
    nb = widths.size
    nbytes, counts = block_bytes(widths, n)
    off = np.concatenate([[0], np.cumsum(nbytes)])
    if stream.size != off[-1]:
        raise PackError(f"code stream is {stream.size} bytes where the widths need {int(off[-1])}")
    dt = _code_dtype(widths)
    out = np.zeros((nb, BLOCK), dt)
    full = counts == BLOCK
    for w in np.unique(widths[full]):
        if w == 0:
            continue
        sel = np.flatnonzero(full & (widths == w))
        chunk = stream[off[sel][:, None] + np.arange(32 * w)[None]]
        if w == 8:                   # byte-aligned fast paths (the same bit layout)
            out[sel] = chunk
        elif w == 4:
            out[sel] = np.stack([chunk & 15, chunk >> 4], axis=2).reshape(sel.size, BLOCK)
        else:                        # field i starts in byte (i*w)>>3 and spans up to 3 bytes
            pos = np.arange(BLOCK) * w
            byte, shift = pos >> 3, (pos & 7).astype(np.uint32)
            c32 = np.concatenate([chunk, np.zeros((sel.size, 2), np.uint8)], axis=1).astype(np.uint32)
            word = c32[:, byte] | (c32[:, byte + 1] << 8) | (c32[:, byte + 2] << 16)
            out[sel] = ((word >> shift) & ((1 << w) - 1)).astype(dt)
    if nb and not full[-1] and widths[-1]:
        c, w = int(counts[-1]), int(widths[-1])
        bits = np.unpackbits(stream[off[-2]:off[-1]], bitorder="little")[:c * w].reshape(c, w)
        by = np.packbits(bits, axis=1, bitorder="little").astype(np.uint32)
        out[-1, :c] = (by[:, 0] | ((by[:, 1] << 8) if by.shape[1] > 1 else 0)).astype(dt)
    return out.reshape(-1)


def join_high_low(high, low, low_widths):
    """A wide field of an older logrel-ans file (rANS kind 1 or 3) from its rANS-coded top bits
    and its ``m_low`` / ``v_low`` bits: ``(high << low_width) | low`` per block, int64 [nb, 256].

    Args:
      high: [nb, 256] top bits of the codes. low: [nb, 256] the bits below.
      low_widths: per block the width of the low part.

    Returns:
      int64 codes [nb, 256].
    """
    shift = np.asarray(low_widths, np.int64)[:, None]
    return (np.asarray(high, np.int64) << shift) | np.asarray(low, np.int64)


# ---------------------------------------------------------------- block parameters
def scale_to_u16(scale):
    """Store bfloat16-valued float32 m-scales as their 16 high bits.

    Args:
      scale: float32 scales whose low 16 bits are zero.

    Returns:
      uint16 array of the high halves (exact: `u16_to_scale` gives the scales back).

    Raises:
      PackError: a scale is not a bfloat16 value.
    """
    b = np.ascontiguousarray(np.asarray(scale, np.float32)).view(np.uint32)
    if (b & 0xFFFF).any():
        raise PackError("m-scale is not a bfloat16 value (low 16 bits set); the encoder must round it")
    return (b >> 16).astype(np.uint16)


def u16_to_scale(u):
    """The float32 m-scales stored by `scale_to_u16` (exact).

    Args:
      u: uint16 high halves.

    Returns:
      float32 array ``u << 16`` reinterpreted as float32.
    """
    return (np.asarray(u, np.uint32) << 16).view(np.float32)


def lo_r(wlo, rr):
    """(lo, r) = (wlo*wlo, rr*rr), float32 (correctly rounded, identical everywhere).

    Args:
      wlo, rr: float32 sqrt-grid parameters of the v codes.

    Returns:
      ``(lo, r)``: float32 arrays, v's log-grid parameters (overflow gives +inf).
    """
    wlo, rr = np.asarray(wlo, np.float32), np.asarray(rr, np.float32)
    with np.errstate(over="ignore"):
        return (wlo * wlo).astype(np.float32), (rr * rr).astype(np.float32)


# ---------------------------------------------------------------- sparse escapes
def varint_encode(idx):
    """Sorted unique indices -> LEB128 varints of the gaps (first index, then idx[k]-idx[k-1]-1).

    Args:
      idx: sorted unique nonnegative indices.

    Returns:
      The uint8 varint stream (empty for no indices).
    """
    idx = np.asarray(idx, np.int64)
    if idx.size == 0:
        return np.zeros(0, np.uint8)
    gaps = np.diff(idx, prepend=-1) - 1
    if gaps.size <= SMALL_VARINTS:       # a few escapes: bytes in Python beat a dozen numpy passes
        out = bytearray()
        for g in gaps.tolist():
            while g >= 0x80:
                out.append((g & 0x7F) | 0x80)
                g >>= 7
            out.append(g)
        return np.frombuffer(bytes(out), np.uint8)
    nbytes = np.ones(gaps.size, np.int64)
    for k in range(1, MAX_VARINT_BYTES):
        nbytes += gaps >= (1 << (7 * k))
    out = np.zeros(int(nbytes.sum()), np.uint8)
    start = np.concatenate([[0], np.cumsum(nbytes)[:-1]])
    for k in range(MAX_VARINT_BYTES):
        has = nbytes > k
        byte = (gaps[has] >> (7 * k)) & 0x7F
        cont = (nbytes[has] > k + 1).astype(np.int64) << 7
        out[start[has] + k] = (byte | cont).astype(np.uint8)
    return out


def varint_decode(buf, n, what="escape_index"):
    """LEB128 gap varints -> sorted indices, all < n; rejects malformed streams.

    Args:
      buf: the uint8 varint stream (`varint_encode`).
      n: the tensor's number of coordinates (every index must be below it).
      what: how the error names the section.

    Returns:
      Sorted int64 indices.

    Raises:
      PackError: an unterminated or over-long varint, or an index >= n.
    """
    b = np.asarray(buf, np.uint8)
    if b.size == 0:
        return np.zeros(0, np.int64)
    if b[-1] & 0x80:
        raise PackError(f"{what}: the last varint is unterminated (continuation bit set on the last byte)")
    if b.size <= SMALL_VARINTS:          # a few escapes: Python beats a dozen numpy passes, as in the encoder
        return _varint_decode_small(b.tolist(), n, what)
    ends = np.flatnonzero((b & 0x80) == 0)
    starts = np.concatenate([[0], ends[:-1] + 1])
    if (ends - starts + 1).max() > MAX_VARINT_BYTES:
        raise PackError(f"{what}: a varint is longer than {MAX_VARINT_BYTES} bytes")
    group = np.repeat(np.arange(ends.size), ends - starts + 1)
    shift = np.arange(b.size) - starts[group]
    vals = (b & 0x7F).astype(np.int64) << (7 * shift)
    gaps = np.add.reduceat(vals, starts)
    idx = np.cumsum(gaps + 1) - 1
    if idx[-1] >= n:
        raise PackError(f"{what}: index {int(idx[-1])} is past the end of the tensor ({n} coordinates)")
    return idx


def _varint_decode_small(data, n, what):
    """`varint_decode` of a short stream (a list of byte values, its last byte terminated)."""
    out, val, shift, length, idx = [], 0, 0, 0, -1
    for byte in data:
        val |= (byte & 0x7F) << shift
        shift += 7
        length += 1
        if length > MAX_VARINT_BYTES:
            raise PackError(f"{what}: a varint is longer than {MAX_VARINT_BYTES} bytes")
        if not byte & 0x80:
            idx += val + 1
            out.append(idx)
            val, shift, length = 0, 0, 0
    if idx >= n:
        raise PackError(f"{what}: index {idx} is past the end of the tensor ({n} coordinates)")
    return np.array(out, np.int64)


def escape_section_bytes(n_escapes_idx, n):
    """(kind, bytes) of the smaller escape-position section for these indices.

    Args:
      n_escapes_idx: the sorted escaped coordinate indices.
      n: the tensor's number of coordinates.

    Returns:
      ``("escape_index", varint bytes)`` if that is smaller than the bitmask, else
      ``("escape_mask", ceil(n / 8))``.
    """
    sparse = varint_encode(n_escapes_idx).size
    mask = -(-n // 8)
    return ("escape_index", sparse) if sparse < mask else ("escape_mask", mask)


def payload_bytes(widths, escape_index, n):
    """Moment payload of one logrel-aw tensor: the exact container section sizes.

    Args:
      widths: the uint8 widths bytes, one per block.
      escape_index: the sorted escaped coordinate indices.
      n: the tensor's number of coordinates.

    Returns:
      Bytes (int): widths, both code streams, 2 + 8 bytes of parameters per block, the
      escape positions and 8 bytes (exact m, v) per escape.
    """
    bm, bv = split_widths(widths)
    nb = bm.size
    return int(nb + packed_len(bm, n) + packed_len(bv, n) + 2 * nb + 8 * nb
               + escape_section_bytes(escape_index, n)[1] + 8 * np.asarray(escape_index).size)


# ---------------------------------------------------------------- the sections of one entry
def entry_sections(arrays, n, entropy=False):
    """The sections of one logrel-aw (or, with `entropy`, logrel-ans) moments entry.

    Args:
      arrays: the encoded arrays (``m_codes``, ``v_codes`` [n] ints, ``m_params`` [nb, 1],
        ``v_params`` [nb, 4] float32 ``lo, r, wlo, rr``, ``widths`` [nb], ``escape_index``,
        ``escape_m``, ``escape_v``).
      n: coordinates.
      entropy: logrel-ans: store ``mv_rans`` (one `jaxguard.format.rans` buffer of both
        code streams, whole fields at each block's widths, models inline in the compact
        layout (kind 3, or kind 4 when a block is wider than 8 bits), the bf16 m-scales in
        the lane tails) instead of ``m_codes``, ``v_codes`` and ``m_params`` when that is
        smaller (ties: packed).  Files written before kind 4 coded only the top 8 bits of
        a wider field there and its low bits in ``m_low`` / ``v_low``; the reader reads both.

    Returns:
      dict section name -> uint8/uint16/float32 array, in the header's key order.

    Raises:
      PackError: a code that does not fit its block's width, parameters not of the stored
        form (``lo = wlo*wlo``, ``r = rr*rr``, a bf16 m-scale), or bad widths.
    """
    return entry_sections_many([(arrays, n)], entropy=entropy)[0]


def _plain_sections(arrays, n):
    """The packed sections of one entry and, for its rANS form, (symbols [2, nb, 256], widths [2, nb])."""
    widths = np.asarray(arrays["widths"], np.uint8)
    nb = widths.size
    bm, bv = check_widths(widths)
    lm = np.repeat((1 << (bm - 1)) - 1, BLOCK)
    qm = np.zeros(nb * BLOCK, np.int64)
    qm[:n] = np.asarray(arrays["m_codes"], np.int64).reshape(-1)
    qv = np.zeros(nb * BLOCK, np.int64)
    qv[:n] = np.asarray(arrays["v_codes"], np.int64).reshape(-1)
    if (np.abs(qm) > lm).any() or (qv >= (1 << np.repeat(bv, BLOCK))).any() or (qv < 0).any():
        raise PackError("a code does not fit its block's width")
    mp, vp = np.asarray(arrays["m_params"], np.float32), np.asarray(arrays["v_params"], np.float32)
    lo, r = lo_r(vp[:, 2], vp[:, 3])
    if (lo.view(np.uint32) != vp[:, 0].view(np.uint32)).any() or (r.view(np.uint32) != vp[:, 1].view(np.uint32)).any():
        raise PackError("v parameters are not of the form lo = wlo*wlo, r = rr*rr")
    idx = np.asarray(arrays["escape_index"], np.int64)
    kind, _ = escape_section_bytes(idx, n)
    if kind == "escape_index":
        esc = varint_encode(idx)
    else:
        mask = np.zeros(n, bool)
        mask[idx] = True
        esc = np.packbits(mask, bitorder="little")
    codes = {"m_codes": pack(qm + lm, bm, n), "v_codes": pack(qv, bv, n), "m_params": scale_to_u16(mp[:, 0])}
    rest = {"v_params": np.ascontiguousarray(vp[:, 2:4]), kind: esc,
            "escape_pairs": np.stack([arrays["escape_m"], arrays["escape_v"]], axis=1).astype(np.float32)}
    streams = (np.stack([(qm + lm).reshape(nb, BLOCK), qv.reshape(nb, BLOCK)]), np.stack([bm, bv]))
    return widths, codes, rest, streams


def entry_sections_many(items, entropy=False):
    """`entry_sections` of many entries, their rANS buffers coded in one lane loop
    (`jaxguard.format.rans.encode_streams_many`): the same sections, byte for byte.

    Args:
      items: sequence of ``(arrays, n)`` as for `entry_sections`.
      entropy: as for `entry_sections`, for every entry.

    Returns:
      list of section dicts, one per item.

    Raises:
      PackError: as `entry_sections`.
    """
    plain = [_plain_sections(arrays, n) for arrays, n in items]
    coded = [k for k, (_, n) in enumerate(items) if entropy and n]
    # compact models only: the 4-bit-level form (kind 1) was never the smaller on the
    # 59 rANS tensors of bench/experiments/results/compact_models.md and cost a second encode
    bufs = rans.encode_streams_many([plain[k][3] + (items[k][1], None, plain[k][1]["m_params"]) for k in coded],
                            compact_models=True, lane_tails=True)
    out = []
    mv = dict(zip(coded, bufs))
    for k, (widths, codes, rest, _) in enumerate(plain):
        if k in mv and len(mv[k]) < sum(a.nbytes for a in codes.values()):
            codes = {"mv_rans": np.frombuffer(mv[k], np.uint8)}
        out.append({"widths": widths, **codes, **rest})
    return out


def entry_payload_bytes(arrays, n, entropy=False):
    """Moment payload of one logrel-aw / logrel-ans entry: its exact section sizes
    (`entry_sections`; for logrel-ans this rANS-encodes the tensor: the guard keeps the
    sections it counted with the encoding, `jaxguard.core.guard`, so the writer does not
    encode again).

    Args:
      arrays: the encoded arrays, as for `entry_sections`.
      n: coordinates.
      entropy: count logrel-ans's sections (rANS or packed, whichever the writer stores).

    Returns:
      int bytes.

    Raises:
      PackError: as `entry_sections`.
    """
    if not entropy:
        return payload_bytes(arrays["widths"], arrays["escape_index"], n)
    return int(sum(a.nbytes for a in entry_sections(arrays, n, entropy=True).values()))
