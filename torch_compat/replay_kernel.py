"""The jitted JAX kernel of the replay: torch's Adam op sequence (`adam_scalars`,
`adam_ops`) over an arithmetic that emulates each float32 op bit for bit on the CPU
(`replay_flat`), coordinates outside the emulation's exact range left to numpy."""
from __future__ import annotations

__all__ = ['LOW_EXPONENT', 'HIGH_EXPONENT', 'VELTKAMP_SPLITTER', 'AdamScalars', 'adam_scalars', 'fma_float32_jax',
           'adam_ops', 'pad_to_bucket', 'replay_flat']

import functools
import math
from typing import NamedTuple

import numpy as np

from torch_compat.variant import AdamVariant, SqrtTable, sqrt_table_for
from jaxguard.core import floatbits
from torch_compat.float32 import MANTISSA_BITS


# A coordinate is replayed by the numpy model when any of its float32 values has a
# magnitude outside [2^-60, 2^60) (zero excepted). Inside that range every product,
# sum and error term of the emulation is a normal float32, so flushing cannot occur.
LOW_EXPONENT = 127 - 60
HIGH_EXPONENT = 127 + 60
VELTKAMP_SPLITTER = 4097.0  # 2^12 + 1 splits a 24-bit significand into two 12-bit halves


class AdamScalars(NamedTuple):
    """The float32 scalars the kernels see (torch's Python doubles, each rounded once)."""

    lerp_weight: object
    one_minus_lerp_weight: object
    beta2: object
    one_minus_beta2: object
    bias_correction2_sqrt: object
    eps: object
    neg_step_size: object
    weight_decay: object
    decay_factor: object


def adam_scalars(*, step, lr, betas, eps, weight_decay, decoupled, implementation="single") -> AdamScalars:
    """The float32 scalars torch's CPU kernels compute from the hyperparameters.

    torch computes them in Python doubles (``beta**step`` with the float32 step + 1, C's
    pow), and each is rounded to float32 once where the kernel takes it.

    Args:
      step: torch's ``state["step"]`` before the update.
      lr, betas, eps, weight_decay: the param group's hyperparameters.
      decoupled: AdamW (accepted for the callers' symmetry; the scalars are the same).
      implementation: ``"fused"`` takes ``std::sqrt`` of the bias correction, the others
        Python's ``** 0.5``.

    Returns:
      An `AdamScalars` of float32 values.
    """
    beta1, beta2 = betas
    # torch keeps state["step"] as a float32 tensor, adds 1 in float32, then .item()
    torch_step = float(np.float32(step) + np.float32(1.0))
    bias_correction1 = 1 - beta1**torch_step  # C's pow, in Python and in the fused kernel alike
    bias_correction2 = 1 - beta2**torch_step
    step_size = lr / bias_correction1
    # Python's ``x**0.5`` is libm pow (single, foreach); the fused kernel calls std::sqrt
    bias_correction2_sqrt = math.sqrt(bias_correction2) if implementation == "fused" else bias_correction2**0.5
    lerp_weight = np.float32(1 - beta1)
    f32 = np.float32
    return AdamScalars(*(
        lerp_weight,
        f32(1) - lerp_weight,  # lerp's weight >= 0.5 branch computes 1 - w in float32
        f32(beta2),
        f32(1 - beta2),
        f32(bias_correction2_sqrt),
        f32(eps),
        f32(-step_size),
        f32(weight_decay),
        f32(1 - lr * weight_decay),
    ))


