"""Interleaved rANS for code streams: one lane per 256-block, a static model per stream and
alphabet width.  Numpy only (the reader imports it).

The coder is range-ANS with a 32-bit state ``x`` in ``[L, 2**32)``, ``L = 2**16``, and
16-bit renormalization (Duda 2013; the word-renormalized variant of Giesen's ryg_rans):
encoding symbol ``s`` of frequency ``f``, cumulative start ``c`` under a total ``M = 2**P``
first emits ``x & 0xFFFF`` and shifts ``x >>= 16`` while ``x >= f << (32 - P)`` (at most
once), then sets ``x = (x // f) * M + x % f + c``; decoding takes ``slot = x % M``, the
symbol whose ``[c, c + f)`` holds the slot, ``x = f * (x >> P) + slot - c``, then reads
one 16-bit word if ``x < L``.  Every block of 256 positions is one lane; the lanes advance
together, so decoding is a loop over the 256 positions (times the number of streams that
share the lanes) of numpy operations across all blocks, never a loop over coordinates.
Several streams of the same blocks (e.g. the m and the v codes) may share the lanes: lane
``b`` codes position ``i`` of stream 0, then of stream 1, ..., then position ``i + 1``;
sharing halves the per-lane state cost (4 bytes per lane, not per stream).  `decode_many`
runs the same loop over the lanes of many buffers at once (every tensor of a container),
and `encode_many` likewise encodes many buffers in one loop, each to the bytes `encode`
gives it.

Byte layout of an encoded buffer (all integers little-endian)::

    u8   kind: 1 = models inline (below), 2 = no models (the decoder is given them),
         3 = models inline in the compact layout (`encode_compact_models`: knot levels
         with integer interpolation, or raw levels over the used range; a bit stream
         padded to a byte, ~10-60 bytes a model instead of ceil(2**width / 2));
         4 = as 3, with alphabets up to 12 bits (kinds 1-3: up to 8; the encoder writes
         4 only when a block is wider than 8 bits, so narrower buffers stay readable by
         readers that predate kind 4);
         + 0x10 if the lanes carry tails (below)
    models (kind 1 only), per stream s = 0..S-1:
      u8   number of models K_s (one per alphabet width present in the stream)
      per model, widths ascending and distinct:
        u8   (width << 4) | P      width 0..8, P max(1, width)..15: frequencies sum to 2**P
        ceil(2**width / 2) bytes   a 4-bit level per symbol, low nibble first (0 = absent);
                                   frequencies from levels: `model_freqs`
    nb x u32  the lanes' initial decoder states (the encoder's final states), each >= L
              (the encoder starts each lane at L, or at L + tail: 16 bits the caller
              stores in the otherwise wasted low half of the initial state for at most one
              more bit of output, e.g. the block's bfloat16 m-scale; the decoder ends each
              lane there and returns it)
    u16*      the renormalization words in decoding order: for each position i, for each
              stream s, one word for each lane (ascending) whose state fell below L

A block of width ``b`` holds symbols ``0 .. 2**b - 1``; only the first ``n - 256*(nb-1)``
positions of the last block are coded (the rest decode as 0).  The widths and n are not
in the buffer: the caller stores them (logrel-aw's ``widths`` section).

Numerical contract
------------------
Integer arithmetic only (uint32 / uint64 numpy, no floats on the decode path): ``decode(encode(s))``
returns ``s`` exactly, for every stream, width, model and size, on every platform.  The
decoder checks, and raises `RansError` (a `JaxguardError`, so also a ValueError; one line) instead of returning
wrong symbols or reading out of range: the kind byte; every model byte (width 0..8, 0..12 in kind 4,
P max(1, width)..15, widths ascending, none missing for a coded block), no level past the
alphabet, at least one symbol per model (kind 3: also lo <= hi, the mode, every knot level
in 0..15, Exp-Golomb codes no longer than a level delta needs, zero padding; the levels
are rebuilt with integer arithmetic only); the buffer holds the lane states and whole
words; every state in ``[L, 2**32)``; at most one word per symbol; no word read past the
end; every word consumed; and every lane ending in the encoder's initial state ``L`` (a
check on the whole lane: a flipped bit in the words or states nearly always breaks it,
but it is a 32-bit checksum per lane, not a hash: about 0.2% (kind 1) to 1.5% (kind 3,
whose smooth models give unseen symbols slots) of single-bit flips in the words decode to
another valid message (tests/test_rans.py), which the container's hashes refuse;
with tails, only ``[L, 2L)`` is checked and the caller must check the tails, e.g. by the
container's decoded-moments hash).
Memory is bounded by the sizes the caller passes (``n``, the widths) and ``2**15`` slots
per model, checked before allocating; the loop has a fixed trip count (256 x streams).
"""
from __future__ import annotations

__all__ = ["KIND_COMPACT", "KIND_COMPACT_WIDE", "TAILS_FLAG", "MAX_WIDTH", "NARROW_WIDTH", "MAX_PROB_BITS",
           "PROB_BITS", "BATCH_SLOTS", "RansError", "kind_max_width", "LEVEL_WEIGHTS", "model_freqs",
           "quantize_levels", "fit_models", "encode_models", "COMPACT_RAW", "compact_model_bits",
           "encode_compact_models", "compact_models_bound", "decode_compact_models", "fit_compact_model",
           "encode", "encode_many", "encoded_size", "symbol_cost_bits", "decode_models", "decode",
           "decode_many"]

import numpy as np

from jaxguard.errors import JaxguardError
BLOCK = 256
KIND_INLINE, KIND_EXTERNAL = 1, 2   # first byte: models in the buffer, or given to the decoder
KIND_COMPACT = 3                     # first byte: models in the buffer, in the compact bit layout
KIND_COMPACT_WIDE = 4                # first byte: as 3, alphabets up to MAX_WIDTH bits (3: up to 8)
TAILS_FLAG = 0x10                    # first byte: each lane's initial state carries 16 caller bits
STATE_LOW = 1 << 16              # L
MAX_WIDTH = 12                   # widest alphabet (kind 4); kinds 1-3 code at most NARROW_WIDTH bits
NARROW_WIDTH = 8
MAX_PROB_BITS = 15
PROB_BITS = tuple(range(8, 16))   # totals 2**P the encoder tries per model (fewest coded bits wins)
# `decode_many` runs one lane loop per batch of buffers whose decode tables (2**P slots a
# model and stream, 4-byte entries) sum to at most this: a container of many tensors with
# 2**15-slot models built 2.7 GB of tables at once (16.5M coordinates, 760 tensors).
BATCH_SLOTS = 1 << 22


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


def _shapes(alphabet_bits, n, max_width=MAX_WIDTH):
    """alphabet_bits [nb] or [S, nb] -> (bits [S, nb] int64, counts [nb], single-stream?)."""
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


def _blocked(symbols, bits, counts, single):
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


# ---------------------------------------------------------------- models
# A model is (P, levels): levels[symbol] in 0..15 (0 = absent), stored as 4-bit nibbles; the
# frequencies follow from them by `model_freqs` (integers only), so the table of a width-w
# model is ceil(2**w / 2) bytes whatever P is.  Level k > 0 weighs round(2**(0.75*(k-1))):
# steps of 2**0.75 cost ~0.02 bits per symbol against exact frequencies (measured:
# bench/experiments/results/entropy_probe.md), over a 2**10.5 range.
LEVEL_WEIGHTS = (0, 1, 2, 3, 5, 8, 13, 23, 38, 64, 108, 181, 304, 512, 861, 1448)
_W = np.array(LEVEL_WEIGHTS, np.int64)


