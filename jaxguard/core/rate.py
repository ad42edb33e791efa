"""Rate-optimized code choice for ``logrel-ans``: the guard's slack spent on fewer coded bits.

The width search (`jaxguard.core.adaptive`) gives every coordinate the code nearest its
value on its block's grid.  The guard usually has slack left there: a neighbouring code
pair also keeps the first update within ``tau*lr``, and under the tensor's rANS models
one of them may cost fewer bits (codes near the mode of the distribution are cheaper).
This pass tries, for every coordinate, the pairs `MOVES` away from its codes (the block's
parameters stay, so only that coordinate's decoded ``(m~, v~)`` change), cheapest first,
and keeps the first pair the guard certifies that costs fewer bits than its own under its
tensor's symbol counts (per stream and width, as the writer fits its models); then it
recounts and repeats while a round saves at least `MIN_GAIN` of the coded bits (at most
`ROUNDS`).  The counts sharpen round by round, so the codes gather on fewer symbols where
the guard lets them (rate-distortion optimized quantization, with the certificate as the
only distortion measure).  Every coordinate is certified in full once; afterwards an
accepted pair is known to be certified.  A move is certified up to `MOVE_MAX_LEVEL`
only (by default the closed form and the adaptive tier: the fixed cell levels cost most and
decide few moves); a move that needs more is then not taken.  A coordinate that escapes takes any certified
pair; one that still escapes (stored exactly; the reader overwrites its decoded codes)
takes its stream's cheapest codes.

Numerical contract
------------------
Decoding is unchanged (logrel-aw's grid and formulas): the pass only chooses other codes
on the same grid.  Each accepted pair is certified by the same certificate as the width
search, and the caller certifies the assembled codes again from scratch
(`jaxguard.core.guard`); that last certificate alone decides which coordinates escape.
The pass can cost encode time, never the guarantee.  It moves codes towards the modes of
the models, so a restored moment is no longer the nearest grid value; it is still within
the certified distance (``|u~ - u| <= tau*lr`` for every ``|g| <= C``).
"""
from __future__ import annotations

import numpy as np

from jaxguard.format import packed, rans
from jaxguard.format.spec import BLOCK

# (dm, dv) code moves; each coordinate tries them cheapest first.  Measured (payload % of
# FP32: transformer 701 100%, CNN 701 10%, optax MLP 704 50% and 10%): no pass 20.61, 24.13,
# 23.88, 24.92; these 24 moves, up to 4 rounds, every move tried: 19.71, 22.15, 22.90, 22.84
# (the rate pass took 36 s of the 62 s); 3 rounds of the 8 cheapest: 19.98, 22.20, 23.22,
# 23.06; 2 rounds of the 4 cheapest: 20.35, 22.98, 23.65, 23.76.  v moves of +-4 or m moves
# of +-3 added nothing on the MLP (22.90 / 22.89).
MOVES = tuple((dm, dv) for dv in (0, -1, 1, -2, 2) for dm in (0, -1, 1, -2, 2) if (dm, dv) != (0, 0))
ROUNDS = 4
MIN_GAIN = 0.003       # stop when a round saves less than this fraction of the coded bits
ORDER_CHUNK = 1 << 16  # coordinates whose move order is sorted at once (bounds the temporaries)
UNSEEN_BITS = 3.0      # a symbol no coordinate uses yet costs this much more than one used once
# A candidate move is certified up to this refinement level (`jaxguard.core.bound.LEVELS`);
# one that needs more is rejected (always safe: the coordinate keeps a pair it has).
# -1: the closed form and the adaptive tier only (`certify.certify_pc`), no fixed level;
# None: every level.  Measured on a 137,216-coordinate transformer (t701, 2-core AMD EPYC,
# bench/results/logrel_ans_levels_s11.md): every level 11.20 s and 19.55% of FP32, -1 (with
# SEARCH_MAX_LEVEL -1) 3.58 s and 19.68%: the fixed levels decide few moves at most of the cost.
# The final certificate of the stored codes keeps every level and alone decides escapes.
MOVE_MAX_LEVEL = -1
# logrel-ans's width search (`jaxguard.core.adaptive.choose_and_certify`) stops at this level
# too, so its widths may differ from logrel-aw's (whose search keeps every level).
SEARCH_MAX_LEVEL = -1