def adam_ops(ar, p, g, m, v, s: AdamScalars, variant: AdamVariant, *, decoupled: bool, has_weight_decay: bool):
    """torch's Adam/AdamW step as its float32 op sequence, over an arithmetic: the one
    sequence the jitted kernel (`replay_flat`) and the numpy model both run.

    Numerical contract
    ------------------
    Each ``ar`` call is one torch float32 op (``add``, ``sub``, ``mul``, ``div``, ``neg``,
    ``fma``, ``sqrt``) in torch's order, with the fusions `variant` records; the result is
    bit for bit torch's wherever ``ar`` rounds each op as float32 does.

    Args:
      ar: the arithmetic (its ops, and ``lerp_weight_below_half``: which form torch's
        ``lerp`` takes).
      p, g, m, v: the parameter, gradient and moments (float32, as ``ar`` holds them).
      s: the step's float32 scalars (`adam_scalars`).
      variant: the op variant (which ops torch fuses into an FMA).
      decoupled: AdamW's decoupled weight decay (else Adam's L2 term).
      has_weight_decay: weight decay is nonzero.

    Returns:
      ``(p_new, m_new, v_new)``.
    """
    if has_weight_decay and decoupled:
        p = ar.mul(p, s.decay_factor)
    if has_weight_decay and not decoupled:
        g = ar.fma(s.weight_decay, p, g) if variant.add_alpha_fma else ar.add(g, ar.mul(s.weight_decay, p))
    diff = ar.sub(g, m)
    if ar.lerp_weight_below_half:
        m_new = ar.fma(s.lerp_weight, diff, m) if variant.lerp_fma else ar.add(m, ar.mul(s.lerp_weight, diff))
    else:
        m_new = (ar.fma(ar.neg(diff), s.one_minus_lerp_weight, g) if variant.lerp_fma
                 else ar.sub(g, ar.mul(diff, s.one_minus_lerp_weight)))
    scaled_g = ar.mul(s.one_minus_beta2, g)
    if variant.v_decay_fma:  # the fused kernel's scalar tail, as compiled: fma(v, b2, (c2*g)*g)
        v_new = ar.fma(v, s.beta2, ar.mul(scaled_g, g))
    else:
        v_decayed = ar.mul(v, s.beta2)
        v_new = ar.fma(scaled_g, g, v_decayed) if variant.addcmul_fma else ar.add(v_decayed, ar.mul(scaled_g, g))
    denom = ar.add(ar.div(ar.sqrt(v_new), s.bias_correction2_sqrt), s.eps)
    p_new = ar.add(p, ar.div(ar.mul(s.neg_step_size, m_new), denom))
    return p_new, m_new, v_new


def _jax():
    import jax
    import jax.numpy as jnp
    from jax import lax

    return jax, jnp, lax


