"""The ``logrel-aw`` codec: log8-rel's decode with per-block code widths chosen by the guard.

For each 256-block the encoder proposes codes at several (m width, v width) pairs
(`WIDTH_PAIRS`, 4..8 bits), certifies every pair's decoded moments with the same guard as
the other codecs, and keeps per block the pair of fewest bytes: ``count*(bm+bv)/8`` bytes
of codes plus about 9 bytes per coordinate that does not certify (its exact pair and
index).  Blocks that still have escapes then try `WIDE_PAIRS` (9..12 bits) by the same
rule: a block whose v spans many binades needs finer steps than 8 bits give.
The assembled codes are then decoded once more exactly as the reader decodes them and
certified again: that last certificate is the one the escapes come from.

Numerical contract
------------------
Decode is log8-rel's (``v~ = lo * r**(q-1)``, ``m~ = (f32(q)*scale) * w``,
``w = wlo * rr**(max(qv,1)-1)``), powered at 12 bits when a group has a block wider
than 8 (uint16 codes; `decode_blocks`), with the narrower codes simply not using the high
bits, and block parameters that are exact in the stored form: ``lo = wlo*wlo``,
``r = rr*rr`` (float32 multiplies) and ``scale`` a bfloat16 value.  So JAX, numpy
(jaxguard.format.reader) and torch decode bit-identically, and the guard's contract
(jaxguard.core.guard) holds for every coordinate: exact, or certified within ``tau*lr``.
"""
from __future__ import annotations

__all__ = ["WIDTH_PAIRS", "WIDE_PAIRS", "choose_and_certify", "decode_blocks"]

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard.core import codes
from jaxguard.core import programs as _programs
from jaxguard.core.floatbits import device as _fb
from jaxguard.format import packed

CODEC = packed.CODEC
# (bm, bv) pairs tried per block.  Measured on a 100-step ByteTransformer (137,216
# coordinates, tau = 0.01): these 9 give 23.82% of FP32; all 15 pairs with |bm - bv| <= 2
# give 23.66% at twice the encode time; (8, 7) is the asymmetric pair chosen most often.
WIDTH_PAIRS = ((8, 8), (8, 7), (7, 8), (7, 7), (6, 7), (6, 6), (5, 6), (5, 5), (4, 4))
# Tried only on the blocks that still escape after WIDTH_PAIRS: blocks mixing units whose v
# differ by 20+ binades need finer log-v steps (and m steps) than 8 bits give.  Measured on
# the optax MLP (reproduce.py run_optax, seed 702, 300 steps, 9,610 coordinates): these 17
# give 23.20% of FP32 and 14 escapes; all 38 pairs of 6..12 bits with |bm - bv| <= 3 give
# 23.21%; the 10 symmetric-ish pairs from 9 bits up 25.02% (v needs the bits more than m).
WIDE_PAIRS = ((8, 9), (7, 9), (6, 9), (9, 8), (9, 9), (8, 10), (7, 10), (10, 9), (9, 10), (10, 10), (8, 11),
              (11, 10), (10, 11), (11, 11), (12, 11), (11, 12), (12, 12))
ESCAPE_COST = 9          # bytes per escape: the exact (m, v) pair + ~1 byte of sparse index
_F32 = jnp.float32
_SQRT_TINY = np.float32(2.0**-63)   # wlo >= 2**-63 keeps lo = wlo*wlo >= 2**-126 (normal)


def _bf16_up(x):
    """Smallest bfloat16 value >= x (x positive, finite)."""
    b = jax.lax.bitcast_convert_type(x.astype(_F32), jnp.uint32)
    b = jnp.where((b & 0xFFFF) != 0, (b | 0xFFFF) + 1, b) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(b, _F32)


