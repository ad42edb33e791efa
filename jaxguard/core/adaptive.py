"""The ``logrel-aw`` codec: log8-rel's decode with per-block code widths chosen by the guard.

For each 256-block the encoder proposes codes at several (m width, v width) pairs
(`WIDTH_PAIRS`, 4..8 bits), certifies every pair's decoded moments with the same guard as
the other codecs, and keeps per block the pair of fewest bytes: ``count*(bm+bv)/8`` bytes
of codes plus about 9 bytes per coordinate that does not certify (its exact pair and
index).
The assembled codes are then decoded once more exactly as the reader decodes them and
certified again: that last certificate is the one the escapes come from.

Numerical contract
------------------
Decode is log8-rel's (``v~ = lo * r**(q-1)``, ``m~ = (f32(q)*scale) * w``,
``w = wlo * rr**(max(qv,1)-1)``), with the narrower codes simply not using the high
bits, and block parameters that are exact in the stored form: ``lo = wlo*wlo``,
``r = rr*rr`` (float32 multiplies) and ``scale`` a bfloat16 value.  So JAX, numpy
(jaxguard.format.reader) and torch decode bit-identically, and the guard's contract
(jaxguard.core.guard) holds for every coordinate: exact, or certified within ``tau*lr``.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard.core import codes
from jaxguard.core.floatbits import device as _fb
from jaxguard.format import packed

CODEC = packed.CODEC
# (bm, bv) pairs tried per block.  Measured on a 100-step ByteTransformer (137,216
# coordinates, tau = 0.01): these 9 give 23.82% of FP32; all 15 pairs with |bm - bv| <= 2
# give 23.66% at twice the encode time; (8, 7) is the asymmetric pair chosen most often.
WIDTH_PAIRS = ((8, 8), (8, 7), (7, 8), (7, 7), (6, 7), (6, 6), (5, 6), (5, 5), (4, 4))
ESCAPE_COST = 9          # bytes per escape: the exact (m, v) pair + ~1 byte of sparse index
_F32 = jnp.float32
_SQRT_TINY = np.float32(2.0**-63)   # wlo >= 2**-63 keeps lo = wlo*wlo >= 2**-126 (normal)


def _bf16_up(x):
    """Smallest bfloat16 value >= x (x positive, finite)."""
    b = jax.lax.bitcast_convert_type(x.astype(_F32), jnp.uint32)
    b = jnp.where((b & 0xFFFF) != 0, (b | 0xFFFF) + 1, b) & jnp.uint32(0xFFFF0000)
    return jax.lax.bitcast_convert_type(b, _F32)


def _log_codes(x, pos, lo, r, levels):
    """Nearest code (in decoded value) in 1..levels for positive x, 0 elsewhere."""
    xs = jnp.where(pos, x, lo)
    safe_logr = jnp.where(r > 1.0, jnp.log2(r), _F32(1.0))
    est = jnp.round((jnp.log2(jnp.maximum(xs, _F32(codes.TINY_NORMAL))) - jnp.log2(lo)) / safe_logr) + 1
    est = jnp.where(r > 1.0, est, _F32(1.0))
    est = jnp.nan_to_num(est, nan=1.0)
    best_q = jnp.clip(est, 1, levels)
    best_err = jnp.abs(codes.log_decode_block(best_q.astype(jnp.int32), lo, r) - xs)
    for d in (-2.0, -1.0, 1.0, 2.0):
        cq = jnp.clip(est + d, 1, levels)
        ce = jnp.abs(codes.log_decode_block(cq.astype(jnp.int32), lo, r) - xs)
        better = ce < best_err
        best_q = jnp.where(better, cq, best_q)
        best_err = jnp.where(better, ce, best_err)
    return jnp.where(pos, best_q.astype(jnp.int32), 0)


def _propose_block(mb, vb, valid, vpos, bm, bv):
    levels_v = (1 << bv) - 1
    lm = (1 << (bm - 1)) - 1
    lo0, r0 = codes.log_block_params(vb, valid, bits=bv)
    wlo = jnp.maximum(jnp.sqrt(lo0), _F32(_SQRT_TINY))
    rr = jnp.maximum(jnp.sqrt(r0), _F32(1.0))
    lo, r = wlo * wlo, rr * rr
    vq = _log_codes(vb, vpos, lo, r, levels_v)
    w = codes.sqrt_scale_block(vq, wlo, rr)
    ok = valid & _fb.finite(mb)
    y = jnp.where(ok, mb / w, 0.0)
    scale = jnp.maximum(jnp.max(jnp.abs(y)) / _F32(lm), codes.rel8_scale_floor(wlo))
    scale = _bf16_up(scale)
    x0 = jnp.where(ok, mb, 0.0)
    q0 = jnp.clip(jnp.round(y / scale), -lm, lm)
    cands = jnp.stack([jnp.clip(q0 + d, -lm, lm) for d in (-1.0, 0.0, 1.0)])
    err = jnp.abs((cands * scale) * w - x0)
    mq = jnp.take_along_axis(cands, jnp.argmin(err, axis=0)[None], axis=0)[0].astype(jnp.int32)
    mt = codes.rel8_decode_block(mq, scale, w)
    vt = codes.log_decode_block(vq, lo, r)
    return mq.astype(jnp.int8), vq.astype(jnp.uint8), scale, jnp.stack([lo, r, wlo, rr]), mt, vt


@functools.partial(jax.jit, static_argnames=("bm", "bv"))
def propose(mb, vb, valid, vpos, bm, bv):
    """One width pair's logrel-aw proposal for every block.

    Args:
      mb, vb: float32 moments as blocks [nb, 256].
      valid: [nb, 256] bool, coordinates that may enter a block's statistics.
      vpos: [nb, 256] bool, strictly positive finite v.
      bm, bv: the m and v code widths in bits (4..8, static).

    Returns:
      (m codes int8, v codes uint8, m_params [nb, 1], v_params [nb, 4] = (lo, r, wlo, rr),
      m~, v~ [nb, 256]) with m~, v~ decoded exactly as the reader will.
    """
    mq, vq, s, vp, mt, vt = jax.vmap(functools.partial(_propose_block, bm=bm, bv=bv))(mb, vb, valid, vpos)
    return mq, vq, s[:, None], vp, mt, vt


def choose_and_certify(mh, vh, ph, valid, vpos, in_tensor, classify, certify_fn, pairs=None, code_bits=None):
    """Try every width pair, keep per block the cheapest; return the assembled proposal.

    Cost of a block: its code bits plus `ESCAPE_COST` bytes per escape; ties keep the wider
    pair (listed first in `WIDTH_PAIRS`).

    Args:
      mh, vh, ph: flat float32 moments and parameters of the padded group (whole blocks).
      valid, vpos: [nb, 256] bool masks as for `propose`.
      in_tensor: flat bool, True on coordinates of a tensor (False on padding).
      classify: ``classify(mt, vt) -> (exact, ok)``, the guard's classification bound to
        this group (`jaxguard.core.certify.classify`).
      certify_fn: ``certify_fn(mt, vt, idx) -> level per idx`` (< 0: escapes), the guard's
        certificate bound to this group's constants.
      pairs: the (bm, bv) pairs to try (default `WIDTH_PAIRS`).
      code_bits: optional ``code_bits(mq, vq, bm, bv) -> [nb, 256]`` bits each code costs
        (summed over the in-tensor coordinates); default the packed width, ``bm + bv``.

    Returns:
      (mq, vq, mp, vp, widths [nb] uint8) with codes flat over the padded group; the guard
      decodes and certifies the assembled codes again from scratch.
    """
    nb = mh.size // codes.BLOCK
    pairs = WIDTH_PAIRS if pairs is None else pairs
    mf, vf = jnp.asarray(mh).reshape(nb, codes.BLOCK), jnp.asarray(vh).reshape(nb, codes.BLOCK)
    best_cost = np.full(nb, np.inf)
    inb = in_tensor.reshape(nb, codes.BLOCK)
    count = inb.sum(1)     # a partial last block stores fewer codes
    best = None
    for bm, bv in pairs:
        mq, vq, mp, vp, mt, vt = (np.asarray(x) for x in propose(mf, vf, valid, vpos, bm, bv))
        mt, vt = mt.reshape(-1), vt.reshape(-1)
        exact, ok = classify(mt, vt)
        cand = np.flatnonzero(in_tensor & ~exact & ok)
        esc = in_tensor & ~exact & ~ok
        lv = certify_fn(mt, vt, cand)
        esc[cand[lv < 0]] = True
        bits = (bm + bv) * count if code_bits is None else (code_bits(mq, vq, bm, bv) * inb).sum(1)
        cost = bits / 8 + ESCAPE_COST * esc.reshape(nb, codes.BLOCK).sum(1)
        take = cost < best_cost
        if best is None:
            best = [mq.copy(), vq.copy(), mp.copy(), vp.copy(), np.full(nb, packed.join_widths(bm, bv), np.uint8)]
        else:
            best[0][take], best[1][take], best[2][take], best[3][take] = mq[take], vq[take], mp[take], vp[take]
            best[4][take] = packed.join_widths(bm, bv)
        best_cost = np.where(take, cost, best_cost)
    mq, vq, mp, vp, widths = best
    return mq.reshape(-1), vq.reshape(-1), mp, vp, widths


@jax.jit
def decode_blocks(mq, vq, mp, vp):
    """Blocked codes and parameters -> (m~, v~) blocked, as jaxguard.format.reader decodes them.

    Args:
      mq: [nb, 256] m codes (int8, centred). vq: [nb, 256] v codes (uint8).
      mp: [nb, 1] m scales. vp: [nb, 4] (lo, r, wlo, rr).

    Returns:
      (m~, v~) float32 [nb, 256].
    """
    w = jax.vmap(codes.sqrt_scale_block)(vq, vp[:, 2], vp[:, 3])
    mt = jax.vmap(codes.rel8_decode_block)(mq, mp[:, 0], w)
    vt = jax.vmap(codes.log_decode_block)(vq, vp[:, 0], vp[:, 1])
    return mt, vt
