"""Float32 classification read from the bit pattern, one classifier per backend.

The guard classifies moments on their integer bits, never with float compares: XLA on
CPU flushes subnormals to zero and may rewrite a bit test into a float compare, which
would call a subnormal zero.  The predicates are written once, on ``uint32`` bit
patterns (``&``, ``>>`` and ``==`` mean the same in numpy and jax.numpy), and each
backend only says how it gets the bits:

* `host` (numpy; importing this module does not import JAX): ``host.finite(x)``, ...
* `device` (jax.numpy, jittable): ``device.finite(x)``, ...; ``device.bits(x, z)`` XORs
  the bits with ``z``, an opaque zero (``lax.optimization_barrier``) so that XLA can
  neither fold nor fuse across the bit test (`jaxguard.core.jit_encode`).

Numerical contract
------------------
For every float32 bit pattern both backends return the same booleans
(tests/core/test_floatbits.py: every exponent with edge mantissas, and 1M random patterns):
``finite`` (not Inf/NaN), ``zero`` (+0.0 and -0.0), ``negative`` (sign bit set and not
zero: negative subnormals and -Inf included, NaNs with the sign bit included),
``subnormal`` (exponent field 0, mantissa nonzero, either sign), ``tiny`` (nonzero with
magnitude below ``TINY_MOMENT = 2**-80``: the subnormals included; NaN and Inf are not
tiny) and ``not_tiny`` (zero, or magnitude >= ``2**-80``, or non-finite).
"""
from __future__ import annotations

__all__ = ["TINY_MOMENT", "zero_bits", "exponent_bits", "host", "device", "device_positive_finite",
           "opaque_zero", "barrier"]

import numpy as np

EXPONENT_MASK = 0x7F800000
MAGNITUDE_MASK = 0x7FFFFFFF
MANTISSA_MASK = 0x007FFFFF
MANTISSA_BITS = 23
TINY_MOMENT = 2.0**-80      # nonzero moments below this are never certified (bound.TINY_MOMENT)
TINY_BITS = int(np.float32(TINY_MOMENT).view(np.uint32))


# ---------------------------------------------------------------- on bit patterns (both backends)
def finite_bits(b):
    """Not Inf or NaN: the exponent field is not all ones.

    Args:
      b: uint32 bit patterns of float32 values (numpy or jax.numpy array, any shape).

    Returns:
      A bool array of b's shape.
    """
    return (b & EXPONENT_MASK) != EXPONENT_MASK


def zero_bits(b):
    """+0.0 or -0.0: the magnitude bits are all zero.

    Args:
      b: uint32 bit patterns of float32 values (numpy or jax.numpy array, any shape).

    Returns:
      A bool array of b's shape.
    """
    return (b & MAGNITUDE_MASK) == 0


def negative_bits(b):
    """Sign bit set and not a zero (negative subnormals, -Inf and NaNs with the sign
    bit included).

    Args:
      b: uint32 bit patterns of float32 values (numpy or jax.numpy array, any shape).

    Returns:
      A bool array of b's shape.
    """
    return ((b >> 31) == 1) & ~zero_bits(b)


def subnormal_bits(b):
    """Exponent field 0 and mantissa nonzero (either sign).

    Args:
      b: uint32 bit patterns of float32 values (numpy or jax.numpy array, any shape).

    Returns:
      A bool array of b's shape.
    """
    return ((b & EXPONENT_MASK) == 0) & ((b & MANTISSA_MASK) != 0)


def tiny_bits(b):
    """Nonzero with magnitude below 2**-80 (an integer compare: nothing is flushed).

    Args:
      b: uint32 bit patterns of float32 values (numpy or jax.numpy array, any shape).

    Returns:
      A bool array of b's shape; NaN and Inf are not tiny.
    """
    return ~zero_bits(b) & ((b & MAGNITUDE_MASK) < TINY_BITS)


def not_tiny_bits(b):
    """The complement of `tiny_bits`: zero, magnitude >= 2**-80, or not finite.

    Args:
      b: uint32 bit patterns of float32 values (numpy or jax.numpy array, any shape).

    Returns:
      A bool array of b's shape.
    """
    return ~tiny_bits(b)


