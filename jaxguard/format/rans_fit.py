"""Fitting the models of an rANS buffer (`jaxguard.format.rans`): per stream and width, the
levels and total ``2**P`` of fewest coded bits, kind 1 or compact (kind 3/4).  Numpy only.

A compact model's total is the smallest ``2**P`` whose coded bits are within
`P_SLACK_BITS` plus `P_SLACK_PER_SYMBOL` per coded symbol of the fewest (`choose_prob_bits`):
the decoder builds a table of ``2**P`` slots per model, and past a model's best few bits a
larger P buys almost nothing while its table can outgrow the symbols it decodes (a 2**15-slot
table for a tensor of a thousand coordinates).

Numerical contract
------------------
The fit only chooses a model; whatever it chooses, the coder is exact (integer
arithmetic).  The float64 scores are computed in a fixed order (below), so the same
inputs choose the same model, and so write the same bytes, on every platform.
"""
from __future__ import annotations

__all__ = ["fit_models", "fit_compact_model", "choose_prob_bits", "P_SLACK_BITS", "P_SLACK_PER_SYMBOL"]

import numpy as np

from jaxguard.format.rans_format import PROB_BITS, blocked_symbols, stream_shapes
from jaxguard.format.rans_models import LEVEL_WEIGHT_ARRAY, coded_bits, exp_golomb_bits, model_freqs, quantize_levels

P_SLACK_BITS = 64           # bits a compact model may spend over its fewest for a smaller P
P_SLACK_PER_SYMBOL = 3e-3   # and bits per symbol it codes (0.04% of an 8-bit code)


def choose_prob_bits(cost, symbols):
    """The P a compact model is written with: the smallest whose coded bits are within
    ``P_SLACK_BITS + P_SLACK_PER_SYMBOL * symbols`` of the fewest.

    Args:
      cost: dict P -> coded bits of the model's symbols at that P (float64, computed in a
        fixed order, so every platform chooses alike).
      symbols: how many symbols the model codes.

    Returns:
      int P.
    """
    limit = min(cost.values()) + P_SLACK_BITS + P_SLACK_PER_SYMBOL * float(symbols)
    return min(p for p, c in cost.items() if c <= limit)


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
    bits, counts, single = stream_shapes(alphabet_bits, n)
    s, coded = blocked_symbols(symbols, bits, counts, single)
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
                    cost = coded_bits(hist, model_freqs(lv, p), p)
                    if best is None or cost < best[0]:
                        best = (cost, p, lv)
            mods[w] = (best[1], best[2])
        models.append(mods)
    return models


def fit_compact_model(hist, width, cands):
    """(P, levels) for one histogram: the levels of fewest model + coded bits (kind 3), the exact levels
    (as kind 1 fits them), or smooth ones (knots every 2**j symbols on the window means,
    then single knots moved by one level, steepest first, while that pays).

    Args:
      hist: [2**width] counts, at least one > 0.
      width: the alphabet width.
      cands: the P to try (the largest scores the levels; `choose_prob_bits` picks P).

    Returns:
      (P, levels [2**width] int64).
    """
    with np.errstate(divide="ignore"):      # a frequency of 0 (more symbols than slots) costs inf bits
        return _fit_compact_levels(np.asarray(hist, np.int64), width, cands)


# `fit_compact_model` scores many candidate levels by model + coded bits, and the scores decide
# the bytes (a tie or a `<` between two floats picks the model), so each score is computed
# as the plain formulas of tests/format/test_rans.py's `_fit_compact_reference` compute it: the
# same float64 terms added in the same order (exact levels: one row at a time, pairwise, as
# `coded_bits`; knot candidates: term after term in symbol order, as numpy sums the
# Fortran-order rows ``f[:, mask]`` gives).  What candidates share (segments, per-level
# frequencies, the levels a knot move leaves alone) is computed once.
_EG_DELTA_BITS = exp_golomb_bits(np.arange(-15, 16))      # Exp-Golomb bits of a level delta, index delta + 15


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
    """`coded_bits` of each level row under `model_freqs` at its P (the same floats).

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
    w = LEVEL_WEIGHT_ARRAY[levels]
    f = np.where(levels > 0, 1 + w * (M - k)[:, None] // w.sum(1)[:, None], 0)
    f[np.arange(levels.shape[0]), np.argmax(levels, axis=1)] += M - f.sum(1)
    nz = hist > 0
    # C order: each row a pairwise sum, as `coded_bits` sums its one row
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
    return 1 + LEVEL_WEIGHT_ARRAY * (M - size) // (per_level @ LEVEL_WEIGHT_ARRAY)[:, None]


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
    return choose_prob_bits(cost, int(hist.sum())), lv
