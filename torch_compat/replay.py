"""Bit-exact replay of torch's FP32 Adam/AdamW step on CPU in jitted JAX.

``adam_step(p, g, m, v, step=t, lr=...)`` returns what one
``torch.optim.Adam(foreach=False, fused=False)`` step (``AdamW`` with
``decoupled=True``) produces from ``state["step"] = t`` on CPU, bit for bit;
``implementation="foreach"`` (``foreach=True``) and ``implementation="fused"``
(``fused=True``, its vector body and scalar tail each with their own measured op
variant) replay torch's other two CPU implementations with the same op sequence,
parameterised by the variant (docs/replay.md). The contract below is the single-tensor
one; the others differ only in which ops are fused and in the sqrt (measured).

Numerical contract
------------------
Every torch kernel is one correctly rounded float32 operation, except that ``lerp_``,
``addcmul_`` and ``add(alpha=)`` are fused multiply-adds on the AVX2/AVX-512 ATen paths
and ``sqrt`` is MKL's ``vsSqrt`` (not correctly rounded). ``detect_variant()`` measures
which of these the installed torch does; the replay then evaluates, per coordinate::

    g'  = fma(f32(wd), p, g)                       # Adam with weight_decay only
    p0  = p * f32(1 - lr*wd)                       # AdamW with weight_decay only
    m'  = fma(f32(1-b1), g' - m, m)                # lerp, weight < 0.5 branch
    v'  = fma(f32(1-b2) * g', g', v * f32(b2))     # mul_ then addcmul_
    den = sqrt_torch(v') / f32(sqrt(1-b2^(t+1))) + f32(eps)
    p'  = p0 + (f32(-lr/(1-b1^(t+1))) * m') / den

with Python-double scalars rounded once to float32, as torch does. XLA on CPU would
contract products into FMAs, reassociate under fast math, turn divisions into
reciprocal multiplies and flush subnormals to zero. So every intermediate passes a
value-preserving barrier (bitcast, xor with a runtime zero, bitcast back), FMA is
emulated exactly with error-free transformations and a round-to-odd sum (float32
only; no float64, no global ``jax_enable_x64``), and ``sqrt_torch`` is the IEEE square
root corrected by the measured per-(exponent parity, mantissa) table. Coordinates where
any input or intermediate is zero-but-nonzero-sized in the subnormal sense or extreme
(``0 < |x| < 2^-60``, ``|x| >= 2^60``, NaN, Inf, or ``v < 0``) are recomputed by the
numpy model (IEEE, no flush to zero, float64 round-to-odd FMA), so the result is exact
for every input. Bit-exact means: same float32 bits in p, m and v, NaNs compared as NaN.

The jitted JAX kernel (the float32 emulation, `replay_flat`) is `torch_compat.replay_kernel`;
this module holds the numpy model, the entry points and the variant detection.
"""
from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np

from jaxguard.errors import ConfigError, UnsupportedOptimizerError
from torch_compat import calibrate
from torch_compat.variant import (
    IMPLEMENTATIONS,
    AdamVariant,
    FusedAdamVariant,
    ReplayFunctions,
    ReplayVariantWarning,
    SqrtTable,
    check_implementation,
    sqrt_table_for,
)
from torch_compat.float32 import fma_float32_numpy, sqrt_float32_numpy
from torch_compat.replay_kernel import (AdamScalars, adam_ops, adam_scalars, fma_float32_jax,  # noqa: F401
                                        pad_to_bucket, replay_flat)

__all__ = [
    "AdamVariant",
    "FusedAdamVariant",
    "IMPLEMENTATIONS",
    "ReplayVariantWarning",
    "TORCH_FLAGS",
    "adam_step",
    "detect_implementation_variant",
    "detect_variant",
    "numpy_adam_step",
    "textbook_adam_step",
    "torch_adam_step",
    "torch_adam_step_many",
    "AdamScalars",
    "adam_scalars",
]