def _log_codes(x, pos, lo, r, levels, bits):
    """Nearest code (in decoded value) in 1..levels for positive x, 0 elsewhere."""
    xs = jnp.where(pos, x, lo)
    safe_logr = jnp.where(r > 1.0, jnp.log2(r), _F32(1.0))
    est = jnp.round((jnp.log2(jnp.maximum(xs, _F32(codes.TINY_NORMAL))) - jnp.log2(lo)) / safe_logr) + 1
    est = jnp.where(r > 1.0, est, _F32(1.0))
    est = jnp.nan_to_num(est, nan=1.0)
    best_q = jnp.clip(est, 1, levels)
    best_err = jnp.abs(codes.log_decode_block(best_q.astype(jnp.int32), lo, r, bits) - xs)
    for d in (-2.0, -1.0, 1.0, 2.0):
        cq = jnp.clip(est + d, 1, levels)
        ce = jnp.abs(codes.log_decode_block(cq.astype(jnp.int32), lo, r, bits) - xs)
        better = ce < best_err
        best_q = jnp.where(better, cq, best_q)
        best_err = jnp.where(better, ce, best_err)
    return jnp.where(pos, best_q.astype(jnp.int32), 0)


def _propose_block(mb, vb, valid, vpos, bm, bv, bits):
    # bm, bv: the widths (static ints, or traced for the wide pairs); bits: the static
    # width the log grid is powered at (bv itself, or MAX_WIDTH for the wide pairs)
    levels_v = (1 << bv) - 1
    lm = (1 << (bm - 1)) - 1
    lo0, r0 = codes.log_block_params(vb, valid, bits=bits, levels=levels_v)
    wlo = jnp.maximum(jnp.sqrt(lo0), _F32(_SQRT_TINY))
    rr = jnp.maximum(jnp.sqrt(r0), _F32(1.0))
    lo, r = wlo * wlo, rr * rr
    vq = _log_codes(vb, vpos, lo, r, levels_v, bits)
    w = codes.sqrt_scale_block(vq, wlo, rr, bits)
    ok = valid & _fb.finite(mb)
    y = jnp.where(ok, mb / w, 0.0)
    scale = jnp.maximum(jnp.max(jnp.abs(y)) / jnp.asarray(lm, _F32), codes.rel8_scale_floor(wlo))
    scale = _bf16_up(scale)
    x0 = jnp.where(ok, mb, 0.0)
    q0 = jnp.clip(jnp.round(y / scale), -lm, lm)
    mq = codes.nearest_neighbour_code(q0, lambda c: (c * scale) * w, x0, lm).astype(jnp.int32)
    mt = codes.rel8_decode_block(mq, scale, w)
    vt = codes.log_decode_block(vq, lo, r, bits)
    return mq, vq, scale, jnp.stack([lo, r, wlo, rr]), mt, vt


@functools.partial(jax.jit, static_argnames=("bm", "bv"))
def propose(mb, vb, valid, vpos, bm, bv):
    """One width pair's logrel-aw proposal for every block.

    Args:
      mb, vb: float32 moments as blocks [nb, 256].
      valid: [nb, 256] bool, coordinates that may enter a block's statistics.
      vpos: [nb, 256] bool, strictly positive finite v.
      bm, bv: the m and v code widths in bits (4..8, static; wider: `propose_wide`).

    Returns:
      (m codes int8, v codes uint8, m_params [nb, 1], v_params [nb, 4] = (lo, r, wlo, rr),
      m~, v~ [nb, 256]) with m~, v~ decoded exactly as the reader will.
    """
    mq, vq, s, vp, mt, vt = jax.vmap(functools.partial(_propose_block, bm=bm, bv=bv, bits=bv))(mb, vb, valid, vpos)
    return mq.astype(jnp.int8), vq.astype(jnp.uint8), s[:, None], vp, mt, vt


@jax.jit
def propose_wide(mb, vb, valid, vpos, bm, bv):
    """`propose` for widths up to `jaxguard.format.packed.MAX_WIDTH`, the widths traced (one
    compilation for every wide pair).

    Args:
      mb, vb, valid, vpos: as for `propose`.
      bm, bv: the m and v code widths in bits (int32 scalars, 4..12).

    Returns:
      As `propose`, with int16 m codes and uint16 v codes.
    """
    prop = functools.partial(_propose_block, bm=jnp.int32(bm), bv=jnp.int32(bv), bits=packed.MAX_WIDTH)
    mq, vq, s, vp, mt, vt = jax.vmap(prop)(mb, vb, valid, vpos)
    return mq.astype(jnp.int16), vq.astype(jnp.uint16), s[:, None], vp, mt, vt