class _JaxArithmetic:
    """Exact float32 arithmetic under XLA: each result passes a barrier the compiler
    cannot see through, so no FMA contraction, reassociation or reciprocal rewrite can
    span two operations. Every value is recorded in ``tracked`` for the range check."""

    def __init__(self, zero, sqrt_below, sqrt_above, lerp_weight_below_half: bool):
        _, self.jnp, self.lax = _jax()
        self.zero = zero
        self.sqrt_below, self.sqrt_above = sqrt_below, sqrt_above
        self.lerp_weight_below_half = lerp_weight_below_half
        self.tracked = []
        self.sqrt_inputs = []

    def hold(self, x):
        lax, jnp = self.lax, self.jnp
        return lax.bitcast_convert_type(lax.bitcast_convert_type(x, jnp.int32) ^ self.zero, jnp.float32)

    def _track(self, x):
        self.tracked.append(x)
        return x

    def _result(self, x):
        return self._track(self.hold(x))

    def add(self, a, b):
        return self._result(a + b)

    def sub(self, a, b):
        return self._result(a - b)

    def mul(self, a, b):
        return self._result(a * b)

    def div(self, a, b):
        return self._result(a / self.hold(b))

    def neg(self, a):
        return -a

    def _two_sum(self, a, b):
        h = self.hold
        total = h(a + b)
        b_virtual = h(total - a)
        a_virtual = h(total - b_virtual)
        error = h(h(a - a_virtual) + h(b - b_virtual))
        return total, error

    def _split(self, a):
        h = self.hold
        scaled = h(a * VELTKAMP_SPLITTER)
        high = h(scaled - h(scaled - a))
        return high, h(a - high)

    def _two_product(self, a, b):
        h = self.hold
        product = h(a * b)
        a_high, a_low = self._split(a)
        b_high, b_low = self._split(b)
        error = h(h(a_high * b_high) - product)
        error = h(error + h(a_high * b_low))
        error = h(error + h(a_low * b_high))
        error = h(error + h(a_low * b_low))
        return product, error

    def _round_to_odd_sum(self, a, b):
        lax, jnp = self.lax, self.jnp
        total, error = self._two_sum(a, b)
        total_bits = lax.bitcast_convert_type(total, jnp.int32)
        error_bits = lax.bitcast_convert_type(error, jnp.int32)
        to_odd = ((error_bits & 0x7FFFFFFF) != 0) & ((total_bits & 1) == 0)
        away_from_zero = (total_bits ^ error_bits) >= 0  # error has total's sign
        total_bits = jnp.where(to_odd, total_bits + jnp.where(away_from_zero, 1, -1), total_bits)
        return lax.bitcast_convert_type(total_bits, jnp.float32)

    def fma(self, a, b, c):
        # Boldo & Melquiond (2008): RN(a*b + c) from an exact product (ph + pl), an exact
        # sum (sh + sl) of c and ph, and one round-to-odd addition of the two low parts.
        a, b, c = (self.jnp.broadcast_to(x, self.zero.shape) for x in (a, b, c))
        product_high, product_low = self._two_product(a, b)
        self._track(product_high)
        sum_high, sum_low = self._two_sum(c, product_high)
        low = self._round_to_odd_sum(sum_low, product_low)
        return self._result(sum_high + low)

    def _table_bit(self, words, index):
        lax, jnp = self.lax, self.jnp
        word = jnp.take(words, lax.shift_right_logical(index, 5), mode="clip", unique_indices=False)
        return lax.shift_right_logical(word, index & 31) & 1

    def sqrt(self, x):
        lax, jnp = self.lax, self.jnp
        self.sqrt_inputs.append(x)
        root = self.hold(jnp.sqrt(x))
        if self.sqrt_below is None and self.sqrt_above is None:
            return self._track(root)
        bits = lax.bitcast_convert_type(x, jnp.int32)
        parity_flipped = (lax.shift_right_logical(bits, MANTISSA_BITS) & 1) ^ 1
        index = (parity_flipped << MANTISSA_BITS) | (bits & 0x7FFFFF)
        delta = jnp.zeros_like(bits)
        if self.sqrt_below is not None:
            delta = delta - self._table_bit(self.sqrt_below, index)
        if self.sqrt_above is not None:
            delta = delta + self._table_bit(self.sqrt_above, index)
        correctable = (bits > 0) & (bits < 0x7F800000)
        root_bits = lax.bitcast_convert_type(root, jnp.int32)
        root = lax.bitcast_convert_type(jnp.where(correctable, root_bits + delta, root_bits), jnp.float32)
        return self._track(root)


def _outside_exact_range(x):
    """0 < |x| < 2^-60, |x| >= 2^60, Inf or NaN, read from the bits (immune to flushing)."""
    b = floatbits.device.bits(x)
    exponent = floatbits.exponent_bits(b)
    return ~floatbits.zero_bits(b) & ((exponent < LOW_EXPONENT) | (exponent >= HIGH_EXPONENT))


@functools.lru_cache(maxsize=64)
def _compiled_kernel(variant: AdamVariant, use_below: bool, use_above: bool, decoupled: bool,
                     has_weight_decay: bool, lerp_weight_below_half: bool, own_binades: tuple = ()):
    jax, jnp, lax = _jax()

    def kernel(p, g, m, v, scalars, zero, sqrt_below, sqrt_above):
        # A zero the compiler cannot know, different per element (no scalar hoisting) and
        # never a constant: with plain iota & zero, element 0 is a known 0 once unrolled.
        per_element_zero = (lax.iota(jnp.int32, p.shape[0]) | 1) & zero
        arithmetic = _JaxArithmetic(per_element_zero, sqrt_below if use_below else None,
                                    sqrt_above if use_above else None, lerp_weight_below_half)
        named = AdamScalars(*(scalars[i] for i in range(len(AdamScalars._fields))))
        p_new, m_new, v_new = adam_ops(arithmetic, p, g, m, v, named, variant, decoupled=decoupled,
                                        has_weight_decay=has_weight_decay)
        needs_numpy = v < 0
        for x in (p, g, m, v, *arithmetic.tracked):
            needs_numpy = needs_numpy | _outside_exact_range(x)
        for x in arithmetic.sqrt_inputs:  # binades with a table of their own: the numpy model has it
            exponent = floatbits.device.bits(x) >> MANTISSA_BITS   # sign bit kept: negatives match no binade
            for binade in own_binades:
                needs_numpy = needs_numpy | (exponent == binade)
        return p_new, m_new, v_new, needs_numpy

    return jax.jit(kernel)


