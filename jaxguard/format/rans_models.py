"""The models of an rANS buffer (`jaxguard.format.rans`): 4-bit levels and the frequencies
they give, their kind-1 byte layout and kind-3/4 compact bit layout, each encoded and
decoded, and the decoder's lane tables.  Numpy only.

Numerical contract
------------------
Integer arithmetic only: frequencies, levels and tables are built from the stored bits
with integer operations, so every reader rebuilds the encoder's tables exactly; the cost
estimates (`symbol_cost_bits`) are float64 and only choose between models.
"""
from __future__ import annotations

__all__ = ["LEVEL_WEIGHTS", "model_freqs", "quantize_levels", "encode_models", "decode_models", "symbol_cost_bits",
           "COMPACT_RAW", "compact_model_bits", "encode_compact_models", "compact_models_bound",
           "decode_compact_models", "LEVEL_WEIGHT_ARRAY", "coded_bits", "lane_tables", "slot_table", "exp_golomb_bits"]

import numpy as np

from jaxguard.format.rans_format import MAX_PROB_BITS, MAX_WIDTH, NARROW_WIDTH, RansError


# ---------------------------------------------------------------- models
# A model is (P, levels): levels[symbol] in 0..15 (0 = absent), stored as 4-bit nibbles; the
# frequencies follow from them by `model_freqs` (integers only), so the table of a width-w
# model is ceil(2**w / 2) bytes whatever P is.  Level k > 0 weighs round(2**(0.75*(k-1))):
# steps of 2**0.75 cost ~0.02 bits per symbol against exact frequencies (measured:
# bench/experiments/results/entropy_probe.md), over a 2**10.5 range.
LEVEL_WEIGHTS = (0, 1, 2, 3, 5, 8, 13, 23, 38, 64, 108, 181, 304, 512, 861, 1448)


LEVEL_WEIGHT_ARRAY = np.array(LEVEL_WEIGHTS, np.int64)   # LEVEL_WEIGHTS indexable by a level array


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
    w = LEVEL_WEIGHT_ARRAY[lv]
    f = np.where(lv > 0, 1 + w * (M - k) // int(w.sum()), 0)
    f[int(np.argmax(lv))] += M - int(f.sum())
    return f


def coded_bits(hist, freqs, prob_bits):
    """Bits the coder spends on symbols of these counts under these frequencies (float64;
    it only chooses between models).

    Args:
      hist: [A] symbol counts.
      freqs: [A] frequencies summing to 2**prob_bits (> 0 where hist is).
      prob_bits: P.

    Returns:
      float: sum over present symbols of count * (P - log2 freq).
    """
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


def lane_tables(models, bits):
    """The encoder's flat per-stream tables of one buffer's models.

    Args:
      models: per stream, a dict width -> (P, levels).
      bits: [S, nb] widths of the lanes.

    Returns:
      per stream a dict of uint64 arrays: ``freq``, ``start`` by (model base + symbol),
      per lane ``sym_base`` and ``p``.
    """
    tabs = []
    for st, mods in enumerate(models):
        freq, start, sym_base, pb = [], [], {}, {}
        nsym = 0
        for w in sorted(mods):
            p, lv = mods[w]
            f = model_freqs(lv, p)
            sym_base[w], pb[w] = nsym, p
            freq.append(f)
            start.append(np.concatenate([[0], np.cumsum(f)[:-1]]))
            nsym += f.size
        cat = (lambda a: np.concatenate(a).astype(np.uint64, copy=False)) if freq else (lambda a: np.zeros(0, np.uint64))
        tabs.append({"freq": cat(freq), "start": cat(start), "sym_base": _per_lane(sym_base, bits[st]),
                     "p": _per_lane(pb, bits[st])})
    return tabs


def _per_lane(by_width, b):
    """A per-width value -> the per-lane uint64 array (0 for a width without a model)."""
    b = np.asarray(b, np.int64)
    lut = np.zeros(max(int(b.max(initial=0)), max(by_width, default=0)) + 1, np.uint64)
    lut[list(by_width)] = list(by_width.values())
    return lut[b]


def slot_table(models, bits, counts):
    """One stream's decoder table over the lanes of several buffers side by side.

    Args:
      models: per buffer, the stream's dict width -> (P, levels).
      bits: per buffer, the stream's [nb] lane widths.
      counts: [total lanes] symbols each lane codes (a lane coding none reads slot 0).

    Returns:
      ``(entry, slot_base, mask, p)``: ``entry`` uint64 by (model base + slot), one a slot
      of every model: ``symbol << 32 | (slot - start) << 16 | frequency`` (symbol < 2**12,
      slot - start < 2**15, frequency <= 2**15); per lane its model's base (int64), its
      ``2**P - 1`` and P (uint32).
    """
    base_vals, freqs, lane_base, lane_p = [], [], [], []
    nslot = 0
    for mods, b in zip(models, bits):
        slot_base, pb = {}, {}
        for w in sorted(mods):
            p, lv = mods[w]
            f = model_freqs(lv, p)
            slot_base[w], pb[w] = nslot, p
            # entry of slot t (this model's global slot) of symbol s: (s << 32) + f_s + (t - start_s) << 16,
            # i.e. a per-symbol value repeated over its slots plus t << 16
            first = nslot + np.cumsum(f) - f
            base_vals.append((np.arange(f.size, dtype=np.int64) << 32) + f - (first << 16))
            freqs.append(f)
            nslot += 1 << p
        lane_base.append(_per_lane(slot_base, b))
        lane_p.append(_per_lane(pb, b))
    entry = np.arange(nslot, dtype=np.int64)
    entry <<= 16
    if base_vals:
        entry += np.repeat(np.concatenate(base_vals), np.concatenate(freqs))
    slot_base = np.concatenate(lane_base).astype(np.int64)
    p = np.concatenate(lane_p).astype(np.uint32)
    mask = (np.uint32(1) << p) - np.uint32(1)
    idle = np.asarray(counts) == 0
    slot_base[idle], mask[idle] = 0, 0
    return entry.view(np.uint64), slot_base, mask, p


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


def exp_golomb_bits(delta):
    """Bits of each signed delta's Exp-Golomb-0 code of its zigzag (0, -1, 1, -2, ...).

    Args:
      delta: int array of level deltas.

    Returns:
      int64 array of code lengths, same shape.
    """
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
            bits = head + 4 + int(exp_golomb_bits(np.diff(kl)).sum())
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