def _bucket_rows(rows):
    """`rows` padded (with its first row) to a power of two: few compiled proposal shapes."""
    k = rows.size
    kp = 1 << max(0, int(k - 1).bit_length())
    return np.concatenate([rows, np.full(kp - k, rows[0], rows.dtype)])


def choose_and_certify(mh, vh, ph, valid, vpos, in_tensor, classify, certify_fn, pairs=None, code_bits=None,
                       wide_pairs=None, max_level=None):
    """Try every width pair, keep per block the cheapest; return the assembled proposal.

    Cost of a block: its code bits plus `ESCAPE_COST` bytes per escape; ties keep the
    pair tried first (`WIDTH_PAIRS` lists the wider first).  The pairs wider than 8 bits
    (`WIDE_PAIRS`) are tried only on the blocks that still have escapes after `pairs`, so
    blocks that certify at <= 8 bits cost no more encode time.

    Args:
      mh, vh, ph: flat float32 moments and parameters of the padded group (whole blocks).
      valid, vpos: [nb, 256] bool masks as for `propose`.
      in_tensor: flat bool, True on coordinates of a tensor (False on padding).
      classify: ``classify(mt, vt) -> (exact, ok)``, the guard's classification bound to
        this group (`jaxguard.core.certify.classify`).
      certify_fn: ``certify_fn(mt, vt, idx, max_level=None, reject_first=False) -> level per
        idx`` (< 0: escapes), the guard's certificate bound to this group's constants
        (`jaxguard.core.certify.certify_pc`); called with ``reject_first=True``, as most of a
        narrow pair's candidates are refused.
      pairs: the (bm, bv) pairs to try on every block (default `WIDTH_PAIRS`).
      code_bits: optional ``code_bits(mq, vq, bm, bv) -> [k, 256]`` bits each code costs
        (summed over the in-tensor coordinates); default the packed width, ``bm + bv``.
      wide_pairs: the pairs then tried on the blocks that still escape (default
        `WIDE_PAIRS`; ``()`` keeps every block at <= 8 bits).
      max_level: certify each pair's codes up to this refinement level only
        (``certify_fn(..., max_level=)``; a coordinate needing more counts as an escape of
        that pair: a cheaper search, never a weaker guarantee, as the final certificate
        is the full one); None: every level.

    Returns:
      (mq, vq, mp, vp, widths [nb] uint8) with codes flat over the padded group (int8 /
      uint8 when every block is <= 8 bits wide, else int16 / uint16); the guard decodes
      and certifies the assembled codes again from scratch.
    """
    nb = mh.size // codes.BLOCK
    pairs = WIDTH_PAIRS if pairs is None else pairs
    wide_pairs = WIDE_PAIRS if wide_pairs is None else wide_pairs
    mf, vf = jnp.asarray(mh).reshape(nb, codes.BLOCK), jnp.asarray(vh).reshape(nb, codes.BLOCK)
    inb = in_tensor.reshape(nb, codes.BLOCK)
    count = inb.sum(1)     # a partial last block stores fewer codes
    best = {"mq": np.zeros((nb, codes.BLOCK), np.int16), "vq": np.zeros((nb, codes.BLOCK), np.uint16),
            "mp": np.zeros((nb, 1), np.float32), "vp": np.zeros((nb, 4), np.float32),
            "widths": np.zeros(nb, np.uint8), "cost": np.full(nb, np.inf), "escapes": np.zeros(nb, np.int64)}

    def search(pair_list, rows, wide=False):
        sel = rows if rows.size == nb else _bucket_rows(rows)
        k = rows.size
        sub_in = np.zeros((nb, codes.BLOCK), bool)
        sub_in[rows] = inb[rows]
        sub_in = sub_in.reshape(-1)
        whole = rows.size == nb
        args = (mf, vf, valid, vpos) if whole else (mf[sel], vf[sel], valid[sel], vpos[sel])
        if not whole:    # the other blocks keep their moments exactly: no candidates there;
            # every pair overwrites the same rows, so one copy serves them all
            mfull = np.array(mh, np.float32).reshape(nb, codes.BLOCK)
            vfull = np.array(vh, np.float32).reshape(nb, codes.BLOCK)
        for bm, bv in pair_list:
            prop = propose_wide(*args, np.int32(bm), np.int32(bv)) if wide else propose(*args, bm=bm, bv=bv)
            mq, vq, mp, vp, mt, vt = (np.asarray(x)[:k] for x in prop)
            if whole:
                mt, vt = mt.reshape(-1), vt.reshape(-1)
            else:
                mfull[rows], vfull[rows] = mt, vt
                mt, vt = mfull.reshape(-1), vfull.reshape(-1)
            exact, ok = classify(mt, vt)
            cand = np.flatnonzero(sub_in & ~exact & ok)
            esc = sub_in & ~exact & ~ok
            lv = certify_fn(mt, vt, cand, max_level=max_level, reject_first=True)   # most pairs refuse most
            esc[cand[lv < 0]] = True
            nesc = esc.reshape(nb, codes.BLOCK)[rows].sum(1)
            bits = (bm + bv) * count[rows] if code_bits is None else (code_bits(mq, vq, bm, bv) * inb[rows]).sum(1)
            cost = bits / 8 + ESCAPE_COST * nesc
            take = cost < best["cost"][rows]
            at = rows[take]
            best["mq"][at], best["vq"][at], best["mp"][at], best["vp"][at] = mq[take], vq[take], mp[take], vp[take]
            best["widths"][at] = packed.join_widths(bm, bv)
            best["cost"][at], best["escapes"][at] = cost[take], nesc[take]

    search(pairs, np.arange(nb))
    still = np.flatnonzero(best["escapes"] > 0)
    if still.size and wide_pairs:
        search(wide_pairs, still, wide=True)
    bm, bv = packed.split_widths(best["widths"])
    mq = best["mq"].astype(np.int8) if bm.max(initial=0) <= 8 else best["mq"]
    vq = best["vq"].astype(np.uint8) if bv.max(initial=0) <= 8 else best["vq"]
    return mq.reshape(-1), vq.reshape(-1), best["mp"], best["vp"], best["widths"]