def _check_hyperparameters(step, lr, betas, eps, weight_decay):
    if not (isinstance(step, (int, np.integer)) and step >= 0):
        raise ConfigError(f"step={step!r} must be a non-negative int (torch state['step'] before the update)")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ConfigError(f"betas={betas!r} must be a pair (beta1, beta2)")
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay), ("beta1", betas[0]), ("beta2", betas[1])):
        if not (isinstance(value, (float, int, np.floating)) and math.isfinite(value)):
            raise ConfigError(f"{name}={value!r} must be a finite Python float")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ConfigError(f"betas={betas!r} must lie in [0, 1), as torch.optim.Adam requires")
    if lr < 0 or eps < 0 or weight_decay < 0:
        raise ConfigError(f"lr={lr}, eps={eps}, weight_decay={weight_decay} must be >= 0, as torch.optim.Adam requires")


def _as_float32_arrays(p, g, m, v):
    arrays = []
    for name, x in zip(("p", "g", "m", "v"), (p, g, m, v)):
        x = np.asarray(x)
        if x.dtype != np.float32:
            raise UnsupportedOptimizerError(
                f"{name} has dtype {x.dtype}; the torch-adam replay is FP32 only: pass float32 arrays"
            )
        arrays.append(x)
    if len({x.shape for x in arrays}) != 1:
        raise ConfigError(f"p, g, m, v shapes {[x.shape for x in arrays]} differ; pass one tensor's four arrays")
    return arrays


class _NumpyArithmetic:
    def __init__(self, table: SqrtTable, lerp_weight_below_half: bool):
        self.table = table
        self.lerp_weight_below_half = lerp_weight_below_half

    @staticmethod
    def _f32(x):
        return np.asarray(x, np.float32)

    def add(self, a, b):
        return self._f32(a) + self._f32(b)

    def sub(self, a, b):
        return self._f32(a) - self._f32(b)

    def mul(self, a, b):
        return self._f32(a) * self._f32(b)

    def div(self, a, b):
        return self._f32(a) / self._f32(b)

    def neg(self, a):
        return -self._f32(a)

    def fma(self, a, b, c):
        return fma_float32_numpy(a, b, c)

    def sqrt(self, x):
        return sqrt_float32_numpy(x, self.table)


def _numpy_ops(p, g, m, v, scalars: AdamScalars, variant: AdamVariant, *, decoupled, has_weight_decay):
    arithmetic = _NumpyArithmetic(sqrt_table_for(variant), bool(scalars.lerp_weight < 0.5))
    with np.errstate(all="ignore"):
        return adam_ops(arithmetic, p, g, m, v, scalars, variant, decoupled=decoupled,
                         has_weight_decay=has_weight_decay)


def _implementation_variant(implementation: str, variant):
    """The variant to replay ``implementation`` with: the given one (checked) or the detected one."""
    check_implementation(implementation)
    if variant is None:
        return detect_implementation_variant(implementation)
    if (implementation == "fused") != isinstance(variant, FusedAdamVariant):
        raise ConfigError(f"variant is a {type(variant).__name__} but implementation={implementation!r}; pass "
                          "detect_implementation_variant(implementation) (a FusedAdamVariant for 'fused' only)")
    return variant


def _fused_tail(size: int, variant: FusedAdamVariant, tail_mask) -> np.ndarray:
    """Flat indices the fused kernel's scalar tail computes: the last ``size % width``
    elements of the tensor, or where ``tail_mask`` is true."""
    if tail_mask is None:
        return np.arange(size - size % variant.vector_width, size)
    tail_mask = np.asarray(tail_mask, bool).reshape(-1)
    if tail_mask.size != size:
        raise ConfigError(f"tail_mask has {tail_mask.size} elements for a tensor of {size}; pass one bool per element")
    return np.flatnonzero(tail_mask)


