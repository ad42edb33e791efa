"""The numpy decodes of the fixed-form codes, one per base decode id of the codec registry
(`DECODERS`, keyed by a registry entry's ``decode`` field; `jaxguard.format.reader` picks
and runs them).  Numpy only.

Numerical contract
------------------
Decoding uses only float32 multiplies (linear8: ``q*scale``; log8: ``lo * r**(q-1)`` by
fixed-order binary powering; log8-rel: ``(q*scale) * w`` with ``w = wlo * rr**(qv-1)``
formed like log8; block8: ``table[q]*absmax``; bf16: a 16-bit shift), which numpy, JAX
and torch all round identically (golden vectors in tests/golden/).
"""
from __future__ import annotations

__all__ = ["linear8_decode", "log_decode", "bf16_decode", "table_decode", "DECODERS"]

import numpy as np

from jaxguard.format import packed, spec

BLOCK = spec.BLOCK


# ---------------------------------------------------------------- decoding (numpy)
def _blocks(q, n):
    nb = max(1, -(-n // BLOCK))
    if n == nb * BLOCK and q.size == n:     # whole blocks: a view, no copy
        return q.reshape(nb, BLOCK)
    out = np.zeros(nb * BLOCK, q.dtype)
    out[:n] = q
    return out.reshape(nb, BLOCK)


def linear8_decode(q, scale, n):
    """``f32(q) * scale`` per block (codec log8's m), float32.

    Args:
      q: [n] int8 codes. scale: [nb] float32 block scales. n: coordinates.

    Returns:
      [n] float32.
    """
    qb = _blocks(q, n).astype(np.float32)
    return (qb * scale.astype(np.float32)[:, None]).reshape(-1)[:n]


def log_decode(q, lo, r, n, bits=8):
    """``lo * r**(q-1)`` per block (0 for q == 0) by binary powering: bits of ``q-1`` from
    the lowest, ``val *= r**(2**j)`` where bit j is set, squares formed by repeated
    float32 squaring.  For 8-bit codes the 256 values of each block are tabulated with
    exactly that sequence of roundings (``T[k + 2**j] = T[k] * r**(2**j)`` for
    ``k < 2**j``) and gathered: bit-identical, a few passes instead of 8x4; with wider
    codes, blocks whose codes all fit 8 bits are tabulated too.

    Args:
      q: [n] unsigned codes (0: exact zero). lo, r: [nb] float32 block range parameters.
      n: coordinates. bits: code width (8 for AL8, up to 12 for logrel-aw, 16 for AL16).

    Returns:
      [n] float32.
    """
    qb = _blocks(q, n)
    if bits > 8:
        wide = qb.max(axis=1) > 256
        out = np.empty(qb.shape, np.float32)
        if wide.any():
            out[wide] = _log_decode_bitwise(qb[wide], lo[wide], r[wide], int(wide.sum()) * BLOCK, bits).reshape(-1, BLOCK)
        if not wide.all():       # blocks whose codes fit 8 bits: the table (the same roundings)
            narrow = ~wide
            out[narrow] = log_decode(qb[narrow].reshape(-1), lo[narrow], r[narrow],
                                     int(narrow.sum()) * BLOCK).reshape(-1, BLOCK)
        return out.reshape(-1)[:n]
    table = _log_table(lo, r)
    return table.reshape(-1)[_table_index(qb)].reshape(-1)[:n]


def _log_table(lo, r, bits=8):
    """[nb, 1 + 2**bits] float32: column q holds ``lo * r**(q-1)`` formed as `log_decode` forms
    it (column 0: 0)."""
    nb = lo.shape[0]
    table = np.empty((nb, 1 + (1 << bits)), np.float32)       # column q holds the value of code q
    table[:, 0] = 0.0
    table[:, 1] = lo.astype(np.float32)
    p = r.astype(np.float32)[:, None]
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        for j in range(bits):
            w = 1 << j
            np.multiply(table[:, 1:1 + w], p, out=table[:, 1 + w:1 + 2 * w])
            p = (p * p).astype(np.float32)
    return table


def _table_index(qb):
    """Flat indices of [nb, 256] 8-bit codes into an [nb, 257] table (int32 while they fit:
    half the traffic of int64)."""
    nb = qb.shape[0]
    itype = np.int32 if nb * 257 < 2**31 else np.int64
    return np.add(qb, (np.arange(nb, dtype=itype) * 257)[:, None], dtype=itype)


TABLE_CELLS = 1 << 21    # float32 cells of the wide blocks' tables built at once (8 MiB)


def _log_decode_bitwise(qb, lo, r, n, bits):
    """`log_decode` of [rows, 256] codes up to `bits` wide: the low `bits` bits of ``q - 1``
    powered from the lowest (0 for q == 0).  Tabulated as `_log_table` does for 8 bits (column
    ``1 + k`` holds ``lo`` times ``r**(2**j)`` for each set bit j of k, in increasing j: the
    roundings of powering each code alone), a few rows at a time."""
    cols = 1 + (1 << bits)
    k = qb.astype(np.int64) - 1
    idx = np.where(qb == 0, 0, (k & ((1 << bits) - 1)) + 1)
    out = np.empty(qb.shape, np.float32)
    step = max(1, TABLE_CELLS // cols)
    for s in range(0, qb.shape[0], step):
        table = _log_table(lo[s:s + step], r[s:s + step], bits)
        at = idx[s:s + step] + (np.arange(table.shape[0], dtype=np.int64) * cols)[:, None]
        out[s:s + step] = table.reshape(-1)[at]
    return out.reshape(-1)[:n]


def bf16_decode(q):
    """bfloat16 bit patterns -> float32 (a 16-bit shift: exact).

    Args:
      q: uint16 bfloat16 bits.

    Returns:
      float32 of the same shape.
    """
    return (q.astype(np.uint32) << 16).view(np.float32)


def table_decode(q, absmax, table, n):
    """``table[q] * absmax`` per block (the dynamic8 map of codec block8), float32.

    Args:
      q: [n] uint8 codes. absmax: [nb] float32 block scales. table: the stored 256-entry map.
      n: coordinates.

    Returns:
      [n] float32.
    """
    qb = _blocks(q, n).astype(np.int64)
    return (table[qb] * absmax.astype(np.float32)[:, None]).astype(np.float32).reshape(-1)[:n]


def _decode_log8(n, mq, vq, mp, vp, tables):
    return linear8_decode(mq, mp[:, 0], n), log_decode(vq, vp[:, 0], vp[:, 1], n)


def _decode_log8_rel(n, mq, vq, mp, vp, tables):
    if np.dtype(vq.dtype).itemsize == 1:
        # 8-bit v codes: w and v are two tables gathered at the same indices (w's column 0,
        # for q == 0, is code 1's value); m~ = (q*scale)*w: the same float32 roundings
        qb = _blocks(vq, n)
        idx = _table_index(qb)
        tw = _log_table(vp[:, 2], vp[:, 3])
        tw[:, 0] = tw[:, 1]
        w = tw.reshape(-1)[idx]
        del tw
        v = _log_table(vp[:, 0], vp[:, 1]).reshape(-1)[idx]
        del idx
        m = _blocks(mq, n).astype(np.float32)
        m *= mp[:, 0].astype(np.float32)[:, None]
        m *= w
        return m.reshape(-1)[:n], v.reshape(-1)[:n]
    # uint16 v codes: logrel-aw / logrel-ans / log8-rel-zstd blocks up to 12 bits (the same
    # formula, more powers).  Blocks whose codes fit 8 bits are tabulated as above, the others
    # powered bit by bit (`log_decode`'s split: the same bits at any width); m~ as above
    qb = _blocks(vq, n)
    nb = qb.shape[0]
    wide = np.flatnonzero(qb.max(axis=1) > 256)
    top = int(qb[wide].max()) if wide.size else 256
    bits = (top - 1).bit_length()
    if wide.size and top <= 1 << packed.MAX_WIDTH and 2 * nb * (1 + (1 << bits)) <= TABLE_CELLS:
        # a small entry: w's and v's tables of every block as rows of one table as wide as
        # its widest code (an 8-bit table's columns are its first 257: the same roundings)
        t = _log_table(np.concatenate([vp[:, 2], vp[:, 0]]), np.concatenate([vp[:, 3], vp[:, 1]]), bits)
        cols = t.shape[1]
        t[:nb, 0] = t[:nb, 1]
        flat = t.reshape(-1)
        idx = np.add(qb, (np.arange(nb, dtype=np.int32) * cols)[:, None], dtype=np.int32)
        w = flat[idx]
        idx += nb * cols
        v = flat[idx]
    else:
        idx = _table_index(np.minimum(qb, 256) if wide.size else qb)   # codes <= 256 index the table as they are
        tw = _log_table(vp[:, 2], vp[:, 3])
        tw[:, 0] = tw[:, 1]
        w = tw.reshape(-1)[idx].reshape(qb.shape)
        del tw
        v = _log_table(vp[:, 0], vp[:, 1]).reshape(-1)[idx].reshape(qb.shape)
        del idx
        if wide.size:
            # powers up to the widest code present: a table's column 1 + k holds the same
            # roundings at any width (`_log_decode_bitwise`), and every k = q - 1 is below
            # 2**bits, so the mask keeps it whole; codes past MAX_WIDTH bits keep its mask
            bits = packed.MAX_WIDTH if top > 1 << packed.MAX_WIDTH else bits
            k = wide.size * BLOCK
            w[wide] = _log_decode_bitwise(np.maximum(qb[wide], 1), vp[wide, 2], vp[wide, 3], k,
                                          bits).reshape(-1, BLOCK)
            v[wide] = _log_decode_bitwise(qb[wide], vp[wide, 0], vp[wide, 1], k, bits).reshape(-1, BLOCK)
    m = _blocks(mq, n).astype(np.float32)
    m *= mp[:, 0].astype(np.float32)[:, None]
    m *= w
    return m.reshape(-1)[:n], v.reshape(-1)[:n]


def _decode_bf16(n, mq, vq, mp, vp, tables):
    return bf16_decode(mq), bf16_decode(vq)


def _decode_block8(n, mq, vq, mp, vp, tables):
    return table_decode(mq, mp[:, 0], tables["dynamic8s"], n), table_decode(vq, vp[:, 0], tables["dynamic8u"], n)


DECODERS = {"log8": _decode_log8, "log8-rel": _decode_log8_rel, "bf16": _decode_bf16, "block8": _decode_block8}
"""The numpy decode of each base decode id (a registry entry's ``decode`` field)."""
