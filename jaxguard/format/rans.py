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
sharing halves the per-lane state cost (4 bytes per lane, not per stream).
`decode_streams_many` runs the same loop over the lanes of many buffers at once (every
tensor of a container), and `encode_streams_many` likewise encodes many buffers in one
loop, each to the bytes `encode_streams` gives it.

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
Integer arithmetic only (uint32 / uint64 numpy, no floats on the decode path): ``decode_streams(encode(s))``
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
another valid message (tests/format/test_rans.py), which the container's hashes refuse;
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
           "encode_streams", "encode_streams_many", "encoded_size", "symbol_cost_bits", "decode_models", "decode_streams",
           "decode_streams_many"]

import numpy as np

from jaxguard.format.rans_fit import fit_compact_model, fit_models
from jaxguard.format.rans_format import (BLOCK, KIND_COMPACT, KIND_COMPACT_WIDE, MAX_PROB_BITS, MAX_WIDTH, NARROW_WIDTH,
                                         PROB_BITS, STATE_LOW, TAILS_FLAG, RansError, blocked_symbols, stream_shapes,
                                         kind_max_width)
from jaxguard.format.rans_models import (COMPACT_RAW, LEVEL_WEIGHTS, lane_tables, slot_table, compact_model_bits,
                                         compact_models_bound, decode_compact_models, decode_models,
                                         encode_compact_models, encode_models, model_freqs, quantize_levels,
                                         symbol_cost_bits)

KIND_INLINE, KIND_EXTERNAL = 1, 2   # first byte: models in the buffer, or given to the decoder
# `decode_streams_many` runs one lane loop per batch of buffers whose decode tables (2**P slots a
# model and stream, 8-byte entries) sum to at most this: a container of many tensors with
# 2**15-slot models built 2.7 GB of tables at once (16.5M coordinates, 760 tensors).
BATCH_SLOTS = 1 << 22


