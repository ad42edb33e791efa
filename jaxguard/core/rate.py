"""Rate-optimized code choice for ``logrel-ans``: the guard's slack spent on fewer coded bits.

The width search (`jaxguard.core.adaptive`) gives every coordinate the code nearest its
value on its block's grid.  The guard usually has slack left there: a neighbouring code
pair also keeps the first update within ``tau*lr``, and under the tensor's rANS models
one of them may cost fewer bits (codes near the mode of the distribution are cheaper).
This pass gives every coordinate a fixed set of candidates: its own pair and the pairs
`MOVES` away from it (the block's parameters stay, so only that coordinate's decoded
``(m~, v~)`` change).  Each round every coordinate takes its cheapest candidate the guard
certifies, if it costs fewer bits than its present pair under its tensor's symbol counts
(per stream and width, as the writer fits its models); then it recounts and repeats while
a round saves at least `MIN_GAIN` of the coded bits (at most `ROUNDS`).  The counts sharpen
round by round, so the codes gather on fewer symbols where the guard lets them
(rate-distortion optimized quantization, with the certificate as the only distortion
measure).  The certificates are batched: a round certifies, in one call per
`RATE_CHUNK` coordinates, every cheaper candidate one step away not yet decided, then in a
second call the cheaper ones two steps away whose one-step neighbour on the way certified
(a move refused one step out is rarely certified two out: on the 867K-coordinate bench
checkpoint skipping those cuts the certificates from 10.4M to 6.0M for +0.001 points of
FP32).  A candidate is certified at most once over all rounds (the candidate set is fixed,
and a certificate depends on the coordinate and the pair only).  Every coordinate is
certified in full once; a candidate is certified up to `MOVE_MAX_LEVEL` only (by default
the closed form and the adaptive tier: the fixed cell levels cost most and decide few
moves); a candidate that needs more is not taken.  A coordinate that escapes takes any
certified candidate; one that still escapes (stored exactly; the reader overwrites its
decoded codes) takes its stream's cheapest codes.

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

__all__ = ["ROUNDS", "MOVE_MAX_LEVEL", "SEARCH_MAX_LEVEL", "optimize"]

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
# candidate 0 is the pair itself, then MOVES by ring; the first INNER (0 included) are one step
# away, and INNER_OF[j] is the one-step candidate on the way to candidate j
_CANDIDATES = ((0, 0),) + tuple(sorted(MOVES, key=lambda d: max(abs(d[0]), abs(d[1]))))
INNER = sum(max(abs(dm), abs(dv)) <= 1 for dm, dv in _CANDIDATES)
assert all(max(abs(dm), abs(dv)) <= 1 for dm, dv in _CANDIDATES[:INNER])
_step_in = lambda d: d - (d > 1) + (d < -1)    # noqa: E731
INNER_OF = np.array([_CANDIDATES.index((_step_in(dm), _step_in(dv))) for dm, dv in _CANDIDATES])
OUTER_ROW = np.arange(len(_CANDIDATES)) >= INNER
MIN_GAIN = 0.003       # stop when a round saves less than this fraction of the coded bits
RATE_CHUNK = 1 << 16   # coordinates whose candidate costs are held at once (8 bytes a candidate)
UNSEEN_BITS = 3.0      # a symbol no coordinate uses yet costs this much more than one used once
# A candidate move is certified up to this refinement level (`jaxguard.core.bound.LEVELS`);
# one that needs more is rejected (always safe: the coordinate keeps a pair it has).
# -1: the closed form and the adaptive tier only (`certify.certify_pc`), no fixed level;
# None: every level.  Measured on a 137,216-coordinate transformer (t701, 2-core AMD EPYC,
# bench/experiments/results/ans_levels.md): every level 11.20 s and 19.55% of FP32, -1 (with
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


def _candidate_costs(qm, qv, lim_m, lim_v, idx, am, av, tabs):
    """Coded bits of the pairs ``(qm + am[j], qv + av[j])`` (kept in range, as `_moved`) at
    coordinates idx: [len(am), len(idx)].  A pair's bits are its m bits plus its v bits, so
    each distinct m move and v move is looked up once."""
    flat_m, base_m, flat_v, base_v, lm = tabs
    blk = idx // BLOCK
    om, ov = base_m[blk] + lm[blk], base_v[blk]
    m_bits = {int(d): flat_m[om + np.minimum(np.maximum(qm + d, -lim_m), lim_m)] for d in np.unique(am)}
    v_bits = {int(d): flat_v[ov + np.where(qv == 0, 0, np.minimum(np.maximum(qv + d, 1), lim_v))] for d in np.unique(av)}
    out = np.empty((am.size, idx.size))
    for j, (dm, dv) in enumerate(zip(am.tolist(), av.tolist())):
        np.add(m_bits[dm], v_bits[dv], out=out[j])
    return out


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
    if rounds == 0 or not any(n for _, n in tensors):
        mt, vt = decode(qm, qv)
        return mq, vq, mt, vt
    coded = np.flatnonzero(in_tensor)
    mt, vt = decode_at(qm[coded], qv[coded], coded)
    exact, _ = classify(mt, vt, coded)
    live = coded[~exact]     # exact coordinates (zeros) keep their codes
    # candidate 0 is the width search's pair, candidate j its MOVES[j - 1] neighbour: a fixed
    # set per coordinate, so each candidate is certified at most once over all rounds.  Bit j
    # of `certified` / `refused`: candidate j is known to certify / not to.
    am, av = np.array(_CANDIDATES, np.int64).T
    qm0, qv0, lim_ml, lim_vl = qm[live], qv[live], lim_m[live], lim_v[live]
    kept = _certified(mt[~exact], vt[~exact], live, classify, certify_fn)
    certified = kept.astype(np.uint32)
    refused = (~kept).astype(np.uint32)
    pick = np.zeros(live.size, np.int64)   # each coordinate's present candidate
    bit = lambda j: np.left_shift(np.uint32(1), j.astype(np.uint32))    # noqa: E731
    shift = np.arange(am.size, dtype=np.uint32)[:, None]

    def has_bits(bits, at):   # [len(am), len(at)]: candidate j's bit set at each of at
        return ((bits[at][None] >> shift) & np.uint32(1)) != 0

    def unknown_bits(at):
        return ((((certified[at] | refused[at])[None] >> shift) & np.uint32(1)) == 0)

    def test(mask, at):   # certify the candidates mask [len(am), len(at)] selects, in one batch
        jj, cc = np.nonzero(mask)
        if jj.size == 0:
            return
        c_t = at[cc]
        cm, cv = _moved(qm0[c_t], qv0[c_t], am[jj], av[jj], lim_ml[c_t], lim_vl[c_t])
        tm, tv = decode_at(cm, cv, live[c_t])
        ok_t = _certified(tm, tv, live[c_t], classify, certify_fn, MOVE_MAX_LEVEL, reject_first=True)
        np.bitwise_or.at(certified, c_t[ok_t], bit(jj[ok_t]))
        np.bitwise_or.at(refused, c_t[~ok_t], bit(jj[~ok_t]))

    prev = None
    for _ in range(rounds):
        tabs = _cost_tables(qm, qv, bm, bv, tensors)
        total = float(_cost(qm[coded], qv[coded], coded, tabs).sum())
        if prev is not None and prev - total < MIN_GAIN * prev:
            break
        prev = total
        # every coordinate takes its cheapest candidate the guard certifies, if cheaper than
        # its present pair (an escape: any certified one)
        now = np.where(kept, _cost(qm[live], qv[live], live, tabs), np.inf)
        for s0 in range(0, live.size, RATE_CHUNK):
            at = np.arange(s0, min(live.size, s0 + RATE_CHUNK))
            cost = _candidate_costs(qm0[at], qv0[at], lim_ml[at], lim_vl[at], live[at], am, av, tabs)
            cheaper = cost < now[at] - 1e-9
            # the inner ring first (and an inner candidate whose outer one is cheaper, so
            # that its answer is known), then an outer candidate only where the inner one
            # on its way certified: a move that fails one step out rarely passes two out
            wanted = cheaper.copy()
            for o in range(INNER, am.size):
                wanted[INNER_OF[o]] |= cheaper[o]
            wanted[INNER:] = False
            test(wanted & unknown_bits(at), at)
            inner_ok = has_bits(certified, at)[INNER_OF]
            test(cheaper & inner_ok & unknown_bits(at) & OUTER_ROW[:, None], at)
            usable = cheaper & has_bits(certified, at)
            cost[~usable] = np.inf
            best_j = np.argmin(cost, 0)
            found = np.flatnonzero(np.isfinite(cost[best_j, np.arange(at.size)]))
            pick[at[found]] = best_j[found]
            kept[at[found]] = True
        qm[live], qv[live] = _moved(qm0, qv0, am[pick], av[pick], lim_ml, lim_vl)
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
