"""Code families for 8-bit (and 16-bit) optimizer-state moments.

Every family here is written for one block of `BLOCK` coordinates and `jax.vmap`-ed over
blocks by `encode_blocks` / `decode_blocks`.  The guard (jaxguard.core.guard) and the
training-time quantizers (jaxguard.quant) share these functions: there is one AL8.

Numerical contract (all families)
---------------------------------
* Decode uses only correctly rounded IEEE float32 multiplies (and exact bit
  manipulation), so JAX (any backend, any XLA flags), numpy (jaxguard.format.reader) and torch
  produce bit-identical float32 values.  Golden vectors in tests/golden pin this.
* Decode never produces a subnormal number: scales and log-range bases are clamped to at
  least the smallest normal float32, 2**-126.  XLA on CPU flushes subnormals to zero,
  numpy does not; staying normal keeps the three decoders identical.
* Non-finite values and values the caller marks invalid (`valid=False`) never enter a
  block's statistics; the guard stores them exactly as escapes.
* Encode is free to be inexact (its choice is what the container stores): it picks the
  nearest code in value among the neighbours of an estimate.

Families
--------
* ``linear8``  signed, ``scale = max(absmax/127, 2**-126)``, ``x~ = f32(q) * scale``.
* ``log`` (AL8 for bits=8, AL16 for bits=16)  non-negative, exact zero:
  ``q == 0 <=> x == 0``; codes ``1..L`` (L = 2**bits - 1) cover ``[lo, hi]`` of the
  block's positive values geometrically: ``x~(q) = lo * r**(q-1)``, the power formed by
  binary powering in a fixed order (squarings ``P_j = P_{j-1}**2``, then multiplies for
  the set bits of ``q-1``, lowest bit first).  ``lo >= max(2**-126, hi * 2**-100)``: a
  block's range is capped at 2**100 so that no intermediate overflows; smaller positive
  values take code 1 and are judged by the guard.
* ``bf16``     round-to-nearest-even to bfloat16; decode is a 16-bit shift.
* ``dynamic8`` the bitsandbytes dynamic-tree map (signed for m, unsigned for v),
  ``x~ = map[q] * absmax``; the 256-entry map (`jaxguard.format.spec.dynamic_map`) is
  stored in the container.  Codec ids ``block8``/``block8-unguarded`` and the quant
  policy ``d8`` are this family.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard.core.floatbits import device as _fb
from jaxguard.format import spec as _spec
from jaxguard.format.spec import BLOCK
TINY_NORMAL = np.float32(2.0**-126)
LOG_RANGE_CAP_EXP = 100  # a log block spans at most 2**100

_F32 = jnp.float32


# ---------------------------------------------------------------- blocking
def num_blocks(n: int) -> int:
    return max(1, -(-n // BLOCK))


# ---------------------------------------------------------------- linear8 (m)
def linear8_scale(x, valid):
    ok = valid & _fb.finite(x)
    absmax = jnp.max(jnp.where(ok, jnp.abs(x), 0.0))
    return jnp.maximum(absmax / _F32(127.0), _F32(TINY_NORMAL))


def linear8_decode_block(q, scale):
    """q: int8 codes of one block; scale: f32.  One f32 multiply per value."""
    return q.astype(_F32) * scale


def linear8_encode_block(x, valid):
    scale = linear8_scale(x, valid)
    x0 = jnp.where(valid & _fb.finite(x), x, 0.0)
    q0 = jnp.clip(jnp.round(x0 / scale), -127, 127)
    cands = jnp.stack([jnp.clip(q0 + d, -127, 127) for d in (-1.0, 0.0, 1.0)])
    err = jnp.abs(cands * scale - x0)
    q = jnp.take_along_axis(cands, jnp.argmin(err, axis=0)[None], axis=0)[0]
    return q.astype(jnp.int8), scale


# ---------------------------------------------------------------- log / AL (v)
def _log_powers(r, bits):
    """P_j = r**(2**j) by repeated squaring, j = 0..bits-1."""
    ps = [r]
    for _ in range(bits - 1):
        ps.append(ps[-1] * ps[-1])
    return ps


def log_decode_block(q, lo, r, bits=8):
    """q: unsigned codes of one block (0 = exact zero); lo, r: f32 block parameters."""
    k = q.astype(jnp.int32) - 1
    ps = _log_powers(r, bits)
    val = jnp.broadcast_to(lo, q.shape).astype(_F32)
    for j in range(bits):
        bit = ((k >> j) & 1) == 1
        val = jnp.where(bit, val * ps[j], val)
    return jnp.where(q == 0, _F32(0.0), val)


def log_block_params(x, valid, bits=8):
    """(lo, r) of one block from its positive finite valid values."""
    levels = (1 << bits) - 1
    pos = valid & _fb.finite(x) & ~_fb.zero(x) & ~_fb.negative(x)
    xs = jnp.where(pos, x, 0.0)
    hi = jnp.max(xs)
    lo = jnp.min(jnp.where(pos, x, jnp.inf))
    hi = jnp.maximum(hi, _F32(TINY_NORMAL))
    lo = jnp.clip(lo, _F32(TINY_NORMAL), hi)
    lo = jnp.maximum(lo, hi * _F32(2.0**-LOG_RANGE_CAP_EXP))
    span = jnp.log2(hi) - jnp.log2(lo)
    r = jnp.exp2(span / _F32(levels - 1))
    r = jnp.where(hi > lo, jnp.maximum(r, _F32(1.0)), _F32(1.0)).astype(_F32)
    # r is rounded to float32, so lo*r**(levels-1) can fall short of hi (by up to
    # (levels-1)*2**-24 relative: 0.4% for AL16); nudge r up until the grid covers hi.
    top_code = jnp.full((1,), levels, jnp.int32)
    for _ in range(4 if bits > 8 else 0):   # AL8's drift (254*2**-24) is far below a step
        top = log_decode_block(top_code, lo, r, bits)[0]
        r = jnp.where((hi > lo) & (top < hi), jnp.nextafter(r, _F32(jnp.inf)), r)
    return lo.astype(_F32), r


def log_encode_block(x, valid, bits=8, positive=None):
    """`positive` (optional): a precomputed mask of finite x > 0 (the guard computes it
    on the host from the bits)."""
    levels = (1 << bits) - 1
    lo, r = log_block_params(x, valid, bits)
    # every positive value gets a nonzero code (q == 0 <=> x == 0), even those kept out
    # of the block statistics (`valid=False`): they are clamped to the range.
    if positive is None:
        # finite and > 0 (subnormals included) <=> 0 < int32 bits < bits(+inf); this form
        # survives XLA's rewrites, the masked unsigned one did not (FTZ made it false)
        b = jax.lax.bitcast_convert_type(x.astype(_F32), jnp.int32)
        positive = (b > 0) & (b < 0x7F800000)
    pos = positive
    xs = jnp.where(pos, x, lo)
    safe_logr = jnp.where(r > 1.0, jnp.log2(r), _F32(1.0))
    est = jnp.round((jnp.log2(jnp.maximum(xs, _F32(TINY_NORMAL))) - jnp.log2(lo)) / safe_logr) + 1
    est = jnp.where(r > 1.0, est, _F32(1.0))
    best_q = jnp.clip(est, 1, levels)
    best_err = jnp.abs(log_decode_block(best_q.astype(jnp.int32), lo, r, bits) - xs)
    for d in (-1.0, 1.0):
        cq = jnp.clip(est + d, 1, levels)
        ce = jnp.abs(log_decode_block(cq.astype(jnp.int32), lo, r, bits) - xs)
        better = ce < best_err
        best_q = jnp.where(better, cq, best_q)
        best_err = jnp.where(better, ce, best_err)
    if bits > 8:
        # the float32 grid drifts from the ideal one by up to (levels-1)*2**-24 relative,
        # i.e. many codes for AL16: find the nearest code by bisection on the decoded grid
        # (increasing in q), then compare the two neighbours.
        q_lo = jnp.ones(xs.shape, jnp.int32)
        q_hi = jnp.full(xs.shape, levels, jnp.int32)
        for _ in range(bits):
            mid = (q_lo + q_hi + 1) // 2
            below = log_decode_block(mid, lo, r, bits) <= xs
            q_lo = jnp.where(below, mid, q_lo)
            q_hi = jnp.where(below, q_hi, mid - 1)
        q_up = jnp.minimum(q_lo + 1, levels)
        e_lo = jnp.abs(log_decode_block(q_lo, lo, r, bits) - xs)
        e_up = jnp.abs(log_decode_block(q_up, lo, r, bits) - xs)
        best_q = jnp.where(e_up < e_lo, q_up, q_lo).astype(_F32)
    dtype = jnp.uint8 if bits == 8 else jnp.uint16
    best_q = jnp.nan_to_num(best_q, nan=1.0).astype(jnp.int32)
    q = jnp.where(pos, jnp.clip(best_q, 1, levels), 0)
    return q.astype(dtype), lo, r


# ---------------------------------------------------------------- bf16
def bf16_encode(x):
    return x.astype(jnp.bfloat16)


def bf16_decode(q):
    return q.astype(_F32)


# ---------------------------------------------------------------- dynamic map (bitsandbytes)
# the map is stored as bits in the format's spec (one implementation, numpy only): its
# construction depends on torch's float32 linspace, which numpy does not reproduce.
dynamic_map = _spec.dynamic_map


def dynamic8_encode_block(x, valid, table, signed: bool):
    ok = valid & _fb.finite(x)
    absmax = jnp.max(jnp.where(ok, jnp.abs(x), 0.0))
    # table entries reach ~1e-7: absmax >= 2**-100 keeps every decoded value normal
    absmax = jnp.maximum(absmax, _F32(2.0**-100))
    xn = jnp.where(ok, x, 0.0) / absmax
    t = jnp.asarray(table)
    idx = jnp.clip(jnp.searchsorted(t, xn), 1, 255)
    lo_c, hi_c = idx - 1, idx
    dec_lo = t[lo_c] * absmax
    dec_hi = t[hi_c] * absmax
    x0 = jnp.where(ok, x, 0.0)
    q = jnp.where(jnp.abs(dec_lo - x0) <= jnp.abs(dec_hi - x0), lo_c, hi_c)
    # exact zero stays zero (q of table value 0.0)
    zero_code = int(np.argmax(np.asarray(table) == 0.0))
    q = jnp.where(_fb.zero(x0), zero_code, q)
    return q.astype(jnp.uint8), absmax


def dynamic8_decode_block(q, absmax, table):
    return jnp.asarray(table)[q.astype(jnp.int32)] * absmax


# ---------------------------------------------------------------- rel8 (m relative to sqrt(v~))
def sqrt_scale_block(qv, wlo, rr, bits=8):
    """w(q) = wlo * rr**(q-1) ~ sqrt(v~(q)), with q = 0 (v == 0) mapped to code 1."""
    return log_decode_block(jnp.where(qv == 0, 1, qv), wlo, rr, bits)


def rel8_scale_floor(wlo):
    """Smallest m-scale for which (q*scale)*w stays normal for every w >= wlo."""
    return jnp.maximum(_F32(TINY_NORMAL), (_F32(TINY_NORMAL) / wlo) * _F32(1 + 2.0**-20))


def rel8_encode_block(x, valid, w, wlo):
    """Signed 8-bit codes of x / w (w > 0 per coordinate): decode is ``(f32(q)*scale)*w``.

    Used for Adam's m with ``w ~ sqrt(v~)``: the reconstruction error of each coordinate is
    then proportional to its own sqrt(v), which is what the update divides by.
    """
    ok = valid & _fb.finite(x)
    y = jnp.where(ok, x / w, 0.0)
    absmax = jnp.max(jnp.abs(y))
    scale = jnp.maximum(absmax / _F32(127.0), rel8_scale_floor(wlo))
    x0 = jnp.where(ok, x, 0.0)
    q0 = jnp.clip(jnp.round(y / scale), -127, 127)
    cands = jnp.stack([jnp.clip(q0 + d, -127, 127) for d in (-1.0, 0.0, 1.0)])
    err = jnp.abs((cands * scale) * w - x0)
    q = jnp.take_along_axis(cands, jnp.argmin(err, axis=0)[None], axis=0)[0]
    return q.astype(jnp.int8), scale


def rel8_decode_block(q, scale, w):
    return (q.astype(_F32) * scale) * w
