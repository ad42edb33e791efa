"""Training-time state codecs: AL8/AL16 (non-negative), uf8 and d8 (signed or not).

These are thin, jittable array-in/array-out wrappers around the one implementation of each
code family in :mod:`jaxguard.core.codes` (shared with the checkpoint guard): the per-block
functions there are ``jax.vmap``-ed over blocks here, nothing is re-derived.

An encoded tensor is a ``NamedTuple`` of arrays (so it is a pytree that lives inside optax
state, ``jit``, ``vmap`` and checkpointers), and it carries everything decode needs:

* ``codes`` has the *original shape* of the tensor (no padding is stored);
* per-block parameters have shape ``(nblocks,)``;
* the block size is recovered from ``codes.size`` and ``nblocks``: block sizes are powers of
  two, and for ``nblocks >= 2`` exactly one power of two ``b`` gives ``ceil(n / b) ==
  nblocks``; with one block any ``b >= n`` decodes identically.

Numerical contract (AL, ``al_encode``/``al_decode``; L = 2**bits - 1 codes for positives)
--------------------------------------------------------------------------------------
Let a block's positive finite values have minimum ``m`` and maximum ``h``.  Its
parameters are ``lo = max(m, h * 2**-100, 2**-126)`` (clamped to ``<= h``) and
``r = 2**((log2 h - log2 lo) / (L - 1))`` in float32; code ``q >= 1`` decodes to
``lo * r**(q-1)`` (binary powering, :func:`jaxguard.core.codes.log_decode_block`).

* Exact zero: ``q == 0`` iff ``x == +0.0`` or ``-0.0``; zeros decode to ``+0.0`` exactly.
* All-zero blocks and constant blocks (``m == h``, ``r == 1``) round-trip bit-exactly.
* Half a log step: for every ``x`` with ``lo <= x <= h`` the decoded value satisfies
  ``|x~ - x| <= (r - 1) / (r + 1) * x * (1 + 2**-18)``; ``(r-1)/(r+1) < sqrt(r) - 1``, i.e.
  the error is below half a step of the block's *own* log grid (AL8, span s bits:
  ``r = 2**(s/254)``).  The factor ``1 + 2**-18`` covers the float32 rounding of ``r`` and
  of the at most ``bits`` multiplies in decode (measured: well inside; tested).
* Range cap: a block spans at most ``2**100`` (``LOG_RANGE_CAP_EXP``).  Positive values
  below ``h * 2**-100`` (more than ~30 decades under the block maximum) and below
  ``2**-126`` (subnormals) are *raised* to ``lo``: the half-step bound does not hold for
  them, their decoded value is larger than ``x`` (for a second moment this shrinks the
  step ``m / sqrt(v)``: the safe direction).  At the cap, AL8's relative error bound is
  ``(2**(100/254) - 1) / (2**(100/254) + 1) = 0.1356``; AL16's is ``5.3e-4``.
* Policy for other inputs: NaN, +-Inf and negative values encode as ``q = 0`` (decode to
  0), the same reset bitsandbytes applies to non-finite moments.  They never enter the
  block statistics.  Subnormal inputs are nonzero (``q >= 1``) and decode to ``>= 2**-126``;
  decode never produces a subnormal, so XLA CPU (which flushes subnormals to zero),
  numpy and torch decode bit-identically.
* Compute dtype float32 throughout; decode is deterministic and bit-exact across backends.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard.core import codes as _codes
from jaxguard.errors import ConfigError
from jaxguard.format.spec import dynamic_map as _dynamic_map

__all__ = [
    "ALCode", "UF8Code", "D8Code",
    "al_encode", "al_decode", "uf8_encode", "uf8_decode", "d8_encode", "d8_decode",
    "quantize", "dequantize", "encode", "decode", "is_encoded", "CODE_NAMES", "al_error_bound",
]

_MIN_BLOCK, _MAX_BLOCK = 16, 1 << 16


class ALCode(NamedTuple):
    """AL8 (uint8 codes) or AL16 (uint16 codes) encoding of a non-negative tensor."""
    codes: jax.Array  # uint8 / uint16, shape of the tensor; 0 <=> exact zero
    lo: jax.Array     # float32 [nblocks]: value of code 1
    r: jax.Array      # float32 [nblocks]: ratio between consecutive codes


class UF8Code(NamedTuple):
    """Uniform symmetric absmax 8-bit encoding of a signed tensor."""
    codes: jax.Array  # int8 in [-127, 127], shape of the tensor
    scale: jax.Array  # float32 [nblocks] = max(absmax / 127, 2**-126)


class D8Code(NamedTuple):
    """bitsandbytes dynamic-tree 8-bit encoding (signed map, or unsigned for non-negative)."""
    codes: jax.Array   # uint8 index into the map, shape of the tensor
    absmax: jax.Array  # float32 [nblocks]
    signed: jax.Array  # bool [] : which of the two maps (a leaf so the pytree stays arrays)


_ENCODED = (ALCode, UF8Code, D8Code)
CODE_NAMES = ("fp32", "bf16", "al8", "al16", "uf8", "d8")


def is_encoded(x) -> bool:
    """Whether `x` is one of this module's encoded forms (`ALCode`, `UF8Code`, `D8Code`).

    Args:
      x: anything (typically a state leaf).

    Returns:
      bool.
    """
    return isinstance(x, _ENCODED)


# ------------------------------------------------------------------ blocking
def check_block_size(block_size) -> int:
    """Validate a block size for the blocked codes.

    Args:
      block_size: values per block.

    Returns:
      It, as an int.

    Raises:
      ConfigError: not a power of two in [16, 65536].
    """
    if (not isinstance(block_size, (int, np.integer)) or block_size < _MIN_BLOCK
            or block_size > _MAX_BLOCK or block_size & (block_size - 1)):
        raise ConfigError(
            f"block_size={block_size!r} is not a power of two in [{_MIN_BLOCK}, {_MAX_BLOCK}]; "
            f"use e.g. 256 (the default)")
    return int(block_size)


def _blocks(x, block_size, fill=0):
    flat = jnp.ravel(x)
    n = flat.shape[0]
    nb = max(1, -(-n // block_size))
    pad = nb * block_size - n
    if pad:
        flat = jnp.concatenate([flat, jnp.full((pad,), fill, flat.dtype)])
    valid = (jnp.arange(nb * block_size) < n).reshape(nb, block_size)
    return flat.reshape(nb, block_size), valid


def _infer_block_size(n: int, nblocks: int) -> int:
    """The power-of-two block size that split n values into nblocks blocks."""
    per = max(1, -(-n // nblocks))
    return max(_MIN_BLOCK, 1 << (per - 1).bit_length())


def _unblock(blocks, shape):
    n = math.prod(shape)
    return jnp.ravel(blocks)[:n].reshape(shape)


def _as_f32(x, name):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ConfigError(f"{name} got dtype {x.dtype}; pass a floating-point array")
    return x.astype(jnp.float32)


# ------------------------------------------------------------------ AL
def al_encode(x, bits: int = 8, block_size: int = _codes.BLOCK) -> ALCode:
    """Encode a non-negative tensor with AL8 (``bits=8``) or AL16 (``bits=16``).

    Numerical contract: see the module docstring (exact zeros, exact constant blocks,
    relative error ``<= (r-1)/(r+1) * (1 + 2**-18)`` for values inside the block's capped
    range ``[lo, h]``, NaN/Inf/negative -> 0, subnormals raised to ``>= 2**-126``).

    Args:
      x: a non-negative floating tensor, any shape (computed in float32).
      bits: 8 (AL8, uint8 codes) or 16 (AL16, uint16 codes).
      block_size: values per block, a power of two (default 256).

    Returns:
      An `ALCode`: ``codes`` of x's shape, per-block float32 ``lo`` and ``r``.

    Raises:
      ConfigError: bits other than 8/16, a non-floating dtype, or a bad block_size.
    """
    if bits not in (8, 16):
        raise ConfigError(f"bits={bits!r} is not supported by AL; use 8 (AL8) or 16 (AL16)")
    block_size = check_block_size(block_size)
    return _al_encode(_as_f32(x, "al_encode"), bits, block_size)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _al_encode(x, bits, block_size):
    xb, valid = _blocks(x, block_size)
    q, lo, r = jax.vmap(lambda b, v: _codes.log_encode_block(b, v, bits))(xb, valid)
    return ALCode(_unblock(q, x.shape), lo, r)


@jax.jit
def al_decode(enc: ALCode) -> jax.Array:
    """Decode an :class:`ALCode` to float32 (bit-exact, never subnormal; see module).

    Args:
      enc: an `ALCode` from `al_encode`.

    Returns:
      A float32 jax array of the original shape.
    """
    bits = 16 if enc.codes.dtype == jnp.uint16 else 8
    shape = enc.codes.shape
    bs = _infer_block_size(math.prod(shape), enc.lo.shape[0])
    qb, _ = _blocks(enc.codes, bs)
    out = jax.vmap(lambda q, lo, r: _codes.log_decode_block(q, lo, r, bits))(qb, enc.lo, enc.r)
    return _unblock(out, shape)


def al_error_bound(enc: ALCode) -> jax.Array:
    """Per-block relative error bound ``(r-1)/(r+1) * (1 + 2**-18)`` for values in range.

    Args:
      enc: an `ALCode`.

    Returns:
      float32 (nblocks,): the bound on ``|x~ - x| / x`` for ``lo <= x <= h`` of each block.
    """
    return (enc.r - 1.0) / (enc.r + 1.0) * jnp.float32(1.0 + 2.0**-18)


# ------------------------------------------------------------------ uf8
def uf8_encode(x, block_size: int = _codes.BLOCK) -> UF8Code:
    """Uniform symmetric absmax 8-bit ("uf8") encoding of a signed tensor.

    Numerical contract: per block ``scale = max(absmax / 127, 2**-126)`` (float32), codes
    in ``[-127, 127]`` chosen nearest in value, ``x~ = f32(q) * scale`` (one correctly
    rounded multiply, bit-exact everywhere).  ``|x~ - x| <= scale / 2`` (plus one float32
    rounding) for finite ``x``; the block's absmax element is reproduced to one rounding;
    zeros decode to 0 exactly (sign dropped); NaN/Inf encode as 0 and do not enter absmax.
    Values below ``scale / 2`` decode to 0 (uf8 has no zero invariant for small values).

    Args:
      x: a floating tensor, any shape (computed in float32).
      block_size: values per block, a power of two (default 256).

    Returns:
      A `UF8Code`: int8 ``codes`` of x's shape and per-block float32 ``scale``.

    Raises:
      ConfigError: a non-floating dtype, or a block_size that is not a power of two in
        the supported range.
    """
    block_size = check_block_size(block_size)
    return _uf8_encode(_as_f32(x, "uf8_encode"), block_size)


@functools.partial(jax.jit, static_argnums=(1,))
def _uf8_encode(x, block_size):
    xb, valid = _blocks(x, block_size)
    q, scale = jax.vmap(_codes.linear8_encode_block)(xb, valid)
    return UF8Code(_unblock(q, x.shape), scale)


@jax.jit
def uf8_decode(enc: UF8Code) -> jax.Array:
    """Decode a :class:`UF8Code`: ``f32(q) * scale`` per block (bit-exact).

    Args:
      enc: a `UF8Code` from `uf8_encode`.

    Returns:
      A float32 jax array of the original shape.
    """
    shape = enc.codes.shape
    bs = _infer_block_size(math.prod(shape), enc.scale.shape[0])
    qb, _ = _blocks(enc.codes, bs)
    return _unblock(jax.vmap(_codes.linear8_decode_block)(qb, enc.scale), shape)


# ------------------------------------------------------------------ d8
def d8_encode(x, signed: bool = True, block_size: int = _codes.BLOCK) -> D8Code:
    """bitsandbytes dynamic-tree 8-bit ("d8") encoding, signed map or unsigned map.

    Numerical contract: per block ``absmax = max(max|x|, 2**-126)``; the code is the map
    entry nearest in value to ``x`` (``map`` = :func:`jaxguard.format.spec.dynamic_map`, equal to
    ``bitsandbytes.functional.create_dynamic_map``; the codec ``block8`` uses the same map and
    the same `dynamic8` functions), ``x~ = map[q] * absmax`` (one float32
    multiply).  Relative error is that of the map (~0.5% near absmax, growing to 100% below
    ``1e-6 * absmax`` where the map has no entries: such values may decode to 0).  With
    ``signed=False`` exact zeros keep the zero code; negative values must not be passed.
    NaN/Inf encode as 0.

    Args:
      x: a floating tensor, any shape (non-negative when ``signed=False``).
      signed: use the signed map (for m) or the unsigned one (for v).
      block_size: values per block, a power of two (default 256).

    Returns:
      A `D8Code`: uint8 ``codes`` of x's shape, per-block float32 ``absmax`` and the
      ``signed`` flag.

    Raises:
      ConfigError: a non-floating dtype, or a block_size that is not a power of two in
        the supported range.
    """
    block_size = check_block_size(block_size)
    return _d8_encode(_as_f32(x, "d8_encode"), bool(signed), block_size)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _d8_encode(x, signed, block_size):
    table = _dynamic_map(bool(signed))
    xb, valid = _blocks(x, block_size)
    q, absmax = jax.vmap(lambda b, v: _codes.dynamic8_encode_block(b, v, table, bool(signed)))(xb, valid)
    return D8Code(_unblock(q, x.shape), absmax, jnp.asarray(bool(signed)))


@jax.jit
def d8_decode(enc: D8Code) -> jax.Array:
    """Decode a :class:`D8Code`: ``map[q] * absmax`` per block (one float32 multiply).

    Args:
      enc: a `D8Code` from `d8_encode` (its ``signed`` flag picks the map).

    Returns:
      A float32 jax array of the original shape.
    """
    shape = enc.codes.shape
    bs = _infer_block_size(math.prod(shape), enc.absmax.shape[0])
    qb, _ = _blocks(enc.codes, bs)
    ts = jnp.asarray(_dynamic_map(True))
    tu = jnp.asarray(_dynamic_map(False))
    table = jnp.where(enc.signed, ts, tu)
    out = jax.vmap(lambda q, a: _codes.dynamic8_decode_block(q, a, table))(qb, enc.absmax)
    return _unblock(out, shape)


# ------------------------------------------------------------------ dispatch by name
def quantize(x, code: str, block_size: int = _codes.BLOCK, signed: bool = True):
    """Quantize ``x`` with a named training-time code: fp32 (identity), bf16, al8, al16, uf8, d8.

    Args:
      x: a floating tensor.
      code: one of `CODE_NAMES`.
      block_size: values per block for the blocked codes (al8, al16, uf8, d8).
      signed: d8 only: the signed or the unsigned map.

    Returns:
      ``x`` as a jax array (fp32), a bfloat16 array (bf16), or the code's NamedTuple.

    Raises:
      ConfigError: an unknown code, or as the code's own encoder.
    """
    if code == "fp32":
        return jnp.asarray(x)
    if code == "bf16":
        return jnp.asarray(x).astype(jnp.bfloat16)
    if code == "al8":
        return al_encode(x, 8, block_size)
    if code == "al16":
        return al_encode(x, 16, block_size)
    if code == "uf8":
        return uf8_encode(x, block_size)
    if code == "d8":
        return d8_encode(x, signed, block_size)
    raise ConfigError(f"code={code!r} is unknown; use one of {', '.join(CODE_NAMES)}")


def dequantize(enc, dtype=jnp.float32):
    """Inverse of :func:`quantize` (plain arrays are cast to ``dtype``).

    Args:
      enc: a quantized form from `quantize`, or a plain array.
      dtype: the dtype plain arrays are cast to (default float32); coded forms always
        decode to float32.

    Returns:
      A jax array of the original shape.
    """
    if isinstance(enc, ALCode):
        return al_decode(enc)
    if isinstance(enc, UF8Code):
        return uf8_decode(enc)
    if isinstance(enc, D8Code):
        return d8_decode(enc)
    return jnp.asarray(enc).astype(dtype)


def encode(x, code: str, block_size: int = _codes.BLOCK, signed: bool = True):
    """Deprecated name of `quantize` (``jaxguard.quant.encode``); the guarded encode is
    `jaxguard.encode`.

    Args:
      x, code, block_size, signed: as `quantize`.

    Returns:
      As `quantize`.
    """
    warnings.warn("jaxguard.quant.encode is now jaxguard.quant.quantize (jaxguard.encode is the guarded "
                  "checkpoint encode)", DeprecationWarning, stacklevel=2)
    return quantize(x, code, block_size, signed)


def decode(enc, dtype=jnp.float32):
    """Deprecated name of `dequantize` (``jaxguard.quant.decode``).

    Args:
      enc, dtype: as `dequantize`.

    Returns:
      As `dequantize`.
    """
    warnings.warn("jaxguard.quant.decode is now jaxguard.quant.dequantize", DeprecationWarning, stacklevel=2)
    return dequantize(enc, dtype)