def model_freqs(levels, prob_bits):
    """Frequencies of a model: present symbols get ``1 + W*(M - K) // sum(W)`` (``M = 2**P``,
    K present symbols, W their level weights); the remainder goes to the first symbol of
    the highest level.  Sums to exactly M; every present symbol >= 1.

    Args:
      levels: [2**width] ints 0..15, at least one > 0 and at most 2**prob_bits of them.
      prob_bits: P.

    Returns:
      int64 frequencies.

    Raises:
      RansError: no present symbol, or more present symbols than slots.
    """
    lv = np.asarray(levels, np.int64)
    M = 1 << int(prob_bits)
    k = int((lv > 0).sum())
    if k == 0 or k > M:
        raise RansError(f"a model with {k} present symbols cannot fill 2**{prob_bits} slots (need 1..2**P)")
    w = _W[lv]
    f = np.where(lv > 0, 1 + w * (M - k) // int(w.sum()), 0)
    f[int(np.argmax(lv))] += M - int(f.sum())
    return f


def _cost_bits(hist, freqs, prob_bits):
    nz = hist > 0
    return float((hist[nz] * (prob_bits - np.log2(freqs[nz]))).sum())


def quantize_levels(hist, shift=0):
    """Histogram -> levels: nearest 2**0.75 step below the most frequent symbol (at level
    15 + shift, saturating), present symbols >= 1.

    Args:
      hist: symbol counts, at least one > 0.
      shift: levels added before saturating at 15 (`fit_models` tries 0..3).

    Returns:
      int64 levels 0..15, 0 exactly where the count is 0.
    """
    h = np.asarray(hist, np.float64)
    with np.errstate(divide="ignore"):
        k = np.round(np.log2(h / h.max()) / 0.75) + 15 + shift
    return np.where(h > 0, np.clip(np.nan_to_num(k, nan=1, neginf=1), 1, 15), 0).astype(np.int64)


def fit_models(symbols, alphabet_bits, n, prob_bits=None, compact=False):
    """Static models of each stream: one per alphabet width present, P chosen per model.

    Args:
      symbols: [nb, 256] (or [streams, nb, 256]) ints, symbol < 2**width of its block.
      alphabet_bits: [nb] (or [streams, nb]) widths 0..12.
      n: symbols per stream (the last block codes n - 256*(nb-1)).
      prob_bits: force this P for every model; default: per model the P in `PROB_BITS`
        (and level shift 0..3) of fewest coded bits.
      compact: fit for the kind-3 layout (`encode_compact_models`): per model the levels
        of fewest model + coded bits among the exact ones and smooth ones (knots every
        2**j symbols, each knot then moved by single levels while that pays).

    Returns:
      per stream, a dict width -> (P, levels [2**width] int64).

    Raises:
      RansError: shapes or symbols that do not match the widths.
    """
    bits, counts, single = _shapes(alphabet_bits, n)
    s, coded = _blocked(symbols, bits, counts, single)
    models = []
    for st in range(bits.shape[0]):
        mods = {}
        for w in np.unique(bits[st][counts > 0]).tolist():
            lanes = (bits[st] == w) & (counts > 0)
            hist = np.bincount(s[st][lanes][coded[lanes]], minlength=1 << w)
            cands = [prob_bits] if prob_bits is not None else [p for p in PROB_BITS if p >= w]
            if compact:
                mods[w] = fit_compact_model(hist, w, cands)
                continue
            best = None
            for p in cands:
                for shift in range(4):
                    lv = quantize_levels(hist, shift)
                    cost = _cost_bits(hist, model_freqs(lv, p), p)
                    if best is None or cost < best[0]:
                        best = (cost, p, lv)
            mods[w] = (best[1], best[2])
        models.append(mods)
    return models


def encode_models(models) -> bytes:
    """Models -> their bytes (the layout's model part; `decode_models` reads them back).

    Args:
      models: per stream, dict width -> (P, levels), e.g. from `fit_models`.

    Returns:
      bytes.
    """
    out = bytearray()
    for mods in models:
        out.append(len(mods))
        for w in sorted(mods):
            p, lv = mods[w]
            out.append((w << 4) | p)
            lv = np.asarray(lv, np.uint8)
            lv = np.concatenate([lv, np.zeros(lv.size % 2, np.uint8)])
            out += (lv[0::2] | (lv[1::2] << 4)).astype(np.uint8).tobytes()
    return bytes(out)


# ---------------------------------------------------------------- compact models (kind 3)
# The levels of a code stream's model are smooth (log-spaced codes: a roughly linear
# log-pmf), so kind 3 stores each model as levels at "knots" with integer linear
# interpolation between them, the knot levels delta-coded (Exp-Golomb); a model the
# knots cannot describe is stored as raw 4-bit levels over its range.  The decoder
# rebuilds the same integer levels, and from them (`model_freqs`) the same frequencies.
COMPACT_RAW = 15                 # mode of a model stored as raw 4-bit levels
_MAX_EG_ZEROS = 4                # |delta| <= 15 -> zigzag <= 30 -> at most 4 leading zeros
_REVERSED_BITS = [[int(format(v, f"0{n}b")[::-1] or "0", 2) for v in range(1 << n)]
                  for n in range(_MAX_EG_ZEROS + 1)]   # [n][v]: v's n bits in reverse order


def _knot_positions(lo, hi, mode):
    """Knots of mode j over [lo, hi]: lo, lo + 2**j, ... below hi, then hi."""
    return np.concatenate([np.arange(lo, hi, 1 << mode), [hi]]).astype(np.int64) if hi > lo \
        else np.array([lo], np.int64)


def _interpolate(pos, knot_levels):
    """Integer levels on pos[0]..pos[-1]: round-half-up linear interpolation between knots."""
    pos, kl = np.asarray(pos, np.int64), np.asarray(knot_levels, np.int64)
    if pos.size == 1:
        return kl.copy()
    s = np.arange(pos[0], pos[-1] + 1)
    seg = np.minimum(np.searchsorted(pos, s, side="right") - 1, pos.size - 2)
    pa, pb, la, lb = pos[seg], pos[seg + 1], kl[seg], kl[seg + 1]
    return la + ((lb - la) * (s - pa) * 2 + (pb - pa)) // (2 * (pb - pa))


def _eg_bits(delta):
    """Bits of each signed delta's Exp-Golomb-0 code of its zigzag (0, -1, 1, -2, ...)."""
    z = np.where(np.asarray(delta) >= 0, 2 * np.asarray(delta), -2 * np.asarray(delta) - 1) + 1
    return 2 * np.floor(np.log2(z)).astype(np.int64) + 1


def _compact_form(levels, width):
    """Cheapest exact kind-3 form of one model's levels -> (bits, lo, hi, mode, knot levels)."""
    lv = np.asarray(levels, np.int64)
    nz = np.flatnonzero(lv)
    lo, hi = int(nz[0]), int(nz[-1])
    head = 8 + 2 * width + 4
    best = (head + 4 * (hi - lo + 1), lo, hi, COMPACT_RAW, lv[lo:hi + 1])
    for mode in range(MAX_WIDTH + 1):
        pos = _knot_positions(lo, hi, mode)
        kl = lv[pos]
        if (_interpolate(pos, kl) == lv[lo:hi + 1]).all():
            bits = head + 4 + int(_eg_bits(np.diff(kl)).sum())
            if bits < best[0]:
                best = (bits, lo, hi, mode, kl)
        if pos.size <= 2:
            break
    return best


def compact_model_bits(levels, width):
    """Bits of one model in the kind-3 layout (the cheapest exact form of these levels).

    Args:
      levels: [2**width] ints 0..15, at least one > 0.
      width: the alphabet width.

    Returns:
      int bits, the (width, P) byte included (not the stream's 4-bit model count or the
      final byte padding).
    """
    return _compact_form(levels, width)[0]


def _put(bits, value, n):
    bits.extend((int(value) >> k) & 1 for k in range(n))


def encode_compact_models(models) -> bytes:
    """Models -> their kind-3 bytes (`decode_compact_models` reads them back).

    Layout, a bit stream (bit k of byte i is bit 8i + k; fields LSB first), padded with 0
    bits to a whole byte: per stream, 4 bits K (models); per model, widths ascending:
    4 bits width, 4 bits P, ``width`` bits lo, ``width`` bits hi (the first and last
    symbol of nonzero level), 4 bits mode; mode 0..width: knots at lo, lo + 2**mode, ...
    (below hi) and hi, the first knot's level in 4 bits, then each next knot's level
    minus the previous one as Exp-Golomb-0 of its zigzag (0, -1, 1, -2, ... -> 0, 1, 2,
    3, ...: z + 1 in binary, MSB first, after as many 0 bits as it has bits minus one);
    levels between knots ``la + ((lb - la)*(s - pa)*2 + (pb - pa)) // (2*(pb - pa))``;
    mode 15: 4 bits per level lo..hi.  Levels outside lo..hi are 0.

    Args:
      models: per stream, dict width -> (P, levels), e.g. from `fit_models`.

    Returns:
      bytes.
    """
    bits = []
    for mods in models:
        _put(bits, len(mods), 4)
        for w in sorted(mods):
            p, lv = mods[w]
            _, lo, hi, mode, kl = _compact_form(lv, w)
            _put(bits, w, 4)
            _put(bits, p, 4)
            _put(bits, lo, w)
            _put(bits, hi, w)
            _put(bits, mode, 4)
            if mode == COMPACT_RAW:
                for v in kl:
                    _put(bits, v, 4)
                continue
            _put(bits, kl[0], 4)
            for d in np.diff(kl).tolist():
                z = (2 * d if d >= 0 else -2 * d - 1) + 1
                nb = z.bit_length()
                bits.extend([0] * (nb - 1))
                bits.extend((z >> k) & 1 for k in range(nb - 1, -1, -1))
    bits.extend([0] * (-len(bits) % 8))
    return np.packbits(np.array(bits, np.uint8), bitorder="little").tobytes() if bits else b""


def compact_models_bound(streams, max_width=NARROW_WIDTH):
    """Most bytes `encode_compact_models` can write for this many streams.

    Args:
      streams: S.
      max_width: the widest alphabet (kind 3: `NARROW_WIDTH`, kind 4: `MAX_WIDTH`).

    Returns:
      int bytes.
    """
    per_model = 8 + 2 * max_width + 4 + 4 * (1 << max_width)
    return -(-streams * (4 + (max_width + 1) * per_model) // 8)


def decode_compact_models(buf, streams, pos=0, what="rans", max_width=NARROW_WIDTH):
    """Kind-3 model bytes (from `encode_compact_models`) -> (models, end offset).

    Args:
      buf: bytes.
      streams: S, the number of streams.
      pos: offset of the model part in buf.
      what: name used in error messages.
      max_width: the widest alphabet the buffer's kind allows (3: 8 bits, 4: 12 bits).

    Returns:
      (list per stream of dict width -> (P, levels), offset just past the models).

    Raises:
      RansError: truncated, a bad width or P (width 0..max_width ascending and distinct, P
        max(1, width)..15), hi < lo, a mode other than 0..max_width or 15, a knot level
        outside 0..15, an Exp-Golomb code longer than a level delta needs, a model with
        no symbol, or nonzero padding bits.
    """
    raw = np.frombuffer(bytes(buf), np.uint8)[pos:pos + compact_models_bound(streams, max_width)]
    nbits = 8 * raw.size
    # little-endian bit reader: 72-byte ints every 64 bytes, so a read of <= 64 bits at any
    # offset shifts one small int (a whole-buffer int would cost its length per read)
    padded = raw.tobytes() + bytes(8)
    chunks = [int.from_bytes(padded[i:i + 72], "little") for i in range(0, raw.size, 64)]
    at = 0

    def peek(n):
        return (chunks[at >> 9] >> (at & 511)) & ((1 << n) - 1) if n else 0

    def get(n, where):
        nonlocal at
        if at + n > nbits:
            raise RansError(f"{what}: truncated inside the compact models ({where})")
        v = peek(n)
        at += n
        return v

    def get_nibbles(m, where):
        nonlocal at
        if at + 4 * m > nbits:
            raise RansError(f"{what}: truncated inside the compact models ({where})")
        seg = np.unpackbits(raw[at >> 3:((at + 4 * m + 7) >> 3)], bitorder="little")[at & 7:(at & 7) + 4 * m]
        at += 4 * m
        return seg.reshape(m, 4).astype(np.int64) @ np.array([1, 2, 4, 8], np.int64)

    def get_zigzag(where):
        """One Exp-Golomb-0 code: zeros, a one, then as many bits (first bit most significant)."""
        nonlocal at
        t = min(_MAX_EG_ZEROS + 1, nbits - at)
        w = peek(t)
        if w == 0:
            if t < _MAX_EG_ZEROS + 1:
                raise RansError(f"{what}: truncated inside the compact models ({where})")
            raise RansError(f"{what}: {where} model has a knot code longer than a level delta needs")
        nz = (w & -w).bit_length() - 1
        at += nz + 1
        tail = get(nz, where)
        return ((1 << nz) | _REVERSED_BITS[nz][tail]) - 1

    models = []
    for st in range(streams):
        k = get(4, f"stream {st} model count")
        if k > max_width + 1:
            raise RansError(f"{what}: stream {st} declares {k} models; at most {max_width + 1} widths exist")
        mods = {}
        for _ in range(k):
            w, p = get(4, f"stream {st} width"), get(4, f"stream {st} P")
            if w > max_width or not max(1, w) <= p <= MAX_PROB_BITS or (mods and w <= max(mods)):
                raise RansError(f"{what}: stream {st} compact model (width {w}, P {p}): width must be "
                                f"0..{max_width}, ascending and distinct, P max(1, width)..{MAX_PROB_BITS}")
            where = f"stream {st} width {w}"
            lo, hi, mode = get(w, where), get(w, where), get(4, where)
            if hi < lo:
                raise RansError(f"{what}: {where} model has hi {hi} < lo {lo}")
            lv = np.zeros(1 << w, np.int64)
            if mode == COMPACT_RAW:
                lv[lo:hi + 1] = get_nibbles(hi - lo + 1, where)
            elif mode <= max_width:
                kpos = _knot_positions(lo, hi, mode)
                kl = [get(4, where)]
                for _ in range(kpos.size - 1):
                    z = get_zigzag(where)
                    lvl = kl[-1] + (z // 2 if z % 2 == 0 else -(z + 1) // 2)
                    if not 0 <= lvl <= 15:
                        raise RansError(f"{what}: {where} model has a knot level {lvl} outside 0..15")
                    kl.append(lvl)
                lv[lo:hi + 1] = _interpolate(kpos, kl)
            else:
                raise RansError(f"{what}: {where} model has mode {mode}; pass 0..{max_width} (knots) or "
                                f"{COMPACT_RAW} (raw levels)")
            if not lv.any():
                raise RansError(f"{what}: {where} model has no symbol")
            mods[w] = (p, lv)
        models.append(mods)
    pad = -at % 8
    if get(pad, "padding") if pad else 0:
        raise RansError(f"{what}: the compact models' padding bits are not 0")
    return models, pos + at // 8


# `fit_compact_model` scores many candidate levels by model + coded bits, and the scores decide
# the bytes (a tie or a `<` between two floats picks the model), so each score is computed
# as the plain formulas of tests/test_rans.py's `_fit_compact_reference` compute it: the
# same float64 terms added in the same order (exact levels: one row at a time, pairwise, as
# `_cost_bits`; knot candidates: term after term in symbol order, as numpy sums the
# Fortran-order rows ``f[:, mask]`` gives).  What candidates share (segments, per-level
# frequencies, the levels a knot move leaves alone) is computed once.
_EG_DELTA_BITS = _eg_bits(np.arange(-15, 16))      # Exp-Golomb bits of a level delta, index delta + 15


def _mode_segments(size, last_mode):
    """Where each symbol of a range lies between the knots of modes 0..last_mode.

    The knots of mode j (`_knot_positions`, relative to lo) are 0, 2**j, ... below
    size - 1, then size - 1, so symbol s lies in segment ``min(s >> j, K - 2)``.

    Args:
      size: symbols in the range, hi - lo + 1 >= 2.
      last_mode: the last mode.

    Returns:
      dict: ``knots`` (per mode, its knot positions), then [modes, size] int64 rows
      (row j: mode j): ``seg``, ``left`` and ``right`` (the segment's knots pa, pb),
      ``twice_offset`` (2 * (s - pa)), ``span`` (pb - pa), ``twice_span``.
    """
    modes = np.arange(last_mode + 1)
    sym = np.arange(size)
    count = -(-(size - 1) >> modes) + 1
    seg = np.minimum(sym[None] >> modes[:, None], (count - 2)[:, None])
    left = seg << modes[:, None]
    span = np.minimum((seg + 1) << modes[:, None], size - 1) - left
    return {"knots": [np.concatenate([np.arange(0, size - 1, 1 << j), [size - 1]]) for j in modes.tolist()],
            "seg": seg, "left": left, "right": left + span, "twice_offset": 2 * (sym[None] - left),
            "span": span, "twice_span": 2 * span}


def _last_mode(size):
    """The first mode with at most 2 knots over a range of this many symbols (0 for 1 or 2)."""
    return max(0, int(size - 2).bit_length())


def _exact_form_bits(levels, width, segments):
    """`compact_model_bits` of level rows over one range: the raw form, or the cheapest
    mode whose knots interpolate the levels exactly.

    Args:
      levels: [B, size] ints 0..15, levels lo..hi (both > 0).
      width: the alphabet width.
      segments: `_mode_segments` of the range up to `_last_mode` (None if size is 1).

    Returns:
      [B] int64 bits.
    """
    head = 8 + 2 * width + 4
    raw = head + 4 * levels.shape[1]
    if segments is None:                # one symbol: mode 0 is no cheaper than raw
        return np.full(levels.shape[0], raw, np.int64)
    la, lb = levels[:, segments["left"]], levels[:, segments["right"]]       # [B, modes, size]
    exact = (la + ((lb - la) * segments["twice_offset"] + segments["span"]) // segments["twice_span"]
             == levels[:, None]).all(2)
    bits = np.stack([head + 4 + _EG_DELTA_BITS[np.diff(levels[:, k], axis=1) + 15].sum(1)
                     for k in segments["knots"]], axis=1)
    return np.minimum(raw, np.where(exact, bits, raw).min(1))


def _model_costs(hist, levels, prob_bits):
    """`_cost_bits` of each level row under `model_freqs` at its P (the same floats).

    Args:
      hist: [A] int64 counts.
      levels: [B, A] ints 0..15.
      prob_bits: [B] ints P.

    Returns:
      [B] float64 bits.

    Raises:
      RansError: as `model_freqs`, for the first row it refuses.
    """
    p = np.asarray(prob_bits, np.int64)
    M = np.left_shift(1, p)
    k = (levels > 0).sum(1)
    bad = np.flatnonzero((k == 0) | (k > M))
    if bad.size:
        model_freqs(levels[bad[0]], int(p[bad[0]]))
    w = _W[levels]
    f = np.where(levels > 0, 1 + w * (M - k)[:, None] // w.sum(1)[:, None], 0)
    f[np.arange(levels.shape[0]), np.argmax(levels, axis=1)] += M - f.sum(1)
    nz = hist > 0
    # C order: each row a pairwise sum, as `_cost_bits` sums its one row
    return np.ascontiguousarray(hist[nz] * (p[:, None] - np.log2(f[:, nz]))).sum(1)


def _range_counts(h):
    """The nonzero counts of a histogram range h (lo..hi): ``present`` (their symbols),
    ``present_index`` (each symbol's index among them, -1 if its count is 0), ``counts``
    (float64)."""
    present = np.flatnonzero(h > 0)
    index = np.full(h.size, -1, np.int64)
    index[present] = np.arange(present.size)
    return {"present": present, "present_index": index, "counts": h[present].astype(np.float64)}


def _summed_terms(terms, top, top_freq, counts, prob_bits):
    """Per row, ``count * (P - log2 f)`` added over the present symbols one after another
    in symbol order (numpy sums axis 0 of a C-order array so; the plain formulas' [rows,
    symbols] terms are in Fortran order, the same memory, summed the same way).

    Args:
      terms: [present, B] C-order float64, B >= 2 (one row would be summed pairwise):
        ``P - log2 f`` of each present symbol at its level's frequency (modified in place).
      top: [B] each row's first symbol of the highest level, which has ``top_freq``.
      top_freq: [B] its frequency (the level's plus the remainder).
      counts: `_range_counts`.
      prob_bits: P.

    Returns:
      [B] float64 bits.
    """
    index = counts["present_index"][top]
    hit = np.flatnonzero(index >= 0)
    terms[index[hit], hit] = prob_bits - np.log2(top_freq[hit])
    terms *= counts["counts"][:, None]
    return terms.sum(0)


def _level_freqs(per_level, size, prob_bits):
    """[B, 16] a symbol's frequency under `model_freqs` by its level, from each row's
    number of symbols per level [B, 16] (all ``size`` symbols present)."""
    M = 1 << prob_bits
    return 1 + _W * (M - size) // (per_level @ _W)[:, None]


def _level_costs(levels, counts, prob_bits):
    """Coded bits of level rows over a range (all levels 1..15: every symbol present) under
    `model_freqs`, each row's terms added in symbol order (`_summed_terms`).

    Args:
      levels: [B >= 2, size] ints 1..15.
      counts: `_range_counts` of the range's histogram.
      prob_bits: P.

    Returns:
      [B] float64 bits.
    """
    rows, size = levels.shape
    ar = np.arange(rows)
    per_level = np.bincount((levels + 16 * ar[:, None]).reshape(-1), minlength=16 * rows).reshape(rows, 16)
    freq = _level_freqs(per_level, size, prob_bits)
    top = np.argmax(levels, axis=1)
    top_freq = freq[ar, levels[ar, top]] + (1 << prob_bits) - (per_level * freq).sum(1)
    level_bits = np.ascontiguousarray((prob_bits - np.log2(freq)).T)               # [16, B]
    terms = np.ascontiguousarray(np.take_along_axis(level_bits, levels[:, counts["present"]].T, axis=0))
    return _summed_terms(terms, top, top_freq, counts, prob_bits)


def _knot_levels_rows(knot_levels, segments, mode):
    """`_interpolate` of knot-level rows [B, K] at the knots of a mode -> [B, size]."""
    kl = knot_levels
    if segments is None:
        return kl.copy()
    seg = segments["seg"][mode]
    la, lb = kl[:, seg], kl[:, seg + 1]
    return la + ((lb - la) * segments["twice_offset"][mode] + segments["span"][mode]) // segments["twice_span"][mode]


def _smooth_rows(hist, lo, hi, segments):
    """The smooth candidates of modes 1.. (`fit_compact_model`): per mode j, knot levels [4, K]
    at level shifts 0..3 from the mean count of a window of 2**j symbols around each knot
    (quantized as `quantize_levels`).

    Args:
      hist: the full histogram (int64).
      lo, hi: its first and last nonzero symbol.
      segments: `_mode_segments` of lo..hi up to mode ``max(1, _last_mode)`` (None if
        lo == hi).

    Returns:
      list over modes 1, 2, ... (up to the first with at most 2 knots) of [4, K] int64
      knot levels at the mode's knots.
    """
    knots = [np.zeros(1, np.int64)] if segments is None else segments["knots"][1:]
    sizes = [k.size for k in knots]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    pos = np.concatenate(knots) + lo
    half = np.repeat([(1 << j) // 2 for j in range(1, len(knots) + 1)], sizes)
    c = np.concatenate([[0], np.cumsum(hist)])
    a, b = np.maximum(pos - half, lo), np.minimum(pos + half, hi) + 1
    mean = (c[b] - c[a]) / (b - a)
    peak = np.repeat(np.maximum.reduceat(mean, starts), sizes)      # each mode's largest mean
    with np.errstate(divide="ignore"):
        k = np.round(np.log2(mean / peak) / 0.75) + 15
    k = np.clip(np.nan_to_num(k[None] + np.arange(4)[:, None], nan=1, neginf=1), 1, 15).astype(np.int64)
    return [k[:, s:s + n] for s, n in zip(starts.tolist(), sizes)]


def _knot_moves(segments, mode, counts):
    """The symbols each single-knot move changes: knot j is an end of segments j - 1 and j.

    Args:
      segments: `_mode_segments` of the range.
      mode: the knots' mode (at least 2 knots).
      counts: `_range_counts` of the range.

    Returns:
      dict over the 2K moves (knot j up a level: move j; down: move K + j), each move's
      symbols one run, runs in move order: per entry ``move``, ``sym``, ``seg``, ``left`` /
      ``right`` (the knot is the segment's left / right end), ``twice_offset``, ``span``,
      ``twice_span``, ``present_index``; per move ``knot``, ``sign``, ``start`` / ``stop``
      (its first and last symbol) and ``run_start`` (its first entry).
    """
    seg = segments["seg"][mode]
    K = segments["knots"][mode].size
    j = np.arange(K)
    start = np.tile(np.searchsorted(seg, np.maximum(j - 1, 0), side="left"), 2)
    stop = np.tile(np.searchsorted(seg, np.minimum(j, K - 2), side="right") - 1, 2)
    length = stop - start + 1
    move = np.repeat(np.arange(2 * K), length)
    run_start = np.concatenate([[0], np.cumsum(length)[:-1]])
    sym = start[move] + np.arange(move.size) - run_start[move]
    knot = np.tile(j, 2)
    return {"move": move, "sym": sym, "seg": seg[sym], "left": seg[sym] == knot[move],
            "right": seg[sym] + 1 == knot[move], "twice_offset": segments["twice_offset"][mode][sym],
            "span": segments["span"][mode][sym], "twice_span": segments["twice_span"][mode][sym],
            "present_index": counts["present_index"][sym], "knot": knot, "sign": np.repeat([1, -1], K),
            "start": start, "stop": stop, "run_start": run_start}


def _move_costs(segments, mode, moves, counts, knot_levels, levels, moved_knots, prob_bits, head):
    """Model + coded bits of the 2K rows ``clip(knot_levels +- 1 at one knot, 1, 15)``
    (move order, `_knot_moves`): the floats `_level_costs` of their levels plus their
    model bits give, from the levels of ``knot_levels`` and the few each move changes.

    Args:
      segments, mode, moves, counts: the knots' `_mode_segments`, mode, `_knot_moves` and
        the range's `_range_counts`.
      knot_levels: [K] ints 1..15.
      levels: their levels over the range (`_knot_levels_rows`).
      moved_knots: [2K] each move's new knot level, clipped to 1..15.
      prob_bits: P.
      head: model bits besides the knot deltas' Exp-Golomb codes.

    Returns:
      ([2K] float64 bits, the moved levels of each move's run in ``moves["sym"]`` order).
    """
    kl = knot_levels
    K = kl.size
    rows = 2 * K
    ar = np.arange(rows)
    knot = moves["knot"]
    step = moved_knots - kl[knot]
    delta = kl[1:] - kl[:-1]
    # model bits: a move changes the deltas on either side of its knot
    padded = np.concatenate([[0], delta, [0]])
    before, after = padded[knot], padded[knot + 1]
    mbits = (head + _EG_DELTA_BITS[delta + 15].sum()
             + np.where(knot >= 1, _EG_DELTA_BITS[before + step + 15] - _EG_DELTA_BITS[before + 15], 0)
             + np.where(knot <= K - 2, _EG_DELTA_BITS[after - step + 15] - _EG_DELTA_BITS[after + 15], 0))
    size = levels.size
    entry_step = step[moves["move"]]
    la = kl[moves["seg"]] + entry_step * moves["left"]
    lb = kl[moves["seg"] + 1] + entry_step * moves["right"]
    moved = la + ((lb - la) * moves["twice_offset"] + moves["span"]) // moves["twice_span"]
    row_base = 16 * moves["move"]
    per_level = np.bincount(levels, minlength=16)[None] + (
        np.bincount(row_base + moved, minlength=16 * rows)
        - np.bincount(row_base + levels[moves["sym"]], minlength=16 * rows)).reshape(rows, 16)
    freq = _level_freqs(per_level, size, prob_bits)
    # each row's first symbol of the highest level: the largest key level * size + (size - 1 - symbol)
    # before its move's run, in it, or after it
    key = levels * size + (size - 1 - np.arange(size))
    first = np.concatenate([[-1], np.maximum.accumulate(key)])[moves["start"]]
    last = np.concatenate([np.maximum.accumulate(key[::-1])[::-1], [-1]])[moves["stop"] + 1]
    inside = np.maximum.reduceat(moved * size + (size - 1 - moves["sym"]), moves["run_start"])
    top_key = np.maximum(np.maximum(first, inside), last)
    top_level, top = top_key // size, size - 1 - top_key % size
    top_freq = freq[ar, top_level] + (1 << prob_bits) - (per_level * freq).sum(1)
    level_bits = np.ascontiguousarray((prob_bits - np.log2(freq)).T)               # [16, 2K]
    terms = level_bits.take(levels[counts["present"]], axis=0)                      # [present, 2K]
    present = moves["present_index"] >= 0
    move = moves["move"][present]
    terms[moves["present_index"][present], move] = level_bits[moved[present], move]
    return _summed_terms(terms, top, top_freq, counts, prob_bits) + mbits, moved


def fit_compact_model(hist, width, cands):
    """(P, levels) of fewest model + coded bits (kind 3) for one histogram: the exact levels
    (as kind 1 fits them), or smooth ones (knots every 2**j symbols on the window means,
    then single knots moved by one level, steepest first, while that pays).

    Args:
      hist: [2**width] counts, at least one > 0.
      width: the alphabet width.
      cands: the P to try (the largest scores the levels).

    Returns:
      (P, levels [2**width] int64).
    """
    with np.errstate(divide="ignore"):      # a frequency of 0 (more symbols than slots) costs inf bits
        return _fit_compact_levels(np.asarray(hist, np.int64), width, cands)


def _fit_compact_levels(hist, width, cands):
    """`fit_compact_model` of an int64 histogram (divide warnings off)."""
    nz = np.flatnonzero(hist)
    lo, hi = int(nz[0]), int(nz[-1])
    h = hist[lo:hi + 1]
    size = h.size
    ref_p = max(cands)
    head = 8 + 2 * width + 4 + 4
    segments = _mode_segments(size, max(1, _last_mode(size))) if size > 1 else None
    counts = _range_counts(h)
    # the exact levels at shifts 0..3 (`quantize_levels`)
    exact = np.stack([quantize_levels(hist, shift) for shift in range(4)])
    cost = (_model_costs(hist, exact, np.full(4, ref_p))
            + _exact_form_bits(exact[:, lo:hi + 1], width, segments)).tolist()
    best = None
    for shift in range(4):
        if best is None or cost[shift] < best[0]:
            best = (cost[shift], exact[shift, lo:hi + 1])
    # the smooth levels of each mode, at shifts 0..3
    smooth_rows = _smooth_rows(hist, lo, hi, segments)
    levels = np.concatenate([_knot_levels_rows(rows, segments, mode) for mode, rows in enumerate(smooth_rows, 1)])
    mbits = np.concatenate([head + _EG_DELTA_BITS[np.diff(rows, axis=1) + 15].sum(1) for rows in smooth_rows])
    totals = (_level_costs(levels, counts, ref_p) + mbits).reshape(-1, 4)
    smooth = None
    for mode, (rows, c) in enumerate(zip(smooth_rows, totals), 1):
        i = int(np.argmin(c))
        if smooth is None or c[i] < smooth[0]:
            smooth = (float(c[i]), mode, rows[i])
    # single knots moved by one level while that pays
    c, mode, kl = smooth
    K = kl.size
    moves = _knot_moves(segments, mode, counts) if K > 1 else None
    knot, sign = np.tile(np.arange(K), 2), np.repeat([1, -1], K)
    levels = _knot_levels_rows(kl[None], segments, mode)[0]
    for _ in range(8 * K):
        moved = kl[knot] + sign
        ok = (moved >= 1) & (moved <= 15)
        if not ok.any():
            break
        moved_knots = np.minimum(np.maximum(moved, 1), 15)
        if moves is None:
            cs = _level_costs(moved_knots[:, None], counts, ref_p) + head
        else:
            cs, moved_levels = _move_costs(segments, mode, moves, counts, kl, levels, moved_knots, ref_p, head)
        cs = np.where(ok, cs, np.inf)
        i = int(cs.argmin())
        if not cs[i] < c:
            break
        c, kl, levels = float(cs[i]), kl.copy(), levels.copy()
        kl[knot[i]] = moved[i]
        if moves is None:
            levels[:] = moved[i]
        else:
            run = slice(moves["run_start"][i], moves["run_start"][i] + moves["stop"][i] - moves["start"][i] + 1)
            levels[moves["sym"][run]] = moved_levels[run]
    if c < best[0]:
        best = (c, levels)
    lv = np.zeros(1 << width, np.int64)
    lv[lo:hi + 1] = best[1]
    cost = dict(zip(cands, _model_costs(hist, np.tile(lv, (len(cands), 1)), np.array(cands)).tolist()))
    return min(cost, key=cost.get), lv


def _lane_tables(models, bits, slots=True):
    """Flat per-stream tables: freq/start by (model base + symbol) and, with `slots` (the
    decoder's), slot -> symbol, frequency and slot - start by (slot base + slot), uint32
    (2**P entries a model: the encoder needs none of them)."""
    tabs = []
    for st, mods in enumerate(models):
        freq, start, slot_sym, slot_freq, slot_bias, sym_base, slot_base, pb = [], [], [], [], [], {}, {}, {}
        nsym = nslot = 0
        for w in sorted(mods):
            p, lv = mods[w]
            f = model_freqs(lv, p)
            sym_base[w], slot_base[w], pb[w] = nsym, nslot, p
            freq.append(f)
            start.append(np.concatenate([[0], np.cumsum(f)[:-1]]))
            if slots:
                slot_sym.append(np.repeat(np.arange(f.size, dtype=np.uint32), f))
                slot_freq.append(np.repeat(f.astype(np.uint32), f))
                slot_bias.append(np.arange(1 << p, dtype=np.uint32) - np.repeat(start[-1].astype(np.uint32), f))
            nsym += f.size
            nslot += 1 << p
        cat = (lambda a, dt=np.uint64: np.concatenate(a).astype(dt, copy=False)) if freq else \
            (lambda a, dt=np.uint64: np.zeros(0, dt))
        b = np.asarray(bits[st], np.int64)

        def lane(d, b=b):              # per-width value -> per-lane array (0 for a width without model)
            lut = np.zeros(max(int(b.max(initial=0)), max(d, default=0)) + 1, np.uint64)
            lut[list(d)] = list(d.values())
            return lut[b]
        tab = {"freq": cat(freq), "start": cat(start), "sym_base": lane(sym_base), "slot_base": lane(slot_base),
               "p": lane(pb)}
        if slots:
            tab.update(slot_sym=cat(slot_sym, np.uint32), slot_freq=cat(slot_freq, np.uint32),
                       slot_bias=cat(slot_bias, np.uint32))
        tabs.append(tab)
    return tabs


# ---------------------------------------------------------------- encode
def encode(symbols, alphabet_bits, n, models=None, prob_bits=None, inline_models=True, lane_tails=None,
           compact_models=False) -> bytes:
    """Code streams of blocked symbols -> one rANS buffer (layout: module docstring).

    Args:
      symbols: [nb, 256] ints (or [streams, nb, 256]: the streams share the lanes).
        Positions past n in the last block are ignored.
      alphabet_bits: [nb] (or [streams, nb]) ints 0..12: block b's symbols are < 2**width
        (wider than 8 bits: compact inline models only, kind byte 4).
      n: symbols per stream.
      models: from `fit_models` (default: fitted here on these symbols).
      prob_bits: passed to `fit_models`.
      inline_models: store the models in the buffer (kind byte 1); False: kind byte 2 and
        no models, the decoder is given them (e.g. one table shared by many tensors).
      lane_tails: optional [nb] ints 0..65535 stored in the lanes' initial states (nearly
        free: the output grows by at most one bit per lane, i.e. now and then a word);
        `decode` with ``lane_tails=True`` returns them.
      compact_models: store the models in the kind-3 layout (`encode_compact_models`,
        kind byte 3; models fitted here with ``fit_models(..., compact=True)``) instead
        of 4 bits per symbol (kind 1); with ``inline_models=False`` it only changes
        the fit.

    Returns:
      bytes.

    Raises:
      RansError: shapes, widths or symbols that do not fit, or a symbol its model lacks.
    """
    return encode_many([(symbols, alphabet_bits, n, models, lane_tails)], prob_bits, inline_models,
                       compact_models=compact_models, lane_tails=lane_tails is not None)[0]


def _prepare(symbols, alphabet_bits, n, models, prob_bits, inline_models, lane_tails, compact_models, what):
    """Check one buffer's inputs and fit its models -> (s [S, nb, 256], bits, counts, models, tails)."""
    bits, counts, single = _shapes(alphabet_bits, n)
    if not (compact_models and inline_models) and int(bits.max(initial=0)) > NARROW_WIDTH:
        raise RansError(f"{what}alphabet width {int(bits.max())} needs the compact inline models (kind "
                        f"{KIND_COMPACT_WIDE}); pass compact_models=True, inline_models=True, or widths <= {NARROW_WIDTH}")
    s, _ = _blocked(symbols, bits, counts, single)
    models = fit_models(s if not single else s[0], bits if not single else bits[0], n, prob_bits,
                        compact=compact_models) if models is None else models
    S, nb = bits.shape
    if len(models) != S:
        raise RansError(f"{what}{len(models)} model sets for {S} streams")
    for st in range(S):
        for w in np.unique(bits[st][counts > 0]).tolist():
            if w not in models[st]:
                raise RansError(f"{what}stream {st} has no model for width {w}")
    tails = None
    if lane_tails is not None:
        tails = np.asarray(lane_tails).astype(np.int64).reshape(-1)
        if tails.shape != (nb,) or (tails < 0).any() or (tails >= STATE_LOW).any():
            raise RansError(f"{what}lane_tails must be {nb} ints in 0..65535 (got shape {np.shape(lane_tails)})")
    return s, bits, counts, models, tails


def encode_many(items, prob_bits=None, inline_models=True, compact_models=False, lane_tails=False):
    """Several buffers (e.g. every tensor of a slab) encoded in ONE lane loop: each buffer's
    bytes are exactly `encode`'s for it (the lanes are independent; each buffer keeps its
    own models and words), in 256 x S numpy steps over all lanes instead of per buffer.

    Args:
      items: sequence of ``(symbols, alphabet_bits, n)``, ``(..., models)`` or
        ``(..., models, lane_tails)``, all with the same number of streams; as for `encode`
        (models None: fitted per buffer).
      prob_bits, inline_models, compact_models: as for `encode`, for every buffer.
      lane_tails: True if every item carries its lane tails (item[4]), else none does.

    Returns:
      list of bytes, one per item.

    Raises:
      RansError: as `encode` (``what[k]:`` names the k-th buffer when there are several),
        or a different number of streams.
    """
    items = list(items)
    parts = []
    for k, it in enumerate(items):
        tails = it[4] if len(it) > 4 else None
        if lane_tails and tails is None:
            raise RansError(f"item {k} has no lane tails; pass them for every item or for none")
        parts.append(_prepare(it[0], it[1], it[2], it[3] if len(it) > 3 else None, prob_bits, inline_models,
                              tails if lane_tails else None, compact_models, f"rans[{k}]: " if len(items) > 1 else ""))
    if not parts:
        return []
    S = parts[0][1].shape[0]
    if any(p[1].shape[0] != S for p in parts):
        raise RansError("the buffers code different numbers of streams; encode them in separate calls")
    nbs = [p[1].shape[1] for p in parts]
    G = len(parts)
    group = np.repeat(np.arange(G), nbs)
    counts = np.concatenate([p[2] for p in parts])
    tabs = []
    for st in range(S):                # per stream, one symbol table over every buffer's models
        ts = [_lane_tables([p[3][st]], p[1][st:st + 1], slots=False)[0] for p in parts]
        sb = np.cumsum([0] + [t["freq"].size for t in ts[:-1]]).astype(np.uint64)
        base = np.concatenate([t["sym_base"] + sb[g] for g, t in enumerate(ts)])
        # a last entry (frequency 1) for the positions past n, which are never coded
        freq = np.concatenate([t["freq"] for t in ts] + [np.ones(1, np.uint64)])
        start = np.concatenate([t["start"] for t in ts] + [np.zeros(1, np.uint64)])
        p = np.concatenate([t["p"] for t in ts])
        sym = np.concatenate([p_[0][st] for p_ in parts]).astype(np.uint64)     # [NL, 256]
        coded = np.arange(BLOCK)[None] < counts[:, None]
        idx = np.where(coded, base[:, None] + sym, np.uint64(freq.size - 1))
        zero = freq[idx] == 0
        if zero.any():
            g = int(group[np.nonzero(zero)[0][0]])
            raise RansError(f"{'rans[%d]: ' % g if G > 1 else ''}stream {st}: a symbol has frequency 0 in its "
                            f"model (fit the models on these symbols)")
        idx = np.ascontiguousarray(idx.T)                                          # [256, NL], position-major
        # per coded symbol: its frequency, start and renormalization limit (f << (32 - P)) - 1,
        # all in uint32: a state stays below 2**32 and (x // f) << P + x % f + c does too
        f = freq[idx]
        tabs.append((f.astype(np.uint32), start[idx].astype(np.uint32),
                     ((f << (np.uint64(32) - p)[None]) - np.uint64(1)).astype(np.uint32), p.astype(np.uint32)))
    x = np.full(counts.size, STATE_LOW, np.uint32)
    if lane_tails:
        x += np.concatenate([p[4] for p in parts]).astype(np.uint32)
    lanes, vals = [], []
    cmin, cmax = (int(counts.min()), int(counts.max())) if counts.size else (0, 0)
    low16, sh16 = np.uint32(0xFFFF), np.uint32(16)
    for i in range(cmax - 1, -1, -1):
        act = None if i < cmin else np.flatnonzero(counts > i)   # a partial last block codes fewer
        xs = x if act is None else x[act]
        for st in range(S - 1, -1, -1):
            f, c, lim, p = tabs[st]
            f, c, lim = f[i], c[i], lim[i]
            if act is not None:
                f, c, lim, p = f[act], c[act], lim[act], p[act]
            em = np.flatnonzero(xs > lim)
            lanes.append(em if act is None else act[em])
            vals.append(xs[em] & low16)
            xs[em] >>= sh16
            q, r = np.divmod(xs, f)
            xs = (q << p) + r + c
        if act is None:
            x = xs
        else:
            x[act] = xs
    # the words in decoding order: position ascending, stream ascending, lanes ascending
    lanes.reverse()
    vals.reverse()
    lanes = np.concatenate(lanes) if lanes else np.zeros(0, np.int64)
    vals = np.concatenate(vals).astype("<u2") if vals else np.zeros(0, "<u2")
    if G > 1:
        order = np.argsort(group[lanes], kind="stable")
        vals = vals[order]
        wcount = np.bincount(group[lanes], minlength=G)
    else:
        wcount = np.array([vals.size])
    wend = np.cumsum(wcount)
    first = np.concatenate([[0], np.cumsum(nbs)])
    flag = TAILS_FLAG if lane_tails else 0
    out = []
    for g, (_, bits, _, models, _) in enumerate(parts):
        if not inline_models:
            head = bytes([KIND_EXTERNAL | flag])
        elif compact_models:
            kind = KIND_COMPACT_WIDE if int(bits.max(initial=0)) > NARROW_WIDTH else KIND_COMPACT
            head = bytes([kind | flag]) + encode_compact_models(models)
        else:
            head = bytes([KIND_INLINE | flag]) + encode_models(models)
        out.append(head + x[first[g]:first[g + 1]].astype("<u4").tobytes()
                   + vals[wend[g] - wcount[g]:wend[g]].tobytes())
    return out


def encoded_size(symbols, alphabet_bits, n, models=None, prob_bits=None, inline_models=True,
                 compact_models=False) -> int:
    """Exact bytes `encode` returns (it encodes: ~10 M symbols/s).

    Args:
      symbols, alphabet_bits, n, models, prob_bits, inline_models, compact_models: as `encode`.

    Returns:
      The length in bytes of ``encode(...)``'s buffer.

    Raises:
      RansError: as `encode`.
    """
    return len(encode(symbols, alphabet_bits, n, models, prob_bits, inline_models, compact_models=compact_models))


def symbol_cost_bits(models):
    """Per stream, width -> [2**width] float64 bits a symbol costs under its model (inf if
    absent): the width chooser's price of a block is the sum over its symbols, plus the
    32 bits of the lane state (shared by the streams of the block).

    Args:
      models: from `fit_models`.

    Returns:
      list (per stream) of dict width -> cost array.
    """
    out = []
    for mods in models:
        d = {}
        for w, (p, lv) in mods.items():
            f = model_freqs(lv, p).astype(np.float64)
            with np.errstate(divide="ignore"):
                d[w] = np.where(f > 0, p - np.log2(np.maximum(f, 1)), np.inf)
        out.append(d)
    return out


# ---------------------------------------------------------------- decode
def decode_models(buf, streams, pos=0, what="rans"):
    """Model bytes (from `encode_models`) -> (models, end offset).

    Args:
      buf: bytes.
      streams: S, the number of streams.
      pos: offset of the model part in buf.
      what: name used in error messages.

    Returns:
      (list per stream of dict width -> (P, levels), offset just past the models).

    Raises:
      RansError: truncated, a bad model byte (width 0..8 ascending and distinct, P
        max(1, width)..15), or levels past the alphabet.
    """
    buf = bytes(buf)
    models = []
    for st in range(streams):
        if pos >= len(buf):
            raise RansError(f"{what}: truncated before the models of stream {st}")
        k = buf[pos]
        pos += 1
        if k > NARROW_WIDTH + 1:
            raise RansError(f"{what}: stream {st} declares {k} models; at most {NARROW_WIDTH + 1} widths exist")
        mods = {}
        for _ in range(k):
            if pos >= len(buf):
                raise RansError(f"{what}: truncated inside the models of stream {st}")
            w, p = buf[pos] >> 4, buf[pos] & 15
            if w > NARROW_WIDTH or not max(1, w) <= p <= MAX_PROB_BITS or (mods and w <= max(mods)):
                raise RansError(f"{what}: stream {st} model byte {buf[pos]:#04x}: width must be 0..{NARROW_WIDTH}, "
                                f"ascending and distinct, P max(1, width)..{MAX_PROB_BITS}")
            nbytes = -(-(1 << w) // 2)
            if pos + 1 + nbytes > len(buf):
                raise RansError(f"{what}: truncated inside the levels of stream {st} width {w}")
            nib = np.frombuffer(buf, np.uint8, nbytes, pos + 1)
            lv = np.stack([nib & 15, nib >> 4], axis=1).reshape(-1).astype(np.int64)
            if (lv[1 << w:] != 0).any():
                raise RansError(f"{what}: stream {st} width {w} has a level on a symbol past 2**{w}")
            lv = lv[:1 << w]
            if not lv.any():
                raise RansError(f"{what}: stream {st} width {w} model has no symbol")
            mods[w] = (p, lv)
            pos += 1 + nbytes
        models.append(mods)
    return models, pos


def _parse(buf, alphabet_bits, n, models, what, lane_tails):
    """Check one buffer's head and sizes -> (bits [S, nb], counts, single, models, states, words)."""
    bits, counts, single = _shapes(alphabet_bits, n)
    S, nb = bits.shape
    b = np.frombuffer(buf, np.uint8) if not isinstance(buf, np.ndarray) else np.asarray(buf, np.uint8).reshape(-1)
    kind = int(b[0]) if b.size else None
    if kind is not None and bool(kind & TAILS_FLAG) != bool(lane_tails):
        raise RansError(f"{what}: the buffer {'carries' if kind & TAILS_FLAG else 'has no'} lane tails; "
                        f"pass lane_tails={not lane_tails}")
    kind = kind & ~TAILS_FLAG if kind is not None else None
    if kind == KIND_INLINE:
        if models is not None:
            raise RansError(f"{what}: the buffer carries its models; do not pass models")
        head = b[:1 + S * (1 + (NARROW_WIDTH + 1) * (1 + (1 << NARROW_WIDTH) // 2))].tobytes()
        models, pos = decode_models(head, S, 1, what)
    elif kind in (KIND_COMPACT, KIND_COMPACT_WIDE):
        if models is not None:
            raise RansError(f"{what}: the buffer carries its models; do not pass models")
        mw = kind_max_width(kind)
        models, pos = decode_compact_models(b[:1 + compact_models_bound(S, mw)].tobytes(), S, 1, what, mw)
    elif kind == KIND_EXTERNAL:
        if models is None:
            raise RansError(f"{what}: the buffer was written without models; pass the shared models")
        models = decode_models(encode_models(models), S, 0, what)[0]     # the same checks as stored ones
        pos = 1
    else:
        raise RansError(f"{what}: kind byte {kind} is not {KIND_INLINE}, {KIND_EXTERNAL}, {KIND_COMPACT} or "
                        f"{KIND_COMPACT_WIDE} (empty, not an rANS buffer, or written by a newer jaxguard)")
    if bits.size and int(bits.max()) > kind_max_width(kind):
        raise RansError(f"{what}: kind {kind} buffers code alphabets of at most {kind_max_width(kind)} bits, "
                        f"but a block is {int(bits.max())} bits wide")
    for st in range(S):
        missing = sorted(set(np.unique(bits[st][counts > 0]).tolist()) - set(models[st]))
        if missing:
            raise RansError(f"{what}: stream {st} has no model for width {missing[0]}, which a block uses")
    if b.size < pos + 4 * nb or (b.size - pos - 4 * nb) % 2:
        raise RansError(f"{what}: {b.size - pos} bytes after the models cannot hold {nb} lane states and whole "
                        f"16-bit words")
    x = b[pos:pos + 4 * nb].view("<u4").astype(np.uint32)
    words = b[pos + 4 * nb:].view("<u2").astype(np.uint32)
    if (x < STATE_LOW).any():
        raise RansError(f"{what}: lane {int(np.flatnonzero(x < STATE_LOW)[0])} starts in state below 2**16")
    if words.size > S * int(counts.sum()):
        raise RansError(f"{what}: {words.size} words for {S * int(counts.sum())} symbols (at most one each)")
    return bits, counts, single, models, x, words


def _table_slots(part):
    """Slots of one parsed buffer's decode tables, the largest stream's (`_lane_tables`)."""
    return max((sum(1 << p for p, _ in mods.values()) for mods in part[3]), default=0)


def _decode_lanes(parts, names):
    """The lane loop over one or more parsed buffers (their lanes side by side; `names`:
    each one's name in errors): 256 x S steps of numpy operations across every lane; each
    buffer reads its own words.  States and table entries are uint32: ``f * (x >> P) +
    slot - c < 2**32`` for any state below 2**32, and a refill shifts a state below 2**16."""
    S = parts[0][0].shape[0]
    nbs = [p[0].shape[1] for p in parts]
    G = len(parts)
    group = np.repeat(np.arange(G), nbs)
    counts = np.concatenate([p[1] for p in parts])
    x = np.concatenate([p[4] for p in parts]).astype(np.uint32)
    words = (np.concatenate([p[5] for p in parts]) if G > 1 else parts[0][5]).astype(np.uint32)
    wend = np.cumsum([p[5].size for p in parts])
    ptr = np.concatenate([[0], wend[:-1]]).astype(np.int64)     # next word of each buffer
    first = np.concatenate([[0], np.cumsum(nbs)[:-1]]).astype(np.int64)
    bounds = np.concatenate([first, [x.size]])                  # lane range of each buffer
    tabs = []
    sym_dtype = np.uint16 if max(int(p[0].max(initial=0)) for p in parts) > NARROW_WIDTH else np.uint8
    lane_tabs = [_lane_tables(p[3], p[0]) for p in parts]
    for st in range(S):                # one table per stream over all buffers' models
        ts = [t[st] for t in lane_tabs]
        lb = np.cumsum([0] + [t["slot_sym"].size for t in ts[:-1]]).astype(np.uint64)
        slot_base = np.concatenate([t["slot_base"] + lb[g] for g, t in enumerate(ts)])
        p = np.concatenate([t["p"] for t in ts])
        mask = (np.uint64(1) << p) - np.uint64(1)
        idle = counts == 0             # an empty tensor's lane (no model): point it at slot 0
        slot_base[idle], mask[idle] = 0, 0
        # frequency (<= 2**15) and slot - start (< 2**15) of a slot in one uint32: one gather
        fb = np.concatenate([t["slot_freq"] | (t["slot_bias"] << np.uint32(16)) for t in ts])
        tabs.append((np.concatenate([t["slot_sym"] for t in ts]).astype(sym_dtype), fb,
                     slot_base.astype(np.int64), mask.astype(np.uint32), p.astype(np.uint32)))
    nl_all = x.size
    out = np.zeros((S, BLOCK, nl_all), sym_dtype)             # position-major: row writes
    low, sh16, low_mask = np.uint32(STATE_LOW), np.uint32(16), np.uint32(0xFFFF)
    cmin, cmax = (int(counts.min()), int(counts.max())) if nl_all else (0, 0)
    for i in range(cmax):
        act = None if i < cmin else counts > i      # a partial last block stops early: keep its state
        for st in range(S):
            sym, fb, slot_base, mask, p = tabs[st]
            si = slot_base + (x & mask)
            out[st, i] = sym[si]
            f = fb[si]
            xn = (f & low_mask) * (x >> p) + (f >> sh16)
            x = xn if act is None else np.where(act, xn, x)    # an idle lane stays >= L: reads nothing
            k = np.flatnonzero(x < low)
            if G == 1:
                pos = ptr[0] + np.arange(k.size)
                ptr[0] += k.size
                over = pos >= wend[0]
            else:                      # rank of each needing lane within its buffer
                cut = np.searchsorted(k, bounds)
                gk = group[k]
                pos = np.arange(k.size) + (ptr - cut[:-1])[gk]
                ptr += np.diff(cut)
                over = pos >= wend[gk]
            if over.any():
                bad = int(group[k[np.flatnonzero(over)[0]]])
                raise RansError(f"{names[bad]}: the words end at position {i} of stream {st} (truncated buffer)")
            x[k] = (x[k] << sh16) | words[pos]
    out = np.ascontiguousarray(out.transpose(0, 2, 1))     # [S, lanes, 256], as returned
    if cmin < BLOCK:
        out[:, np.arange(BLOCK)[None] >= counts[:, None]] = 0
    return out, x, ptr, wend, first


def _finish(parts, out, x, ptr, wend, first, names, lane_tails):
    res = []
    for g, (bits, counts, single, _, _, words) in enumerate(parts):
        name = names[g]
        if ptr[g] != wend[g]:
            raise RansError(f"{name}: {int(wend[g] - ptr[g])} of {words.size} words left over after decoding")
        nb = bits.shape[1]
        xg = x[first[g]:first[g] + nb]
        end_bad = (xg >> np.uint32(16)) != 1 if lane_tails else xg != STATE_LOW
        if end_bad.any():
            raise RansError(f"{name}: lane {int(np.flatnonzero(end_bad)[0])} does not end in the initial state "
                            f"(corrupt words or states)")
        sym = out[:, first[g]:first[g] + nb]
        sym = sym[0] if single else sym
        res.append((sym, (xg - np.uint32(STATE_LOW)).astype(np.uint16)) if lane_tails else sym)
    return res


def decode(buf, alphabet_bits, n, models=None, what="rans", lane_tails=False):
    """One rANS buffer -> the blocked symbols `encode` was given (exactly).

    Args:
      buf: bytes-like (or uint8 array).
      alphabet_bits: [nb] (or [streams, nb]) widths, as passed to `encode` (stored
        elsewhere: the buffer does not repeat them).
      n: symbols per stream.
      models: required for a buffer written with ``inline_models=False`` (refused otherwise).
      what: name used in error messages (e.g. ``"layer.m_codes"``).
      lane_tails: True for a buffer written with ``lane_tails`` (refused otherwise).

    Returns:
      [nb, 256] (or [streams, nb, 256]) uint8 symbols (uint16 if a block is wider than 8
      bits); positions past n are 0.  With
      ``lane_tails=True``: (symbols, tails [nb] uint16).

    Raises:
      RansError: any malformed buffer (see the numerical contract), or bad widths / n.
    """
    parts = [_parse(buf, alphabet_bits, n, models, what, lane_tails)]
    return _finish(parts, *_decode_lanes(parts, [what]), [what], lane_tails)[0]


def decode_many(items, what="rans", lane_tails=False):
    """Several buffers (e.g. every tensor of a container) decoded in few lane loops: 256 x S
    numpy steps per batch of buffers whose decode tables fit `BATCH_SLOTS`, instead of per
    buffer, which is what makes small tensors cheap (and the batches bound the tables).

    Args:
      items: sequence of (buf, alphabet_bits, n) or (buf, alphabet_bits, n, models), all
        with the same number of streams; models as in `decode`.
      what: name used in error messages (``what[k]`` names the k-th buffer).
      lane_tails: as in `decode`, for every buffer.

    Returns:
      list of what `decode` returns for each item.

    Raises:
      RansError: as `decode`, naming the buffer; or a different number of streams.
    """
    parts = []
    for k, it in enumerate(items):
        buf, ab, n = it[:3]
        parts.append(_parse(buf, ab, n, it[3] if len(it) > 3 else None, f"{what}[{k}]", lane_tails))
    if not parts:
        return []
    if len({p[0].shape[0] for p in parts}) > 1:
        raise RansError(f"{what}: the buffers code different numbers of streams; decode them in separate calls")
    batches, slots = [[]], 0
    for k, part in enumerate(parts):    # at most BATCH_SLOTS table slots a batch (a bigger buffer alone)
        size = _table_slots(part)
        if batches[-1] and slots + size > BATCH_SLOTS:
            batches.append([])
            slots = 0
        batches[-1].append(k)
        slots += size
    res = []
    for batch in batches:
        sub, names = [parts[k] for k in batch], [f"{what}[{k}]" for k in batch]
        res += _finish(sub, *_decode_lanes(sub, names), names, lane_tails)
    return res
