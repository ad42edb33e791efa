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

__all__ = ["TINY_NORMAL", "num_blocks", "linear8_decode_block", "nearest_neighbour_code",
           "linear8_encode_block", "log_decode_block", "log_block_params", "log_encode_block", "bf16_encode",
           "bf16_decode", "dynamic_map", "dynamic8_encode_block", "dynamic8_decode_block", "sqrt_scale_block",
           "rel8_scale_floor", "rel8_encode_block", "rel8_decode_block"]

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard.core import floatbits as _fbits
from jaxguard.core.floatbits import device as _fb
from jaxguard.format import spec as _spec
from jaxguard.format.spec import BLOCK
TINY_NORMAL = np.float32(2.0**-126)
LOG_RANGE_CAP_EXP = 100  # a log block spans at most 2**100

_F32 = jnp.float32


# ---------------------------------------------------------------- blocking
def num_blocks(n: int) -> int:
    """How many `BLOCK`-sized blocks hold n values (at least one, even for n = 0).

    Args:
      n: the number of values.

    Returns:
      ``max(1, ceil(n / BLOCK))``.
    """
    return max(1, -(-n // BLOCK))


# ---------------------------------------------------------------- linear8 (m)
def linear8_scale(x, valid):
    """The linear8 block scale: absmax / 127 over the valid finite values.

    Args:
      x: float32 values of one block.
      valid: bool mask of the values that count (padding and escapes excluded).

    Returns:
      A float32 scalar, at least 2**-126 (so an all-zero block has a normal scale).
    """
    ok = valid & _fb.finite(x)
    absmax = jnp.max(jnp.where(ok, jnp.abs(x), 0.0))
    return jnp.maximum(absmax / _F32(127.0), _F32(TINY_NORMAL))


def linear8_decode_block(q, scale):
    """Decode one linear8 block: ``f32(q) * scale``, one float32 multiply per value.

    Args:
      q: int8 codes of one block.
      scale: the block's float32 scale.

    Returns:
      float32 values of q's shape.
    """
    return q.astype(_F32) * scale


def nearest_neighbour_code(q0, decode, x0, limit):
    """The code among ``clip(q0 + {-1, 0, 1}, -limit, limit)`` whose decoded value is
    nearest to x0 (ties: the lowest candidate, as ``argmin`` over -1, 0, +1 picks).

    A select chain, not a stacked ``argmin``/``take_along_axis``: the same codes, and
    XLA on CPU fuses it into one elementwise loop (1.7x faster for the log8-rel proposal).

    Args:
      q0: float32 centre estimates (already clipped to ``[-limit, limit]``).
      decode: ``decode(q) -> float32`` values of float32 codes, elementwise.
      x0: float32 targets of q0's shape.
      limit: largest code magnitude.

    Returns:
      float32 codes of q0's shape.
    """
    best = q0
    best_err = jnp.abs(decode(q0) - x0)
    for d in (-1.0, 1.0):
        cand = jnp.clip(q0 + d, -limit, limit)
        err = jnp.abs(decode(cand) - x0)
        better = err <= best_err if d < 0 else err < best_err
        best = jnp.where(better, cand, best)
        best_err = jnp.where(better, err, best_err)
    return best


def linear8_encode_block(x, valid):
    """Encode one block as int8 codes in [-127, 127] with a shared scale.

    Each code is the nearest of ``round(x / scale) + {-1, 0, 1}`` by the decoded value's
    float32 error, so encode and `linear8_decode_block` agree on the rounding.

    Args:
      x: float32 values of one block.
      valid: bool mask of the values that count; invalid and non-finite values get code 0.

    Returns:
      ``(q, scale)``: int8 codes of x's shape and the float32 scale (`linear8_scale`).
    """
    scale = linear8_scale(x, valid)
    x0 = jnp.where(valid & _fb.finite(x), x, 0.0)
    q0 = jnp.clip(jnp.round(x0 / scale), -127, 127)
    q = nearest_neighbour_code(q0, lambda c: c * scale, x0, 127.0)
    return q.astype(jnp.int8), scale


# ---------------------------------------------------------------- log / AL (v)
def _log_powers(r, bits):
    """P_j = r**(2**j) by repeated squaring, j = 0..bits-1."""
    ps = [r]
    for _ in range(bits - 1):
        ps.append(ps[-1] * ps[-1])
    return ps


def log_decode_block(q, lo, r, bits=8):
    """Decode one log block: ``lo * r**(q-1)`` as a product of float32 powers, 0 for q = 0.

    The powers ``r**(2**j)`` are multiplied in bit order of ``q - 1``, the same float32
    sequence as the numpy reader, so every backend decodes bit for bit alike.

    Args:
      q: unsigned codes of one block (0 = exact zero).
      lo: the block's smallest level (float32).
      r: the block's ratio between levels (float32, >= 1).
      bits: code width, 8 (uint8) or 16 (uint16).

    Returns:
      float32 values of q's shape, all >= 0.
    """
    k = q.astype(jnp.int32) - 1
    ps = _log_powers(r, bits)
    val = jnp.broadcast_to(lo, q.shape).astype(_F32)
    for j in range(bits):
        bit = ((k >> j) & 1) == 1
        val = jnp.where(bit, val * ps[j], val)
    return jnp.where(q == 0, _F32(0.0), val)


def log_block_params(x, valid, bits=8, levels=None):
    """The log grid ``(lo, r)`` of one block from its positive finite valid values.

    ``lo`` is the smallest positive value and ``r`` spreads ``2**bits - 1`` levels up to
    the largest, with the span capped at 2**100 and r nudged up (16-bit codes) until the
    float32 grid reaches the maximum.

    Args:
      x: float32 values of one block.
      valid: bool mask of the values that set the range.
      bits: code width, 8 or 16 (static).
      levels: optional number of levels (may be traced, at most ``2**bits - 1``), default
        ``2**bits - 1``; `jaxguard.core.adaptive` passes it for its 9..12-bit widths.

    Returns:
      ``(lo, r)``: float32 scalars, ``lo >= 2**-126`` and ``r >= 1`` (``r == 1`` for a
      block with one distinct level).
    """
    levels = (1 << bits) - 1 if levels is None else levels
    pos = valid & _fb.finite(x) & ~_fb.zero(x) & ~_fb.negative(x)
    xs = jnp.where(pos, x, 0.0)
    hi = jnp.max(xs)
    lo = jnp.min(jnp.where(pos, x, jnp.inf))
    hi = jnp.maximum(hi, _F32(TINY_NORMAL))
    lo = jnp.clip(lo, _F32(TINY_NORMAL), hi)
    lo = jnp.maximum(lo, hi * _F32(2.0**-LOG_RANGE_CAP_EXP))
    span = jnp.log2(hi) - jnp.log2(lo)
    r = jnp.exp2(span / jnp.asarray(levels - 1, _F32))
    r = jnp.where(hi > lo, jnp.maximum(r, _F32(1.0)), _F32(1.0)).astype(_F32)
    # r is rounded to float32, so lo*r**(levels-1) can fall short of hi (by up to
    # (levels-1)*2**-24 relative: 0.4% for AL16); nudge r up until the grid covers hi.
    top_code = jnp.full((1,), levels, jnp.int32)
    for _ in range(4 if bits > 8 else 0):   # AL8's drift (254*2**-24) is far below a step
        top = log_decode_block(top_code, lo, r, bits)[0]
        r = jnp.where((hi > lo) & (top < hi), jnp.nextafter(r, _F32(jnp.inf)), r)
    return lo.astype(_F32), r


def log_encode_block(x, valid, bits=8, positive=None):
    """Encode one block of nonnegative values as log codes (0 = exact zero).

    Every positive finite value gets a nonzero code (clamped to the block's range if it
    was left out of the statistics by `valid`); the code is the nearest by the decoded
    float32 value (neighbour comparison; bisection for 16 bits).

    Args:
      x: float32 values of one block (negative and non-finite ones get code 0).
      valid: bool mask of the values that set ``(lo, r)`` (`log_block_params`).
      bits: code width, 8 or 16.
      positive: optional precomputed mask of finite ``x > 0`` (the guard computes it on
        the host from the bits); default: computed here from the int32 bits.

    Returns:
      ``(q, lo, r)``: uint8 (bits = 8) or uint16 codes of x's shape and the float32
      block parameters.
    """
    levels = (1 << bits) - 1
    lo, r = log_block_params(x, valid, bits)
    # every positive value gets a nonzero code (q == 0 <=> x == 0), even those kept out
    # of the block statistics (`valid=False`): they are clamped to the range.
    pos = _fbits.device_positive_finite(x) if positive is None else positive
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
    """bf16 codes: round to nearest even (``astype(bfloat16)``).

    Args:
      x: float32 values.

    Returns:
      bfloat16 values of x's shape.
    """
    return x.astype(jnp.bfloat16)


def bf16_decode(q):
    """Decode bf16 codes: exact widening to float32.

    Args:
      q: bfloat16 values.

    Returns:
      float32 values of q's shape (every bf16 value is a float32).
    """
    return q.astype(_F32)


# ---------------------------------------------------------------- dynamic map (bitsandbytes)
# the map is stored as bits in the format's spec (one implementation, numpy only): its
# construction depends on torch's float32 linspace, which numpy does not reproduce.
dynamic_map = _spec.dynamic_map


def dynamic8_encode_block(x, valid, table, signed: bool):
    """Encode one block with the bitsandbytes dynamic-tree map (codec ``block8``).

    Values are normalised by the block's absmax and given the nearest table entry by the
    decoded float32 value; an exact zero keeps the table's zero code.

    Args:
      x: float32 values of one block.
      valid: bool mask of the values that set absmax; non-finite ones get the zero code.
      table: the 256 sorted float32 map entries (`jaxguard.format.spec.dynamic_map`).
      signed: whether the table is the signed map (for m) or the unsigned one (for v);
        the table itself carries the difference.

    Returns:
      ``(q, absmax)``: uint8 codes of x's shape and the float32 absmax (>= 2**-100, so
      every decoded value is normal).
    """
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
    """Decode one dynamic8 block: ``table[q] * absmax``, one float32 multiply.

    Args:
      q: uint8 codes of one block.
      absmax: the block's float32 absmax.
      table: the 256 float32 map entries the block was encoded with.

    Returns:
      float32 values of q's shape.
    """
    return jnp.asarray(table)[q.astype(jnp.int32)] * absmax


# ---------------------------------------------------------------- rel8 (m relative to sqrt(v~))
def sqrt_scale_block(qv, wlo, rr, bits=8):
    """The per-coordinate m-scale of log8-rel: ``w(q) = wlo * rr**(q-1) ~ sqrt(v~(q))``.

    Args:
      qv: the block's v codes; q = 0 (v == 0) is mapped to code 1.
      wlo, rr: the block's float32 sqrt-grid parameters (v's own grid is
        ``(wlo*wlo, rr*rr)``: `jaxguard.format.packed.lo_r`).
      bits: code width of qv.

    Returns:
      float32 scales ``w > 0`` of qv's shape.
    """
    return log_decode_block(jnp.where(qv == 0, 1, qv), wlo, rr, bits)


def rel8_scale_floor(wlo):
    """Smallest m-scale for which (q*scale)*w stays normal for every w >= wlo.

    Args:
      wlo: the block's smallest sqrt-scale (float32, > 0).

    Returns:
      A float32 scale floor, at least 2**-126.
    """
    return jnp.maximum(_F32(TINY_NORMAL), (_F32(TINY_NORMAL) / wlo) * _F32(1 + 2.0**-20))


def rel8_encode_block(x, valid, w, wlo):
    """Signed 8-bit codes of x / w (w > 0 per coordinate): decode is ``(f32(q)*scale)*w``.

    Used for Adam's m with ``w ~ sqrt(v~)``: the reconstruction error of each coordinate is
    then proportional to its own sqrt(v), which is what the update divides by.

    Args:
      x: float32 values of one block (m).
      valid: bool mask of the values that set the scale; the others get code 0.
      w: float32 per-coordinate scales (`sqrt_scale_block`), > 0.
      wlo: the block's smallest w (sets `rel8_scale_floor`).

    Returns:
      ``(q, scale)``: int8 codes in [-127, 127] of x's shape and the float32 block scale.
    """
    ok = valid & _fb.finite(x)
    y = jnp.where(ok, x / w, 0.0)
    absmax = jnp.max(jnp.abs(y))
    scale = jnp.maximum(absmax / _F32(127.0), rel8_scale_floor(wlo))
    x0 = jnp.where(ok, x, 0.0)
    q0 = jnp.clip(jnp.round(y / scale), -127, 127)
    q = nearest_neighbour_code(q0, lambda c: (c * scale) * w, x0, 127.0)
    return q.astype(jnp.int8), scale


def rel8_decode_block(q, scale, w):
    """Decode one rel8 block: ``(f32(q) * scale) * w``, two float32 multiplies in that order.

    Args:
      q: int8 codes of one block.
      scale: the block's float32 scale.
      w: float32 per-coordinate scales (`sqrt_scale_block` of the block's v codes).

    Returns:
      float32 values of q's shape.
    """
    return (q.astype(_F32) * scale) * w