@jax.jit
def decode_blocks(mq, vq, mp, vp):
    """Blocked codes and parameters -> (m~, v~) blocked, as jaxguard.format.reader decodes them.

    Args:
      mq: [nb, 256] m codes (int8 or int16, centred). vq: [nb, 256] v codes (uint8 or
        uint16, up to `jaxguard.format.packed.MAX_WIDTH` bits: narrower codes decode to the
        same bits at any width, their high bits being 0).
      mp: [nb, 1] m scales. vp: [nb, 4] (lo, r, wlo, rr).

    Returns:
      (m~, v~) float32 [nb, 256].
    """
    bits = 8 if jnp.dtype(vq.dtype).itemsize == 1 else packed.MAX_WIDTH   # as the reader: the same values
    w = jax.vmap(functools.partial(codes.sqrt_scale_block, bits=bits))(vq, vp[:, 2], vp[:, 3])
    mt = jax.vmap(codes.rel8_decode_block)(mq, mp[:, 0], w)
    vt = jax.vmap(functools.partial(codes.log_decode_block, bits=bits))(vq, vp[:, 0], vp[:, 1])
    return mt, vt


# ---------------------------------------------------------------- widening log8-rel's escaping blocks (log8-rel-zstd)
# (bm, bv) pairs tried on a log8-rel block that escapes at least `WIDEN_FROM` coordinates.
# Measured on the optax MLP LM of bench/lm_runs.py at step 2,000 (its output kernel's blocks
# mix bytes whose v differ by ~19 binades: 8-bit log steps of v, 2.6%, are too coarse when
# g ~ 30 sqrt(v); logrel-aw's search chose bv = 9..10, bm = 7..8 there): log8-rel escapes
# 21.8% of the state, (8, 10) alone leaves 30 escapes and 21.34% of FP32; (8, 9) and (8, 10)
# 271 and 21.33% at twice the retry's cost; (8, 9) alone 4,615 and 22.32%.
WIDEN_PAIRS = ((8, 10),)
# A block is retried from this many escapes on: its 2 more bits a coordinate (64 bytes a
# block) cost about what `ESCAPE_COST` bytes of 7 escapes do.  GPT-2 after 3 steps has 645
# such blocks of 486,093; the MLP LM above nearly every block of its output kernel (the
# same payload as from 4 escapes on, to 0.001 points).
WIDEN_FROM = 8
WIDEN_ROWS = 64    # blocks proposed per call (padded): one compiled program for every retry
NARROW_WIDTHS = int(packed.join_widths(8, 8))