def _cost_tables(qm, qv, bm, bv, tensors):
    """Per-coordinate cost lookup of both streams: each tensor's empirical symbol counts
    per width (the writer's fitted models follow them; costs from the counts, not from
    the smoothed models, are what lets the codes gather on fewer symbols round by round).

    Returns:
      (flat_m, base_m, flat_v, base_v, lm): ``cost_m(i, s) = flat_m[base_m[i // 256] + s]``
      for m symbol ``s = qm + lm`` (v likewise, symbol = qv); inf for symbols a model lacks.
    """
    nb = bm.size
    lm = (1 << (bm.astype(np.int64) - 1)) - 1
    flats, bases = ([], []), (np.zeros(nb, np.int64), np.zeros(nb, np.int64))
    size = [0, 0]
    for first, n in tensors:
        nbt = max(1, -(-n // BLOCK))
        blk = slice(first, first + nbt)
        if n == 0:
            continue
        sym = np.stack([(qm.reshape(nb, BLOCK)[blk] + lm[blk, None]), qv.reshape(nb, BLOCK)[blk]]).astype(np.int64)
        bits = np.stack([bm[blk], bv[blk]]).astype(np.int64)
        coded = (np.arange(nbt * BLOCK) < n).reshape(nbt, BLOCK)
        for st in range(2):
            off = {}
            for w in np.unique(bits[st]).tolist():
                rows = bits[st] == w
                hist = np.bincount(sym[st][rows][coded[rows]], minlength=1 << w).astype(np.float64)
                with np.errstate(divide="ignore"):
                    cost = np.where(hist > 0, np.log2(hist.sum() / np.maximum(hist, 1)), np.log2(hist.sum()) + UNSEEN_BITS)
                off[w] = size[st]
                flats[st].append(cost)
                size[st] += cost.size
            bases[st][blk] = [off[int(w)] for w in bits[st]]
    cat = [np.concatenate(f) if f else np.zeros(0) for f in flats]
    return cat[0], bases[0], cat[1], bases[1], lm


def _cost(qm, qv, idx, tabs):
    """Coded bits of the pairs (qm[k], qv[k]) at coordinates idx (qm, qv given at idx)."""
    flat_m, base_m, flat_v, base_v, lm = tabs
    blk = idx // BLOCK
    return flat_m[base_m[blk] + qm + lm[blk]] + flat_v[base_v[blk] + qv]


def _moved(qm, qv, dm, dv, lim_m, lim_v):
    """The pairs (qm + dm, qv + dv) kept in their blocks' ranges; v code 0 (v == 0) stays 0."""
    return np.clip(qm + dm, -lim_m, lim_m), np.where(qv == 0, 0, np.clip(qv + dv, 1, lim_v))


def _certified(mt, vt, idx, classify, certify_fn, max_level=None, reject_first=False):
    """Of the coordinates idx, those whose decoded values (mt, vt), given at idx, the guard
    keeps: exact or certified (by refinement level `max_level` at the latest, when given)."""
    exact, ok = classify(mt, vt, idx)
    keep = exact.copy()
    test = np.flatnonzero(ok & ~exact)
    if test.size:
        lv = certify_fn(mt[test], vt[test], idx[test], max_level=max_level, reject_first=reject_first)
        keep[test[lv >= 0]] = True
    return keep


def optimize(mq, vq, widths, in_tensor, tensors, classify, certify_fn, decode, decode_at, rounds=None):
    """Move codes to certified neighbours of fewer coded bits (module docstring).

    Args:
      mq, vq: flat m / v codes over the padded group (int8/int16, uint8/uint16), as the
        width search assembled them.
      widths: [nb] per-block joined widths (`jaxguard.format.packed.join_widths`).
      in_tensor: flat bool, True on coordinates of a tensor.
      tensors: per tensor of the group, ``(first block, coordinates)``: each tensor gets
        its own models, as the writer codes it.
      classify: ``classify(mt, vt, idx) -> (exact, ok)`` of the coordinates idx of the
        group, their decoded values given at idx (as for the width search).
      certify_fn: ``certify_fn(mt, vt, idx, max_level=None, reject_first=False) -> level per
        idx`` (< 0: escapes or, with `max_level`, not certified by that level), values given
        at idx; moves are certified up to `MOVE_MAX_LEVEL`, with the early reject first
        (`jaxguard.core.certify.certify_pc`: most moves are refused).
      decode: ``decode(mq, vq) -> (m~, v~)`` flat, exactly as the reader decodes.
      decode_at: ``decode_at(qm, qv, idx) -> (m~, v~)`` of the coordinates idx given their
        codes at idx, as `decode` decodes them (a coordinate's values depend only on its own
        codes and its block's parameters).
      rounds: at most this many rounds of moves and refits (default `ROUNDS`; 0: the pass is
        off, the codes stay the width search's).

    Returns:
      (mq, vq, m~, v~): the chosen codes (same dtypes) and their decoded values.
    """
    bm, bv = packed.split_widths(widths)
    rep = lambda w: np.repeat(w.astype(np.int64), BLOCK)    # noqa: E731
    lim_m, lim_v = (1 << (rep(bm) - 1)) - 1, (1 << rep(bv)) - 1
    qm, qv = mq.astype(np.int64), vq.astype(np.int64)
    rounds = ROUNDS if rounds is None else rounds
    mt, vt = decode(qm, qv)
    if rounds == 0 or not any(n for _, n in tensors):
        return mq, vq, mt, vt
    coded = np.flatnonzero(in_tensor)
    exact, _ = classify(mt[coded], vt[coded], coded)
    live = coded[~exact]     # exact coordinates (zeros) keep their codes
    kept = _certified(mt[live], vt[live], live, classify, certify_fn)   # then tracked: accepted pairs are certified
    am, av = np.array(MOVES, np.int64).T
    lim_ml, lim_vl = lim_m[live], lim_v[live]
    # bit j set: move j from the coordinate's present pair was refused by the guard.  The
    # certificate of a pair depends on the coordinate and the pair only, not on the cost
    # tables, so a later round skips it (most tries of the later rounds repeat a refusal).
    refused = np.zeros(live.size, np.uint32)
    prev = None
    for _ in range(rounds):
        tabs = _cost_tables(qm, qv, bm, bv, tensors)
        total = float(_cost(qm[coded], qv[coded], coded, tabs).sum())
        if prev is not None and prev - total < MIN_GAIN * prev:
            break
        prev = total
        # each coordinate tries its pairs cheapest first and keeps the first the guard
        # certifies: one certificate per try.  Only the order is kept (1 byte per move and
        # coordinate); a try recomputes its pair and cost.
        qml, qvl = qm[live], qv[live]
        now = np.where(kept, _cost(qml, qvl, live, tabs), np.inf)   # an escape takes any certified pair
        order = np.empty((len(MOVES), live.size), np.int8)
        for s in range(0, live.size, ORDER_CHUNK):
            at = slice(s, s + ORDER_CHUNK)
            cm, cv = _moved(qml[at][None], qvl[at][None], am[:, None], av[:, None], lim_ml[at], lim_vl[at])
            order[:, at] = np.argsort(_cost(cm, cv, live[at][None], tabs), axis=0, kind="stable")
        searching = np.arange(live.size)
        moved = np.zeros(live.size, bool)
        new_m, new_v = qm.copy(), qv.copy()
        for k in range(len(MOVES)):
            pick = order[k, searching].astype(np.int64)
            cm, cv = _moved(qml[searching], qvl[searching], am[pick], av[pick], lim_ml[searching], lim_vl[searching])
            cheaper = _cost(cm, cv, live[searching], tabs) < now[searching] - 1e-9
            searching, cm, cv, pick = searching[cheaper], cm[cheaper], cv[cheaper], pick[cheaper]
            if searching.size == 0:
                break
            bit = np.left_shift(np.uint32(1), pick.astype(np.uint32))
            ok = np.zeros(searching.size, bool)
            new = np.flatnonzero((refused[searching] & bit) == 0)   # a refused move is refused again
            if new.size:
                ix = live[searching[new]]
                tm, tv = decode_at(cm[new], cv[new], ix)
                ok[new] = _certified(tm, tv, ix, classify, certify_fn, MOVE_MAX_LEVEL, reject_first=True)
            refused[searching[~ok]] |= bit[~ok]
            acc = live[searching[ok]]
            new_m[acc], new_v[acc] = cm[ok], cv[ok]
            kept[searching[ok]] = True
            moved[searching[ok]] = True
            searching = searching[~ok]
        refused[moved] = 0      # a new pair: its moves lead to other pairs
        qm, qv = new_m, new_v
        mt, vt = decode(qm, qv)
    escaped = live[~kept]
    if escaped.size:        # stored exactly: their codes are free, take each model's cheapest
        flat_m, base_m, flat_v, base_v, lm = _cost_tables(qm, qv, bm, bv, tensors)
        for i in escaped.tolist():
            b = i // BLOCK
            qm[i] = int(np.argmin(flat_m[base_m[b]:base_m[b] + 2 * int(lm[b]) + 1])) - int(lm[b])
            if qv[i]:
                qv[i] = 1 + int(np.argmin(flat_v[base_v[b] + 1:base_v[b] + (1 << int(bv[b]))]))
        mt, vt = decode(qm, qv)
    return qm.astype(mq.dtype), qv.astype(vq.dtype), mt, vt
