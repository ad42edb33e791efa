"""float32 primitives in numpy that the torch replay and its variant detection share.

Numerical contract
------------------
``fma_float32_numpy`` is the correctly rounded float32 fused multiply-add for every
input (IEEE semantics, no flush to zero). ``sqrt_float32_numpy(x, table)`` is torch's
float32 ``sqrt`` as measured on this machine: the IEEE square root, then ``-1``, ``0``
or ``+1`` ulp from the table. Normal binades share one table indexed by (exponent
parity, mantissa) because ``sqrt(4x) = 2 sqrt(x)`` holds for the kernels measured;
binades where that scaling does not hold (the subnormals, whose kernel is often a
separate slow path, and the top binade, where a Newton step can overflow) carry their
own table over all 2^23 mantissas. Zero, negative, Inf and NaN inputs get the IEEE
result (``torch.sqrt`` agrees on every CPU measured).
"""
from __future__ import annotations

__all__ = ["MANTISSA_BITS", "fma_float32_numpy", "sqrt_float32_numpy"]

import numpy as np

MANTISSA_BITS = 23
MANTISSA_MASK = (1 << MANTISSA_BITS) - 1
EXPONENT_MASK = 0x7F800000


def fma_float32_numpy(a, b, c) -> np.ndarray:
    """Correctly rounded float32 fma(a, b, c): exact float64 product, TwoSum, round to odd,
    one final rounding to float32 (53 >= 2*24 + 2 makes that double rounding innocuous).

    Args:
      a, b, c: float32 arrays (broadcastable).

    Returns:
      float32 ``fma(a, b, c)`` rounded once, elementwise.
    """
    a, b, c = (np.asarray(x, np.float32).astype(np.float64) for x in (a, b, c))
    product = a * b
    with np.errstate(invalid="ignore", over="ignore"):
        total = product + c
        b_virtual = total - product
        error = (product - (total - b_virtual)) + (c - b_virtual)
        bits = total.view(np.int64)
        inexact = (error != 0) & np.isfinite(error)
        to_odd = inexact & ((bits & 1) == 0)
        toward_larger_magnitude = (error > 0) == (total > 0)
        bits = np.where(to_odd, bits + np.where(toward_larger_magnitude, 1, -1), bits)
        return bits.view(np.float64).astype(np.float32)


def _table_bit(table_words: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Bit ``index`` of a little-endian uint32 bitset.

    Args:
      table_words: the bitset as uint32 words.
      index: integer bit indices.

    Returns:
      0/1 values of index's shape (uint32).
    """
    return (table_words[index >> 5] >> (index & 31)) & 1


def _parity_table_index(bits: np.ndarray) -> np.ndarray:
    """Index of normal positive float32 bit patterns in the shared table:
    ``(1 - exponent parity) << 23 | mantissa``.

    Args:
      bits: uint32 bit patterns of positive normal float32 values.

    Returns:
      uint32 indices in [0, 2**24).
    """
    bits = np.asarray(bits, dtype=np.uint32)
    exponent_parity_flipped = ((bits >> MANTISSA_BITS) & 1) ^ 1
    return (exponent_parity_flipped << MANTISSA_BITS) | (bits & MANTISSA_MASK)


def sqrt_float32_numpy(x, table) -> np.ndarray:
    """torch.sqrt as modelled by ``table`` (a ``torch_compat.variant.SqrtTable``).

    IEEE sqrt, then the table's +-1 ulp corrections (the shared parity table, and the
    per-binade tables where ``table.binades`` has one); zeros, negatives and non-finite
    values keep numpy's IEEE result.

    Args:
      x: float32 values.
      table: the `SqrtTable` of the measured torch.

    Returns:
      float32 roots of x's shape.
    """
    x = np.asarray(x, np.float32)
    bits = x.view(np.uint32)
    with np.errstate(invalid="ignore"):
        root = np.sqrt(x)
    exponent = (bits >> MANTISSA_BITS).astype(np.int64)  # sign bit set -> > 255: never corrected
    positive_finite = (bits > 0) & (bits < EXPONENT_MASK)
    shared = positive_finite & (exponent > 0)
    index = np.where(shared, _parity_table_index(bits), 0)
    delta = _table_bit(table.above, index).astype(np.int32) - _table_bit(table.below, index).astype(np.int32)
    delta = np.where(shared, delta, 0)
    for binade in table.binades:
        here = positive_finite & (exponent == binade.exponent)
        if not here.any():
            continue
        mantissa = np.where(here, bits & MANTISSA_MASK, 0)
        own = _table_bit(binade.above, mantissa).astype(np.int32) - _table_bit(binade.below, mantissa).astype(np.int32)
        delta = np.where(here, own, delta)
    return (root.view(np.int32) + delta).view(np.float32)