def numpy_adam_step(p, g, m, v, *, step, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False,
                    variant=None, implementation: str = "single", tail_mask=None):
    """The same model in numpy (float32 IEEE arithmetic, no flush to zero); slower, exact.

    Args:
      p, g, m, v: one tensor's float32 parameter, gradient and moments (same shape).
      step: torch's ``state["step"]`` before the update (bias corrections use ``step + 1``).
      lr, betas, eps, weight_decay, decoupled: the param group's hyperparameters
        (``decoupled=True``: AdamW).
      variant: the measured op variant (default: detected for `implementation`).
      implementation: ``"single"``, ``"foreach"`` or ``"fused"``, as in `adam_step`.
      tail_mask: fused only, as in `adam_step`.

    Returns:
      ``(p_new, m_new, v_new)`` as float32 numpy arrays of p's shape.

    Raises:
      ConfigError: bad hyperparameters, an unknown implementation or a variant of another one.
      UnsupportedOptimizerError: arrays that are not float32.
    """
    _check_hyperparameters(step, lr, betas, eps, weight_decay)
    p, g, m, v = _as_float32_arrays(p, g, m, v)
    variant = _implementation_variant(implementation, variant)
    scalars = adam_scalars(step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
                           implementation=implementation)
    options = dict(decoupled=decoupled, has_weight_decay=weight_decay != 0)
    if implementation != "fused":
        return _numpy_ops(p, g, m, v, scalars, variant, **options)
    shape = p.shape
    flat = [np.ascontiguousarray(x).reshape(-1) for x in (p, g, m, v)]
    outputs = [np.array(x).reshape(-1) for x in _numpy_ops(*flat, scalars, variant.body, **options)]
    tail = _fused_tail(p.size, variant, tail_mask)
    if tail.size:
        for out, value in zip(outputs, _numpy_ops(*(x[tail] for x in flat), scalars, variant.tail, **options)):
            out[tail] = value
    return tuple(x.reshape(shape) for x in outputs)


def adam_step(p, g, m, v, *, step, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False,
              variant=None, implementation: str = "single", tail_mask=None):
    """One torch FP32 Adam (``decoupled=True``: AdamW) step on CPU, bit-exact.

    Args:
        p, g, m, v: one tensor's float32 parameter, gradient and moments (same shape).
        step: torch's ``state["step"]`` before the update (bias corrections use ``step + 1``).
        lr, betas, eps, weight_decay, decoupled: the param group's hyperparameters.
        variant: the measured op variant; default ``detect_implementation_variant(implementation)``
            (torch is run once per process).
        implementation: ``"single"`` (``foreach=False, fused=False``), ``"foreach"``
            (``foreach=True``) or ``"fused"`` (``fused=True``), torch's CPU kernels.
        tail_mask: fused only: which elements the kernel's scalar tail computes (default:
            the last ``size % vector_width`` of the flattened tensor, as torch does for one
            tensor); the enclosure audit uses it to replay tail arithmetic on any coordinate.

    Returns:
        ``(p_new, m_new, v_new)`` as float32 numpy arrays of p's shape.

    Raises:
        ConfigError: bad hyperparameters, an unknown implementation or a variant of another one.
        UnsupportedOptimizerError: arrays that are not float32.
    """
    _check_hyperparameters(step, lr, betas, eps, weight_decay)
    p, g, m, v = _as_float32_arrays(p, g, m, v)
    variant = _implementation_variant(implementation, variant)
    fused = implementation == "fused"
    body = variant.body if fused else variant
    scalars = adam_scalars(step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
                           implementation=implementation)
    shape, size = p.shape, p.size
    flat = [np.ascontiguousarray(x).reshape(-1) for x in (p, g, m, v)]
    if size == 0:
        return tuple(np.empty(shape, np.float32) for _ in range(3))
    padded = [pad_to_bucket(x) for x in flat]
    *outputs, needs_numpy = replay_flat(*padded, scalars, body, decoupled=decoupled,
                                         has_weight_decay=weight_decay != 0)
    outputs = [np.array(x[:size]) for x in outputs]  # writable; jax buffers are read-only
    needs_numpy = np.array(needs_numpy[:size])
    tail = _fused_tail(size, variant, tail_mask) if fused else np.empty(0, np.int64)
    needs_numpy[tail] = False  # the tail is recomputed in numpy below, with its own variant
    options = dict(decoupled=decoupled, has_weight_decay=weight_decay != 0)
    for where, ops in ((np.flatnonzero(needs_numpy), body), (tail, variant.tail if fused else None)):
        if where.size:
            for out, value in zip(outputs, _numpy_ops(*(x[where] for x in flat), scalars, ops, **options)):
                out[where] = value
    return tuple(x.reshape(shape) for x in outputs)