# ---------------------------------------------------------------- encode
def encode_streams(symbols, alphabet_bits, n, models=None, prob_bits=None, inline_models=True, lane_tails=None,
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
        `decode_streams` with ``lane_tails=True`` returns them.
      compact_models: store the models in the kind-3 layout (`encode_compact_models`,
        kind byte 3; models fitted here with ``fit_models(..., compact=True)``) instead
        of 4 bits per symbol (kind 1); with ``inline_models=False`` it only changes
        the fit.

    Returns:
      bytes.

    Raises:
      RansError: shapes, widths or symbols that do not fit, or a symbol its model lacks.
    """
    return encode_streams_many([(symbols, alphabet_bits, n, models, lane_tails)], prob_bits, inline_models,
                       compact_models=compact_models, lane_tails=lane_tails is not None)[0]


def _prepare(symbols, alphabet_bits, n, models, prob_bits, inline_models, lane_tails, compact_models, what):
    """Check one buffer's inputs and fit its models -> (s [S, nb, 256], bits, counts, models, tails)."""
    bits, counts, single = stream_shapes(alphabet_bits, n)
    if not (compact_models and inline_models) and int(bits.max(initial=0)) > NARROW_WIDTH:
        raise RansError(f"{what}alphabet width {int(bits.max())} needs the compact inline models (kind "
                        f"{KIND_COMPACT_WIDE}); pass compact_models=True, inline_models=True, or widths <= {NARROW_WIDTH}")
    s, _ = blocked_symbols(symbols, bits, counts, single)
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


def encode_streams_many(items, prob_bits=None, inline_models=True, compact_models=False, lane_tails=False):
    """Several buffers (e.g. every tensor of a slab) encoded in ONE lane loop: each buffer's
    bytes are exactly `encode_streams`'s for it (the lanes are independent; each buffer keeps its
    own models and words), in 256 x S numpy steps over all lanes instead of per buffer.

    Args:
      items: sequence of ``(symbols, alphabet_bits, n)``, ``(..., models)`` or
        ``(..., models, lane_tails)``, all with the same number of streams; as for `encode_streams`
        (models None: fitted per buffer).
      prob_bits, inline_models, compact_models: as for `encode_streams`, for every buffer.
      lane_tails: True if every item carries its lane tails (item[4]), else none does.

    Returns:
      list of bytes, one per item.

    Raises:
      RansError: as `encode_streams` (``what[k]:`` names the k-th buffer when there are several),
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
        ts = [lane_tables([p[3][st]], p[1][st:st + 1])[0] for p in parts]
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
    """Exact bytes `encode_streams` returns (it encodes: ~10 M symbols/s).

    Args:
      symbols, alphabet_bits, n, models, prob_bits, inline_models, compact_models: as `encode_streams`.

    Returns:
      The length in bytes of ``encode_streams(...)``'s buffer.

    Raises:
      RansError: as `encode_streams`.
    """
    return len(encode_streams(symbols, alphabet_bits, n, models, prob_bits, inline_models, compact_models=compact_models))


def _parse(buf, alphabet_bits, n, models, what, lane_tails):
    """Check one buffer's head and sizes -> (bits [S, nb], counts, single, models, states, words)."""
    bits, counts, single = stream_shapes(alphabet_bits, n)
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
    words = b[pos + 4 * nb:].view("<u2").astype(np.uint16)
    if (x < STATE_LOW).any():
        raise RansError(f"{what}: lane {int(np.flatnonzero(x < STATE_LOW)[0])} starts in state below 2**16")
    if words.size > S * int(counts.sum()):
        raise RansError(f"{what}: {words.size} words for {S * int(counts.sum())} symbols (at most one each)")
    return bits, counts, single, models, x, words


def _table_slots(part):
    """Slots of one parsed buffer's decode tables, the largest stream's (`slot_table`)."""
    return max((sum(1 << p for p, _ in mods.values()) for mods in part[3]), default=0)


def _decode_lanes(parts, names):
    """The lane loop over one or more parsed buffers (their lanes side by side; `names`:
    each one's name in errors): 256 x S steps of numpy operations across every lane; each
    buffer reads its own words.  States are uint32: ``f * (x >> P) + slot - c < 2**32`` for
    any state below 2**32, and a refill shifts a state below 2**16; a slot's table entry is
    one uint64 (symbol << 32 | (slot - c) << 16 | f), so a step gathers once per stream."""
    S = parts[0][0].shape[0]
    nbs = [p[0].shape[1] for p in parts]
    G = len(parts)
    group = np.repeat(np.arange(G), nbs)
    counts = np.concatenate([p[1] for p in parts])
    x = np.concatenate([p[4] for p in parts]).astype(np.uint32)
    words = np.concatenate([p[5] for p in parts]) if G > 1 else parts[0][5]
    wend = np.cumsum([p[5].size for p in parts])
    ptr = np.concatenate([[0], wend[:-1]]).astype(np.int64)     # next word of each buffer
    first = np.concatenate([[0], np.cumsum(nbs)[:-1]]).astype(np.int64)
    bounds = np.concatenate([first, [x.size]])                  # lane range of each buffer
    sym_dtype = np.uint16 if max(int(p[0].max(initial=0)) for p in parts) > NARROW_WIDTH else np.uint8
    tabs = [slot_table([p[3][st] for p in parts], [p[0][st] for p in parts], counts) for st in range(S)]
    nl_all = x.size
    out = np.zeros((S, BLOCK, nl_all), sym_dtype)             # position-major: row writes
    low, sh16, low_mask, sh32 = np.uint32(STATE_LOW), np.uint32(16), np.uint32(0xFFFF), np.uint64(32)
    cmin, cmax = (int(counts.min()), int(counts.max())) if nl_all else (0, 0)
    for i in range(cmax):
        act = None if i < cmin else counts > i      # a partial last block stops early: keep its state
        for st in range(S):
            entry, slot_base, mask, p = tabs[st]
            e = entry[slot_base + (x & mask)]
            out[st, i] = e >> sh32
            f = e.astype(np.uint32)
            xn = (f & low_mask) * (x >> p) + (f >> sh16)
            x = xn if act is None else np.where(act, xn, x)    # an idle lane stays >= L: reads nothing
            k = np.flatnonzero(x < low)
            if G == 1:
                pos = ptr[0] + np.arange(k.size)
                ptr[0] += k.size
                short = ptr[:1] > wend[:1]
            else:                      # rank of each needing lane within its buffer
                cut = np.searchsorted(k, bounds)
                pos = np.arange(k.size) + (ptr - cut[:-1])[group[k]]
                ptr += np.diff(cut)
                short = ptr > wend
            if short.any():            # checked before any word is read past its buffer's end
                bad = int(np.flatnonzero(short)[0])
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


def decode_streams(buf, alphabet_bits, n, models=None, what="rans", lane_tails=False):
    """One rANS buffer -> the blocked symbols `encode_streams` was given (exactly).

    Args:
      buf: bytes-like (or uint8 array).
      alphabet_bits: [nb] (or [streams, nb]) widths, as passed to `encode_streams` (stored
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


def decode_streams_many(items, what="rans", lane_tails=False):
    """Several buffers (e.g. every tensor of a container) decoded in few lane loops: 256 x S
    numpy steps per batch of buffers whose decode tables fit `BATCH_SLOTS`, instead of per
    buffer, which is what makes small tensors cheap (and the batches bound the tables).

    Args:
      items: sequence of (buf, alphabet_bits, n) or (buf, alphabet_bits, n, models), all
        with the same number of streams; models as in `decode_streams`.
      what: name used in error messages (``what[k]`` names the k-th buffer).
      lane_tails: as in `decode_streams`, for every buffer.

    Returns:
      list of what `decode_streams` returns for each item.

    Raises:
      RansError: as `decode_streams`, naming the buffer; or a different number of streams.
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
