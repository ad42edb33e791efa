"""numpy float32 simulations of the GPU Adam kernels the GPU op models name (on CPU).

Nothing here ran on a GPU: the op sequences are read from torch's CUDA sources and
XLA:GPU's lowering (docs/gpu.md says what is measured and what is not).  Each kernel's
sequence is written once, as a function of an arithmetic object (the pattern of
`torch_compat.replay_kernel.adam_ops`), and `simulate_step` evaluates it in numpy float32
(IEEE, no flush to zero) with two kinds of freedom the real kernels leave open:

* ``fma``: nvcc contracts ``a*b + c`` into an FMA by default (``--fmad=true``) and XLA
  may; each contractible multiply-add is fused where ``fma`` is true (a bool, or a bool
  array per element: one compiled kernel fuses the same way for every element, so the
  audit draws it per case and uses the same choice for both updates).
* ``approx``: ``"nearest"`` rounds every approximate operation (``powf``, PTX
  ``div.full.f32``, libdevice sqrt, the one rounding after a double evaluation) to the
  float32 nearest its exact value; ``"adversarial"`` rounds each one, per element, to
  the float32 farthest from the exact value that its documented error still allows,
  above or below (or the nearest, 10%) as a salted hash of the value picks: a
  deterministic function of the operands, as a kernel is, so the same computation in
  both updates rounds alike, and differing ones independently.

Numerical contract
------------------
With ``fma=False`` and ``approx="nearest"`` the result is a deterministic function of
the inputs: every IEEE op is one correctly rounded float32 operation, every approximate
op the nearest float32 of its value computed in float64 (powf, division: relative error
``<= 2**-53`` before that rounding).  In the other modes every result lies within the
error the op model allows for it (`jaxguard.core.opmodel.GPU_KERNELS`), so the bound must
enclose whatever they produce.  Inputs outside float32's range give what IEEE gives
(inf, NaN); nothing is clipped.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from jaxguard.core.opmodel import GPU_OP_MODELS, gpu_kernel, is_decoupled, validate_hparams
from jaxguard.errors import ConfigError
from torch_compat.float32 import fma_float32_numpy

APPROX_MODES = ("nearest", "adversarial")


def _ulp32(x64: np.ndarray) -> np.ndarray:
    """The float32 ulp at the magnitude of the float64 values `x64` (subnormal ulp 2**-149)."""
    _, e = np.frexp(np.abs(x64))
    return np.ldexp(1.0, np.maximum(e - 1, -126) - 23)


class GpuArithmetic:
    """numpy float32 arithmetic with the GPU kernels' freedoms (module docstring).

    Args:
      fma: contract multiply-adds (bool or bool array broadcastable with the operands).
      approx: ``"nearest"`` or ``"adversarial"``.
      rng: a `numpy.random.Generator` (``"adversarial"`` only): it draws the salt of the
        hash that picks each rounding's side.
    """

    def __init__(self, *, fma=False, approx="nearest", rng=None, lerp_weight_below_half=True, pow_fn=None,
                 recip=False):
        if approx not in APPROX_MODES:
            raise ConfigError(f"approx={approx!r} is unknown; use one of {', '.join(APPROX_MODES)}")
        if approx == "adversarial" and rng is None:
            raise ConfigError("approx='adversarial' needs rng=numpy.random.default_rng(seed)")
        self.contract = fma
        self.approx_mode = approx
        self.rng = rng
        self.lerp_weight_below_half = lerp_weight_below_half
        self.pow_fn = pow_fn
        self.recip = recip
        self.salt = np.uint64(rng.integers(0, 2**63)) if rng is not None else np.uint64(0)

    @staticmethod
    def _f32(x):
        return np.asarray(x, np.float32)

    def add(self, a, b):
        """IEEE float32 ``a + b``.

        Args:
          a, b: float32 operands (broadcastable).
        """
        return self._f32(a) + self._f32(b)

    def sub(self, a, b):
        """IEEE float32 ``a - b``.

        Args:
          a, b: float32 operands.
        """
        return self._f32(a) - self._f32(b)

    def mul(self, a, b):
        """IEEE float32 ``a * b``.

        Args:
          a, b: float32 operands.
        """
        return self._f32(a) * self._f32(b)

    def div(self, a, b):
        """IEEE float32 ``a / b`` (nvcc's default ``--prec-div=true``).

        Args:
          a, b: float32 operands.
        """
        return self._f32(a) / self._f32(b)

    def neg(self, a):
        """``-a`` (exact).

        Args:
          a: a float32 operand.
        """
        return -self._f32(a)

    def sqrt(self, x):
        """IEEE float32 square root (nvcc's default ``--prec-sqrt=true``).

        Args:
          x: a float32 operand.
        """
        return np.sqrt(self._f32(x))

    def fma(self, a, b, c):
        """Correctly rounded float32 ``fma(a, b, c)`` (an explicit ``std::fma``).

        Args:
          a, b, c: float32 operands.
        """
        return fma_float32_numpy(a, b, c)

    def div_scalar(self, a, b):
        """``a / b`` for a host scalar `b`: true division, or (where `recip` is true) a
        multiply by the float32 reciprocal, as CUDA's scalar-division kernels may do.

        Args:
          a: float32 array; b: float32 scalar.
        """
        if self.recip is False:
            return self.div(a, b)
        by_recip = self.mul(a, self.div(np.float32(1), b))
        if self.recip is True:
            return by_recip
        return np.where(self.recip, by_recip, self.div(a, b)).astype(np.float32)

    def madd(self, a, b, c):
        """``a*b + c`` as the compiler may emit it: fused where `contract` is true.

        Args:
          a, b, c: float32 operands.
        """
        if self.contract is False:
            return self.add(self.mul(a, b), c)
        if self.contract is True:
            return self.fma(a, b, c)
        return np.where(self.contract, self.fma(a, b, c), self.add(self.mul(a, b), c)).astype(np.float32)

    def approx(self, x64, ulps):
        """An approximate op's float32 result from its (float64) value: the nearest float32,
        or (adversarial) per element the farthest float32 within `ulps` ulp of the value
        on a random side (or the nearest), never of the other sign; an exact zero stays
        zero.  ``ulps = 1`` picks one of the two float32 that bracket the value.

        Args:
          x64: the op's value (float64 array).
          ulps: its documented error bound in float32 ulp.

        Returns:
          float32 array.
        """
        x64 = np.asarray(x64, np.float64)
        near = x64.astype(np.float32)
        if self.approx_mode == "nearest":
            return near
        ulp = _ulp32(x64)
        # the side is a hash of the value: a kernel is a function of its operands, so the
        # same computation in both updates (torch-adamw's p * (1 - lr wd)) rounds alike
        with np.errstate(over="ignore"):
            h = (x64.view(np.uint64) ^ self.salt) * np.uint64(0x9E3779B97F4A7C15)
        up = (h >> np.uint64(63)) == 1
        keep_near = ((h >> np.uint64(40)) & np.uint64(1023)) < 102
        target = (x64 + np.where(up, 1.0, -1.0) * ulps * ulp).astype(np.float32)
        # one float32 step back toward the value where rounding the target overshot the allowance
        over = np.abs(target.astype(np.float64) - x64) > ulps * ulp
        target = np.where(over, np.nextafter(target, near), target)
        target = np.where(np.sign(target) == np.sign(x64), target, np.float32(0) * np.sign(x64).astype(np.float32))
        ok = np.isfinite(x64) & (x64 != 0) & ~keep_near
        return np.where(ok, target, near).astype(np.float32)

    def round64(self, x64):
        """A float64 evaluation rounded once to float32 (adversarial: either neighbour, a
        1-ulp allowance that also covers FMA contraction inside the double evaluation).

        Args:
          x64: the double result.
        """
        return self.approx(x64, 1.0)

    def div_approx(self, a, b, ulps):
        """float32 ``a / b`` within `ulps` ulp (PTX ``div.full.f32``: 2).

        Args:
          a, b: float32 operands.
          ulps: the error allowed.
        """
        return self.approx(np.asarray(a, np.float64) / np.asarray(b, np.float64), ulps)

    def sqrt_approx(self, x, ulps):
        """float32 sqrt within `ulps` ulp (0.5: IEEE).

        Args:
          x: a float32 operand.
          ulps: the error allowed.
        """
        if ulps <= 0.5:
            return self.sqrt(x)
        return self.approx(np.sqrt(np.asarray(x, np.float64)), ulps)

    def pow_approx(self, x, y, ulps):
        """float32 ``powf(x, y)`` within `ulps` ulp (CUDA's powf: documented 4, allowed 8);
        `pow_fn` (the device's own powf, bench/gpu_check.py) replaces it when given.

        Args:
          x, y: base and exponent (float32 scalars).
          ulps: the error allowed.
        """
        if self.pow_fn is not None:
            return np.float32(self.pow_fn(float(x), float(y)))
        return self.approx(np.power(np.asarray(x, np.float64), np.asarray(y, np.float64)), ulps)


class _GpuScalars(NamedTuple):
    """The hyperparameters as the kernel sees them (float32, or float64 for fused-f64)."""

    lr: object
    beta1: object
    beta2: object
    lerp_weight: object        # f32(1 - beta1)
    one_minus_beta2: object    # f32(1 - beta2)
    eps: object
    weight_decay: object
    decay_factor: object       # f32(1 - lr*wd): torch's single/foreach AdamW multiply
    neg_step_size: object      # f32(-lr/(1 - b1^t)), host double (single, foreach)
    bias_correction2_sqrt: object   # f32(bc2**0.5), host double (single, foreach)
    t: int


def _gpu_scalars(*, step, lr, betas, eps, weight_decay) -> _GpuScalars:
    """The host-side scalars, as torch's Python code forms them (the step is ``step + 1``)."""
    b1, b2 = float(betas[0]), float(betas[1])
    t = int(step) + 1
    bc1, bc2 = 1.0 - b1**float(t), 1.0 - b2**float(t)
    F = np.float32
    return _GpuScalars(lr=float(lr), beta1=b1, beta2=b2, lerp_weight=F(1 - b1), one_minus_beta2=F(1 - b2),
                      eps=float(eps), weight_decay=float(weight_decay), decay_factor=F(1 - lr * weight_decay),
                      neg_step_size=F(-(lr / bc1)), bias_correction2_sqrt=F(bc2**0.5), t=t)


# ---------------------------------------------------------------- the op sequences (written once)
def _lerp(ar, m, g, w):
    """ATen's Lerp.h: ``self + w*(end - self)`` for |w| < 0.5, else ``end - (end - self)*(1 - w)``."""
    diff = ar.sub(g, m)
    if ar.lerp_weight_below_half:
        return ar.madd(w, diff, m)
    return ar.madd(ar.neg(diff), ar.sub(np.float32(1), w), g)


def _torch_prologue(ar, p, g, s: _GpuScalars, decoupled):
    if s.weight_decay != 0 and decoupled:
        p = ar.mul(p, s.decay_factor)                      # param.mul_(1 - lr*wd)
    if s.weight_decay != 0 and not decoupled:
        g = ar.madd(np.float32(s.weight_decay), p, g)      # grad.add(param, alpha=wd)
    return p, g


def _torch_moments(ar, g, m, v, s: _GpuScalars):
    m_new = _lerp(ar, m, g, s.lerp_weight)                           # lerp_(grad, 1 - beta1)
    v_new = ar.madd(s.one_minus_beta2, ar.mul(g, g), ar.mul(v, np.float32(s.beta2)))   # mul_, addcmul_
    return m_new, v_new


def _ops_torch_single(ar, p, g, m, v, s: _GpuScalars, decoupled):
    """`_single_tensor_adam` on CUDA (capturable=False): the division by the host scalar
    ``bias_correction2_sqrt`` is a multiply by its float32 reciprocal (BinaryDivTrueKernel)."""
    p, g = _torch_prologue(ar, p, g, s, decoupled)
    m_new, v_new = _torch_moments(ar, g, m, v, s)
    inv_b = ar.div(np.float32(1), s.bias_correction2_sqrt)
    denom = ar.add(ar.mul(ar.sqrt(v_new), inv_b), np.float32(s.eps))
    p_new = ar.madd(s.neg_step_size, ar.div(m_new, denom), p)        # addcdiv: p + value*(m/denom)
    return p_new, m_new, v_new


def _ops_torch_foreach(ar, p, g, m, v, s: _GpuScalars, decoupled):
    """`_multi_tensor_adam` on CUDA, capturable=False: host-double bias corrections, true
    division by ``bc2**0.5`` (or, ``recip``, a multiply by its reciprocal), addcdiv
    ``p + step_size*(m/denom)``."""
    p, g = _torch_prologue(ar, p, g, s, decoupled)
    m_new, v_new = _torch_moments(ar, g, m, v, s)
    denom = ar.add(ar.div_scalar(ar.sqrt(v_new), s.bias_correction2_sqrt), np.float32(s.eps))
    p_new = ar.madd(s.neg_step_size, ar.div(m_new, denom), p)
    return p_new, m_new, v_new


def _device_bias(ar, beta, t, pow_ulps):
    """``1 - powf(beta, t)`` in float32 on the device (the step is a float32 tensor)."""
    return ar.sub(np.float32(1), ar.pow_approx(np.float32(beta), np.float32(t), pow_ulps))


def _ops_torch_foreach_capturable(ar, p, g, m, v, s: _GpuScalars, decoupled, pow_ulps):
    """`_multi_tensor_adam` on CUDA, capturable=True: ``_foreach_pow(beta, steps)``, sub 1,
    neg (bc2), div by lr, reciprocal (``-step_size``), sqrt (bc2), then
    ``p + m / ((sqrt(v)/bc2_sqrt + eps) / -step_size)``."""
    p, g = _torch_prologue(ar, p, g, s, decoupled)
    m_new, v_new = _torch_moments(ar, g, m, v, s)
    b1t = ar.pow_approx(np.float32(s.beta1), np.float32(s.t), pow_ulps)
    b2t = ar.pow_approx(np.float32(s.beta2), np.float32(s.t), pow_ulps)
    bc1 = ar.sub(b1t, np.float32(1))                              # beta1^t - 1 (negative)
    bc2 = ar.neg(ar.sub(b2t, np.float32(1)))                      # 1 - beta2^t
    neg_step = ar.div(np.float32(1), ar.div_scalar(bc1, np.float32(s.lr)))   # lr / (beta1^t - 1)
    bc2_sqrt = ar.sqrt(bc2)
    denom = ar.add(ar.div(ar.sqrt(v_new), bc2_sqrt), np.float32(s.eps))
    denom = ar.div(denom, neg_step)
    p_new = ar.madd(np.float32(1), ar.div(m_new, denom), p)       # addcdiv_ with value 1
    return p_new, m_new, v_new


def _ops_torch_fused_f64(ar, p, g, m, v, s: _GpuScalars, decoupled):
    """fused_adam_utils.cuh up to about torch 2.10: double hyperparameters, so the moment
    updates, ``step_size = lr/bc1`` and ``sqrt(v')/bc2_sqrt + eps`` are double
    expressions rounded once to float; ``param -= step_size*exp_avg/denom`` is float."""
    d = np.float64
    b1, b2, lr, wd, eps = s.beta1, s.beta2, s.lr, s.weight_decay, s.eps
    if wd != 0 and decoupled:
        p = ar.round64(d(1) * p - lr * wd * p.astype(d))            # param -= lr*wd*param
    if wd != 0 and not decoupled:
        g = ar.round64(g.astype(d) + p.astype(d) * wd)              # grad += param*wd
    g64 = g.astype(d)
    m_new = ar.round64(b1 * m.astype(d) + (1 - b1) * g64)
    v_new = ar.round64(b2 * v.astype(d) + (1 - b2) * g64 * g64)
    bc1 = 1 - b1 ** float(s.t)
    bc2_sqrt = math.sqrt(1 - b2 ** float(s.t))
    step_size = np.float32(lr / bc1)
    denom = ar.round64(ar.sqrt(v_new).astype(d) / bc2_sqrt + eps)
    p_new = ar.sub(p, ar.div(ar.mul(step_size, m_new), denom))
    return p_new, m_new, v_new


def _ops_torch_fused_f32(ar, p, g, m, v, s: _GpuScalars, decoupled, pow_ulps):
    """fused_adam_utils.cuh after pytorch PRs 172505/173224: float throughout,
    ``exp_avg = fma(b1, m, fma(-b1, g, g))``, ``exp_avg_sq = fma(b2, v, fma(-b2, g*g, g*g))``,
    bias corrections by powf from the float step."""
    F = np.float32
    b1, b2, lr, wd, eps = F(s.beta1), F(s.beta2), F(s.lr), F(s.weight_decay), F(s.eps)
    if s.weight_decay != 0 and decoupled:
        p = ar.madd(ar.neg(ar.mul(lr, wd)), p, p)                  # param -= lr*wd*param
    if s.weight_decay != 0 and not decoupled:
        g = ar.madd(p, wd, g)                                      # grad += param*wd
    m_new = ar.fma(b1, m, ar.fma(-b1, g, g))
    gg = ar.mul(g, g)
    v_new = ar.fma(b2, v, ar.fma(-b2, gg, gg))
    bc1 = _device_bias(ar, s.beta1, s.t, pow_ulps)
    bc2 = _device_bias(ar, s.beta2, s.t, pow_ulps)
    step_size = ar.div(lr, bc1)
    denom = ar.add(ar.div(ar.sqrt(v_new), ar.sqrt(bc2)), eps)
    p_new = ar.sub(p, ar.div(ar.mul(step_size, m_new), denom))
    return p_new, m_new, v_new


def _ops_optax_gpu(ar, p, g, m, v, s: _GpuScalars, decoupled, pow_ulps, div_ulps, sqrt_ulps):
    """optax ``scale_by_adam`` + ``add_decayed_weights`` + ``scale_by_learning_rate`` +
    ``apply_updates`` as XLA:GPU runs it: float32 ``decay**count`` by powf, divisions
    ``div.full.f32`` (2 ulp), sqrt through libdevice."""
    F = np.float32
    b1, b2 = F(s.beta1), F(s.beta2)
    mu = ar.madd(b1, m, ar.mul(s.lerp_weight, g))            # (1-b1) g + b1 mu
    nu = ar.madd(b2, v, ar.mul(s.one_minus_beta2, ar.mul(g, g)))
    bc1 = _device_bias(ar, s.beta1, s.t, pow_ulps)
    bc2 = _device_bias(ar, s.beta2, s.t, pow_ulps)
    mu_hat = ar.div_approx(mu, bc1, div_ulps)
    nu_hat = ar.div_approx(nu, bc2, div_ulps)
    upd = ar.div_approx(mu_hat, ar.add(ar.sqrt_approx(nu_hat, sqrt_ulps), F(s.eps)), div_ulps)
    if s.weight_decay != 0 and decoupled:
        upd = ar.madd(F(s.weight_decay), p, upd)             # u + wd p
    upd = ar.mul(upd, F(-s.lr))
    return ar.add(p, upd), mu, nu


def simulate_step(op_model, p, g, m, v, *, step, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                  fma=False, approx="nearest", rng=None, pow_fn=None, recip=False):
    """One Adam step of a GPU op model's kernel, simulated in numpy float32 (on CPU).

    Args:
      op_model: one of `jaxguard.core.opmodel.GPU_OP_MODELS`.
      p, g, m, v: float32 arrays of one shape (parameter, gradient, moments).
      step: the step count at the checkpoint (the update uses ``step + 1``).
      lr, betas, eps, weight_decay: the hyperparameters of the next update.
      fma: contract multiply-adds (bool, or a bool array per element).
      approx: ``"nearest"`` or ``"adversarial"`` (module docstring).
      rng: a `numpy.random.Generator`, for ``approx="adversarial"``.
      recip: foreach kernels: divide by a host scalar through its reciprocal (bool or
        bool array per element; not known from source which, so both are covered).
      pow_fn: ``pow_fn(base, exponent) -> float32``, the device's powf for the bias
        corrections (a bit-exact replay on a GPU feeds the device's value in).

    Returns:
      ``(p_new, m_new, v_new)``, float32 arrays.

    Raises:
      ConfigError: an op model that is not a GPU one, bad hyperparameters, non-float32
        arrays or an unknown mode.
    """
    kernel = gpu_kernel(op_model)
    if kernel is None:
        raise ConfigError(f"op_model={op_model!r} is not a GPU op model; use one of {', '.join(GPU_OP_MODELS)}")
    validate_hparams(lr, betas, eps, step, weight_decay, op_model)
    arrays = [np.asarray(x) for x in (p, g, m, v)]
    for name, x in zip("pgmv", arrays):
        if x.dtype != np.float32:
            raise ConfigError(f"{name} has dtype {x.dtype}; the GPU simulations are float32: pass float32 arrays")
    s = _gpu_scalars(step=step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    ar = GpuArithmetic(fma=fma, approx=approx, rng=rng, lerp_weight_below_half=bool(abs(s.lerp_weight) < 0.5),
                       pow_fn=pow_fn, recip=recip)
    decoupled = is_decoupled(op_model)
    impl = kernel.implementation
    extra = {"foreach-capturable": (kernel.pow_ulps,), "fused-f32": (kernel.pow_ulps,),
             "xla-gpu": (kernel.pow_ulps, kernel.div_ulps, kernel.sqrt_ulps)}.get(impl, ())
    fn = {"single": _ops_torch_single, "foreach": _ops_torch_foreach,
          "foreach-capturable": _ops_torch_foreach_capturable, "fused-f64": _ops_torch_fused_f64,
          "fused-f32": _ops_torch_fused_f32, "xla-gpu": _ops_optax_gpu}[impl]
    with np.errstate(all="ignore"):
        out = fn(ar, *arrays, s, decoupled, *extra)
    return tuple(np.asarray(x, np.float32) for x in out)


__all__ = ["APPROX_MODES", "GpuArithmetic", "simulate_step"]