def exponent_bits(b):
    """The biased exponent field (0 for zeros and subnormals, 255 for Inf/NaN).

    Args:
      b: uint32 bit patterns of float32 values (numpy or jax.numpy array, any shape).

    Returns:
      An unsigned integer array of b's shape, values 0..255.
    """
    return (b & MAGNITUDE_MASK) >> MANTISSA_BITS


# ---------------------------------------------------------------- backends
class Classifier:
    """The predicates above on values of one backend; `bits` turns values into uint32."""

    def __init__(self, bits):
        self.bits = bits

    def finite(self, x, *z):
        """`finite_bits` on the bits of `x`: not Inf or NaN.

        Args:
          x: values convertible to float32 (this backend's arrays or scalars).
          *z: `device` only: an optional uint32 opaque zero (`opaque_zero`) XORed into the
            bits so XLA cannot fold the test into a float compare.

        Returns:
          A bool array of x's shape (numpy for `host`, jax for `device`).
        """
        return finite_bits(self.bits(x, *z))

    def zero(self, x, *z):
        """`zero_bits` on the bits of `x`: +0.0 or -0.0.

        Args:
          x, *z: as `finite`.

        Returns:
          A bool array of x's shape.
        """
        return zero_bits(self.bits(x, *z))

    def negative(self, x, *z):
        """`negative_bits` on the bits of `x`: sign bit set and not a zero.

        Args:
          x, *z: as `finite`.

        Returns:
          A bool array of x's shape.
        """
        return negative_bits(self.bits(x, *z))

    def subnormal(self, x, *z):
        """`subnormal_bits` on the bits of `x`: exponent field 0, mantissa nonzero.

        Args:
          x, *z: as `finite`.

        Returns:
          A bool array of x's shape.
        """
        return subnormal_bits(self.bits(x, *z))

    def tiny(self, x, *z):
        """`tiny_bits` on the bits of `x`: nonzero with magnitude below 2**-80.

        Args:
          x, *z: as `finite`.

        Returns:
          A bool array of x's shape.
        """
        return tiny_bits(self.bits(x, *z))

    def not_tiny(self, x, *z):
        """`not_tiny_bits` on the bits of `x`: zero, magnitude >= 2**-80, or not finite.

        Args:
          x, *z: as `finite`.

        Returns:
          A bool array of x's shape.
        """
        return not_tiny_bits(self.bits(x, *z))


def _host_bits(x):
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def _device_bits(x, z=None):
    import jax
    import jax.numpy as jnp

    b = jax.lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float32), jnp.uint32)
    return b if z is None else b ^ z


host = Classifier(_host_bits)
device = Classifier(_device_bits)


def device_positive_finite(x):
    """Finite and > 0, positive subnormals included, for float32 `x` inside a jitted program.

    Tested as ``0 < int32 bits < bits(+inf)``: this form survives XLA's rewrites; the
    masked-unsigned test, once fused into a proposal, came out False for subnormals.

    Args:
      x: float32 values (jax array or anything `jnp.asarray` takes).

    Returns:
      A bool jax array of x's shape.
    """
    import jax
    import jax.numpy as jnp

    b = jax.lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.float32), jnp.int32)
    return (b > 0) & (b < EXPONENT_MASK)


def opaque_zero():
    """A uint32 zero XLA cannot see through (pass it as `z` to `device.bits`)."""
    import jax
    import jax.numpy as jnp

    return jax.lax.optimization_barrier(jnp.uint32(0))


def barrier(x, z):
    """`x` unchanged (float32), routed through an integer XOR with the opaque zero `z`, so
    XLA cannot fold or fuse its rounding into what follows.

    Args:
      x: float32 values (jax array or anything `jnp.asarray` takes).
      z: the uint32 opaque zero from `opaque_zero`.

    Returns:
      A float32 jax array bit-identical to `x`.
    """
    import jax
    import jax.numpy as jnp

    return jax.lax.bitcast_convert_type(device.bits(x, z), jnp.float32)