def count_numpy_fallback(p, g, m, v, *, step, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                         decoupled=False, variant: AdamVariant | None = None) -> int:
    """How many coordinates ``adam_step`` hands to the numpy model (subnormal/extreme range).

    Args:
      p, g, m, v: one tensor's float32 parameter, gradient and moments (same shape).
      step: torch's ``state["step"]`` before the update (bias corrections use ``step + 1``).
      lr, betas, eps, weight_decay, decoupled: the param group's hyperparameters
        (``decoupled=True``: AdamW).
      variant: the single-tensor op variant (default: `detect_variant()`).

    Returns:
      The number of coordinates (int).

    Raises:
      UnsupportedOptimizerError: arrays that are not float32.
    """
    p, g, m, v = _as_float32_arrays(p, g, m, v)
    variant = variant or detect_variant()
    scalars = adam_scalars(step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, decoupled=decoupled)
    flat = [pad_to_bucket(np.ascontiguousarray(x).reshape(-1)) for x in (p, g, m, v)]
    *_, needs_numpy = replay_flat(*flat, scalars, variant, decoupled=decoupled, has_weight_decay=weight_decay != 0)
    return int(np.count_nonzero(np.asarray(needs_numpy)))


# torch.optim.Adam/AdamW keyword arguments that select each implementation
TORCH_FLAGS = {"single": dict(foreach=False, fused=False), "foreach": dict(foreach=True, fused=False),
               "fused": dict(foreach=False, fused=True)}


@functools.lru_cache(maxsize=16)
def _textbook_kernel(decoupled: bool):
    import jax
    import jax.numpy as jnp

    def step_fn(p, g, m, v, lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2):
        if decoupled:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - lr * (m / bias_correction1) / (jnp.sqrt(v / bias_correction2) + eps)
        return p, m, v

    return jax.jit(step_fn)