def fma_float32_jax(a, b, c, zero):
    """Correctly rounded float32 ``fma(a, b, c)`` under XLA: the jittable twin of
    `torch_compat.float32.fma_float32_numpy`, the one the replay kernel uses.

    Built from barriered float32 operations (exact product, TwoSum, one round-to-odd
    addition: Boldo & Melquiond 2008), so XLA can neither contract nor reassociate it.

    Args:
      a, b, c: float32 jax arrays (broadcast to ``zero``'s shape).
      zero: an int32 array of zeros XLA cannot see through (e.g. a traced argument, or
        ``iota & traced_zero``), one per element; its shape is the result's.

    Returns:
      float32 ``RN(a * b + c)``, bit for bit the numpy model's.
    """
    return _JaxArithmetic(zero, None, None, True).fma(a, b, c)


@functools.lru_cache(maxsize=8)
def _device_table(table: SqrtTable):
    _, jnp, _ = _jax()
    return jnp.asarray(table.below.view(np.int32)), jnp.asarray(table.above.view(np.int32))


def replay_flat(p, g, m, v, scalars: AdamScalars, variant: AdamVariant, *, decoupled, has_weight_decay):
    """The jitted replay kernel on flat float32 arrays, without the numpy fallback.

    Args:
      p, g, m, v: 1-D float32 arrays of one length (`adam_step` pads it with
        `_bucket_length`).
      scalars: the step's `AdamScalars` (`adam_scalars`).
      variant: the op variant of the kernel body (for fused: ``variant.body``).
      decoupled: AdamW's decoupled weight decay.
      has_weight_decay: whether weight decay is nonzero.

    Returns:
      ``(p_new, m_new, v_new, needs_numpy)`` as jax arrays: the updates, bit-exact
      except where the bool mask ``needs_numpy`` is set (subnormal/extreme range, which
      `adam_step` recomputes with the numpy model).
    """
    _, jnp, _ = _jax()
    table = sqrt_table_for(variant)
    below, above = _device_table(table)
    inner_binades = tuple(e for e in table.own_binades if LOW_EXPONENT <= e < HIGH_EXPONENT)
    kernel = _compiled_kernel(variant, bool(table.below.any()), bool(table.above.any()), bool(decoupled),
                              bool(has_weight_decay), bool(scalars.lerp_weight < 0.5), inner_binades)
    return kernel(p, g, m, v, jnp.asarray(np.array(scalars, np.float32)), jnp.int32(0), below, above)


def _bucket_length(n: int) -> int:
    """Lengths are padded to one of four sizes per octave (at most 25% padding), so a model
    with many tensor sizes compiles a few kernels, not one per size.

    Args:
      n: the flat tensor length.

    Returns:
      The padded length: 1024 for ``n <= 1024``, else ``n`` rounded up to a multiple of
      ``2**(bit_length(n) - 3)``.
    """
    if n <= 1024:
        return 1024
    quantum = 1 << (n.bit_length() - 3)
    return -(-n // quantum) * quantum


def pad_to_bucket(x: np.ndarray) -> np.ndarray:
    """`x` zero-padded to its bucket length, so the jitted kernel compiles one program per
    bucket rather than per size.

    Args:
      x: a flat float32 array.

    Returns:
      `x` itself when its size is a bucket length, else a padded copy.
    """
    # zero padding is inert: p = g = m = v = 0 stays 0 and never needs the numpy model
    return np.pad(x, (0, _bucket_length(x.size) - x.size)) if x.size != _bucket_length(x.size) else x
