"""The interleaved rANS buffers' constants, error and block shapes (the byte layout is
`jaxguard.format.rans`'s docstring).  Numpy only.

Numerical contract
------------------
Integer arithmetic only: the shapes here are counts of coded positions per lane.
"""
from __future__ import annotations

__all__ = ["BLOCK", "KIND_COMPACT", "KIND_COMPACT_WIDE", "TAILS_FLAG", "STATE_LOW", "MAX_WIDTH", "NARROW_WIDTH",
           "MAX_PROB_BITS", "PROB_BITS", "RansError", "kind_max_width", "stream_shapes", "blocked_symbols"]

import numpy as np

from jaxguard.errors import JaxguardError


BLOCK = 256


KIND_COMPACT = 3                     # first byte: models in the buffer, in the compact bit layout


KIND_COMPACT_WIDE = 4                # first byte: as 3, alphabets up to MAX_WIDTH bits (3: up to 8)


TAILS_FLAG = 0x10                    # first byte: each lane's initial state carries 16 caller bits


STATE_LOW = 1 << 16              # L


MAX_WIDTH = 12                   # widest alphabet (kind 4); kinds 1-3 code at most NARROW_WIDTH bits


NARROW_WIDTH = 8


MAX_PROB_BITS = 15


PROB_BITS = tuple(range(8, 16))   # totals 2**P the encoder tries per model (fewest coded bits wins)


class RansError(JaxguardError):
    """An rANS buffer or its arguments are malformed (the message says which and how)."""


# ---------------------------------------------------------------- shapes
def kind_max_width(kind):
    """The widest alphabet (bits) a buffer of this kind byte codes (tails flag ignored).

    Args:
      kind: the buffer's first byte (1..4, optionally + `TAILS_FLAG`).

    Returns:
      `MAX_WIDTH` for kind 4, `NARROW_WIDTH` for kinds 1..3.
    """
    return MAX_WIDTH if (int(kind) & ~TAILS_FLAG) == KIND_COMPACT_WIDE else NARROW_WIDTH


def stream_shapes(alphabet_bits, n, max_width=MAX_WIDTH):
    """Check the widths of one buffer's streams against its symbol count.

    Args:
      alphabet_bits: [nb] (one stream) or [S, nb] widths 0..max_width.
      n: symbols per stream; nb must be ceil(n / 256) (0 or 1 block for n = 0).
      max_width: the widest alphabet allowed.

    Returns:
      (bits [S, nb] int64, counts [nb] coded positions per block, single: True for [nb]).

    Raises:
      RansError: a shape, n or width that does not fit.
    """
    bits = np.asarray(alphabet_bits)
    single = bits.ndim == 1
    bits = np.atleast_2d(bits).astype(np.int64)
    if bits.ndim != 2:
        raise RansError(f"alphabet_bits has shape {np.shape(alphabet_bits)}; pass [nb] or [streams, nb]")
    n = int(n)
    nb = bits.shape[1]
    if n < 0 or nb != -(-n // BLOCK) and not (n == 0 and nb <= 1):
        raise RansError(f"{nb} blocks cannot hold n = {n} symbols; pass ceil(n / {BLOCK}) widths per stream")
    if ((bits < 0) | (bits > max_width)).any():
        bad = int(bits[(bits < 0) | (bits > max_width)][0])
        raise RansError(f"alphabet width {bad} is outside 0..{max_width}")
    counts = np.full(nb, BLOCK, np.int64)
    if nb:
        counts[-1] = n - BLOCK * (nb - 1)
    return bits, counts, single


def blocked_symbols(symbols, bits, counts, single):
    """Check blocked symbols against their widths (`stream_shapes`'s outputs).

    Args:
      symbols: [nb, 256] (single) or [S, nb, 256] ints.
      bits, counts, single: from `stream_shapes`.

    Returns:
      (symbols [S, nb, 256] int64 with the positions past n set to 0, coded [nb, 256] bool).

    Raises:
      RansError: a shape that does not match, or a coded symbol that does not fit its width.
    """
    s = np.asarray(symbols)
    s = s[None] if single else s
    S, nb = bits.shape
    if s.shape[:2] != (S, nb) or s.ndim != 3 or s.shape[2] != BLOCK:
        raise RansError(f"symbols have shape {np.shape(symbols)}; pass [{nb}, {BLOCK}] (or [streams, nb, {BLOCK}]) "
                        f"matching alphabet_bits {tuple(bits.shape) if not single else (nb,)}")
    s = s.astype(np.int64)
    coded = np.broadcast_to(np.arange(BLOCK)[None, None, :] < counts[None, :, None], s.shape)
    bad = coded & ((s < 0) | (s >= (1 << bits)[:, :, None]))
    if bad.any():
        st, b, i = (int(k[0]) for k in np.nonzero(bad))
        raise RansError(f"stream {st} block {b} position {i}: symbol {int(s[st, b, i])} does not fit "
                        f"{int(bits[st, b])} bits")
    coded = coded[0]
    return np.where(coded[None], s, 0), coded