def textbook_adam_step(p, g, m, v, *, step, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
    """The plain float32 formula in jnp (jnp.sqrt, XLA's own rewrites): NOT bit-exact;
    kept as the negative control that shows the parity test can fail.

    Args:
      p, g, m, v: one tensor's float32 parameter, gradient and moments (same shape).
      step: torch's ``state["step"]`` before the update (bias corrections use ``step + 1``).
      lr, betas, eps, weight_decay, decoupled: the param group's hyperparameters
        (``decoupled=True``: AdamW).

    Returns:
      ``(p_new, m_new, v_new)`` as float32 numpy arrays.
    """
    p, g, m, v = _as_float32_arrays(p, g, m, v)
    t = step + 1
    args = [np.float32(x) for x in (lr, betas[0], betas[1], eps, weight_decay, 1 - betas[0] ** t, 1 - betas[1] ** t)]
    return tuple(np.asarray(x) for x in _textbook_kernel(bool(decoupled))(p, g, m, v, *args))


def torch_adam_step_many(params: Sequence, grads: Sequence, exp_avgs: Sequence, exp_avg_sqs: Sequence, *, step, lr,
                         betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False,
                         implementation: str = "single"):
    """Run the real ``torch.optim.Adam``/``AdamW`` on CPU for one step on separate tensors
    (so each keeps its own vector tail), with the flags of ``implementation`` (`TORCH_FLAGS`).

    Args:
      params, grads, exp_avgs, exp_avg_sqs: float32 arrays, one per tensor (copied).
      step: torch's ``state["step"]`` before the update (bias corrections use ``step + 1``).
      lr, betas, eps, weight_decay, decoupled: the param group's hyperparameters
        (``decoupled=True``: AdamW).
      implementation: ``"single"``, ``"foreach"`` or ``"fused"``.

    Returns:
      ``(params, exp_avgs, exp_avg_sqs)`` after the step: lists of float32 numpy arrays.

    Raises:
      ConfigError: bad hyperparameters or an unknown implementation.
    """
    import torch

    _check_hyperparameters(step, lr, betas, eps, weight_decay)
    tensors = [torch.from_numpy(np.array(p, np.float32, copy=True)) for p in params]
    optimizer_cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    optimizer = optimizer_cls(tensors, lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                              **TORCH_FLAGS[check_implementation(implementation)])
    for tensor, grad, m, v in zip(tensors, grads, exp_avgs, exp_avg_sqs):
        tensor.grad = torch.from_numpy(np.array(grad, np.float32, copy=True))
        optimizer.state[tensor] = {
            "step": torch.tensor(float(step)),
            "exp_avg": torch.from_numpy(np.array(m, np.float32, copy=True)),
            "exp_avg_sq": torch.from_numpy(np.array(v, np.float32, copy=True)),
        }
    with torch.no_grad():
        optimizer.step()
    states = [optimizer.state[t] for t in tensors]
    return ([t.detach().numpy() for t in tensors], [s["exp_avg"].numpy() for s in states],
            [s["exp_avg_sq"].numpy() for s in states])


def torch_adam_step(p, g, m, v, **hyperparameters):
    """``torch_adam_step_many`` for one tensor: returns ``(p_new, m_new, v_new)``.

    Args:
      p, g, m, v: one tensor's float32 parameter, gradient and moments.
      **hyperparameters: the keyword arguments of `torch_adam_step_many`.

    Returns:
      ``(p_new, m_new, v_new)`` as float32 numpy arrays.
    """
    ps, ms, vs = torch_adam_step_many([p], [g], [m], [v], **hyperparameters)
    return ps[0], ms[0], vs[0]


# The detection of the installed torch's variant (torch_compat.calibrate), handed this
# replay to check its candidates with.
_REPLAY = ReplayFunctions(adam_step=adam_step, numpy_adam_step=numpy_adam_step,
                          torch_adam_step_many=torch_adam_step_many)


def detect_variant(refresh: bool = False) -> AdamVariant:
    """Calibrate the installed torch's single-tensor Adam once per process.

    Args:
      refresh: measure again even if this process already did.

    Returns:
      the matching `AdamVariant`; on no match a ``ReplayVariantWarning``, ``matched=False``
      and the documented default model (every op fused, measured sqrt table when it is
      within 1 ulp, else IEEE).

    Raises:
      ConfigError: torch is not installed.
    """
    return calibrate.detect_variant(_REPLAY, refresh)


def detect_fused_variant(refresh: bool = False) -> FusedAdamVariant:
    """Measure torch's fused CPU Adam kernel (body, vector width, tail) once per process.

    Args:
      refresh: measure again even if this process already did.

    Returns:
      the `FusedAdamVariant` (``matched=False`` and a ``ReplayVariantWarning`` on no match).

    Raises:
      ConfigError: torch is not installed.
    """
    return calibrate.detect_fused_variant(_REPLAY, refresh)


def detect_foreach_variant(refresh: bool = False) -> AdamVariant:
    """Confirm torch's foreach=True CPU Adam end to end once per process.

    Args:
      refresh: measure again even if this process already did.

    Returns:
      the `AdamVariant` (``matched=False`` and a ``ReplayVariantWarning`` on no match).

    Raises:
      ConfigError: torch is not installed.
    """
    return calibrate.detect_foreach_variant(_REPLAY, refresh)


def detect_implementation_variant(implementation: str = "single"):
    """The measured variant of ``implementation``.

    Args:
      implementation: "single", "foreach" or "fused" (torch.optim.Adam's flags on CPU).

    Returns:
      an `AdamVariant` ("single", "foreach") or a `FusedAdamVariant` ("fused").

    Raises:
      ConfigError: an unknown implementation, or torch is not installed.
    """
    return calibrate.detect_implementation_variant(_REPLAY, implementation)