def widen_calls(K, coordinates=None, closed_form=True):
    """The ``(fn, args, static)`` of every program `widen_escaping_blocks` may run for a group
    with constants `K` (`programs.prepare`): made ready at a state's first save, so a later
    save whose blocks first escape enough to be widened compiles nothing.

    Args:
      K: the group's constants, a `bound.StepRow` of [G] arrays (as `certify.fast_accept`).
      coordinates: the group's padded coordinates (None: any): the widened blocks'
        candidates are among them (`certify.fast_accept_calls`).
      closed_form: the group certifies with the closed-form tier (not a small group's
        ladder, `certify.SPEED_TIERS_ABOVE`).

    Returns:
      A list of ``(fn, args, static)``: `propose_wide` on `WIDEN_ROWS` blocks and, with
      `closed_form`, the closed-form tier at each call size the group may use.
    """
    from jaxguard.core.certify import fast_accept_calls
    x = np.zeros((WIDEN_ROWS, codes.BLOCK), np.float32)
    flags = np.zeros((WIDEN_ROWS, codes.BLOCK), bool)
    wide = [(propose_wide, (x, x, flags, flags, np.int32(8), np.int32(8)), {})]
    return wide + fast_accept_calls(K, coordinates) if closed_form else wide


def widen_escaping_blocks(mh, vh, ph, in_tensor, mq, vq, mp, vp, mt, vt, exact, ok, escape, level_of, certify_at,
                          pairs=WIDEN_PAIRS, min_escapes=WIDEN_FROM):
    """Blocks of a log8-rel proposal that escape at least `min_escapes` coordinates, proposed
    again at the wider `pairs` (`propose_wide`) and kept where that costs fewer bytes.

    A block's cost is `ESCAPE_COST` bytes per escape plus, for a wider pair, its extra code
    bits (``bm + bv - 16`` a coordinate).  The wider proposals are decoded exactly as the
    reader decodes them and certified by the guard's own certificate (`certify_at`); a
    coordinate of a kept block is exact, certified, or escapes, as everywhere.

    Args:
      mh, vh, ph: flat float32 moments and parameter of the padded group (whole blocks).
      in_tensor: flat bool, True on the coordinates of a tensor.
      mq, vq: flat int8 / uint8 codes of the log8-rel proposal; mp [nb, 1], vp [nb, 4]: its
        block parameters; mt, vt: flat decoded values; exact, ok: flat bool, the guard's
        classification of them; escape: flat bool; level_of: flat int8 certifying level of
        each coordinate (-1: none).
      certify_at: ``certify_at(idx, mt_idx, vt_idx) -> int8 levels`` over positions `idx`
        with decoded values given at them (the guard's certificate bound to the group).
      pairs, min_escapes: the pairs tried, and the escapes from which a block is tried.

    Returns:
      ``(mq, vq, mp, vp, mt, vt, exact, ok, escape, level_of, widths)``: where a block was widened the
      codes come back as int16 / uint16 (flat), the others unchanged; ``widths`` [nb]
      uint8, ``(bm << 4) | bv`` (``0x88`` for the log8-rel blocks).
    """
    from jaxguard.core.certify import block_stats_valid, classify, v_positive
    nb = mh.size // codes.BLOCK
    widths = np.full(nb, NARROW_WIDTHS, np.uint8)
    esc_per_block = np.bincount(np.flatnonzero(escape & in_tensor) // codes.BLOCK, minlength=nb)
    rows = np.flatnonzero(esc_per_block >= min_escapes)
    if rows.size == 0:
        return mq, vq, mp, vp, mt, vt, exact, ok, escape, level_of, widths
    k = rows.size
    idx = (rows[:, None] * codes.BLOCK + np.arange(codes.BLOCK)).reshape(-1)
    inb = in_tensor[idx]
    valid = (inb & block_stats_valid(mh[idx], vh[idx], ph[idx])).reshape(k, codes.BLOCK)
    vpos = v_positive(vh[idx]).reshape(k, codes.BLOCK)
    kp = -(-k // WIDEN_ROWS) * WIDEN_ROWS     # one compiled shape: rows in chunks of WIDEN_ROWS
    pad = np.concatenate([np.arange(k), np.zeros(kp - k, np.int64)])
    blocks = [x.reshape(k, codes.BLOCK)[pad] for x in (mh[idx], vh[idx], valid, vpos)]
    count = inb.reshape(k, codes.BLOCK).sum(1)
    best_cost = ESCAPE_COST * esc_per_block[rows].astype(np.float64)
    best = [None] * k
    for bm, bv in pairs:
        outs = [_programs.call(propose_wide, *(x[c:c + WIDEN_ROWS] for x in blocks), np.int32(bm), np.int32(bv))
                for c in range(0, kp, WIDEN_ROWS)]
        qm, qv, smp, svp, smt, svt = (np.concatenate([np.asarray(o[i]) for o in outs])[:k] for i in range(6))
        a, b = smt.reshape(-1), svt.reshape(-1)
        ex, okk = classify(mh[idx], vh[idx], ph[idx], a, b)
        cand = np.flatnonzero(inb & ~ex & okk)
        lv = np.full(idx.size, -1, np.int8)
        lv[cand] = certify_at(idx[cand], a[cand], b[cand])
        esc = inb & ~ex & (lv < 0)
        cost = ESCAPE_COST * esc.reshape(k, codes.BLOCK).sum(1) + (bm + bv - 16) * count / 8
        for j in np.flatnonzero(cost < best_cost):
            best_cost[j] = cost[j]
            s = slice(j * codes.BLOCK, (j + 1) * codes.BLOCK)
            best[j] = (bm, bv, qm[j], qv[j], smp[j], svp[j], a[s], b[s], ex[s], okk[s], esc[s], lv[s])
    taken = [j for j in range(k) if best[j] is not None]
    if not taken:
        return mq, vq, mp, vp, mt, vt, exact, ok, escape, level_of, widths
    mq, vq = np.asarray(mq).astype(np.int16), np.asarray(vq).astype(np.uint16)
    mp, vp = np.array(mp, np.float32), np.array(vp, np.float32)
    mt, vt = np.array(mt, np.float32), np.array(vt, np.float32)
    exact, ok, escape, level_of = np.array(exact), np.array(ok), np.array(escape), np.array(level_of)
    for j in taken:
        bm, bv, qm, qv, smp, svp, a, b, ex, okk, esc, lv = best[j]
        r = int(rows[j])
        s = slice(r * codes.BLOCK, (r + 1) * codes.BLOCK)
        mq[s], vq[s], mp[r], vp[r], mt[s], vt[s], exact[s], ok[s] = qm, qv, smp, svp, a, b, ex, okk
        level_of[s] = np.where(in_tensor[s], lv, level_of[s])
        escape[s] = esc
        widths[r] = packed.join_widths(bm, bv)
    return mq, vq, mp, vp, mt, vt, exact, ok, escape, level_of, widths
