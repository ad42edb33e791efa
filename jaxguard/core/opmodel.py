"""FP32 Adam/AdamW operation models: the update the guarantee is stated against.

An operation model is a named, versioned value.  It fixes the float32 constants a
framework feeds into its kernels and which op-order family its native update follows;
`jaxguard.core.bound` turns those into the per-coordinate certificate.

Numerical contract
------------------
`step_constants` returns the constants of the *next* update after a checkpoint at step
count ``t`` (bias corrections at ``t + 1``), as the framework rounds them:

* ``torch-adam``/``torch-adamw`` (and their ``-foreach``/``-fused`` implementations,
  same constants): Python doubles rounded once to float32 when they enter a kernel:
  ``a = f32(1-b1)``, ``keep = 1 - a`` (lerp's real weight on m),
  ``b2f = f32(b2)``, ``c2 = f32(1-b2)``, ``S = f32(lr / (1-b1**(t+1)))``,
  ``B = f32(sqrt(1-b2**(t+1)))``; update ``p + (-S*m')/(sqrt(v')/B + eps)``.
* ``optax-adam``/``optax-adamw``: ``m' = f32(1-b1) g + f32(b1) m`` so ``keep = f32(b1)``;
  bias corrections computed in float32 by XLA's ``pow``; the update is
  ``p + -lr * (m'/bc1) / (sqrt(v'/bc2) + eps)`` (+ ``-lr*wd*p`` inside the update for
  adamw).  `S` and `B` here are computed in double from the float32 betas;
  ``const_rel`` bounds their relative gap to optax's float32 ``pow`` values (4 ulp
  allowed, 0.70 measured), which the native allowance in `jaxguard.core.bound` adds.

* GPU op models (`GPU_OP_MODELS`: ``torch-adam[w]-cuda``, ``-cuda-foreach``,
  ``-cuda-foreach-capturable``, ``-cuda-fused-f64``, ``-cuda-fused-f32``,
  ``optax-adam[w]-gpu``; read from source, simulated on CPU, not measured on a GPU:
  docs/gpu.md): host-constant kernels take the torch constants above (fused-f64 its
  double betas); device-constant ones (capturable, fused-f32, XLA:GPU) form
  ``1 - powf(f32(b), t)`` in float32, so `S`, `B` are exact from the float32 betas and
  ``const_rel`` covers powf's 8 ulp and the roundings after it (docs/bound.md, section
  9); they keep the step in float32 and refuse ``step + 1 >= 2**24``.
  `resolve_op_model` picks the model as torch's ``_default_to_fused_or_foreach`` does;
  `resolve_optax_op_model` by the platform the optax state's arrays live on.

The bit-exact replay of torch's update (and the textbook one that fails it) live in
torch_compat.replay; the GPU kernels' simulations in torch_compat.gpu_sim.
"""
from __future__ import annotations

__all__ = ["TORCH_OP_MODELS", "CPU_OP_MODELS", "GPU_OP_MODELS", "OP_MODELS", "gpu_kernel", "is_decoupled",
           "torch_op_model", "split_torch_op_model", "StepConstants", "f32", "validate_hparams",
           "step_constants", "resolve_op_model", "GPU_PLATFORMS", "OPTAX_OP_MODELS", "resolve_optax_op_model",
           "stage2_budget"]

import dataclasses
import functools
import math
import numbers

import numpy as np

from jaxguard.errors import ConfigError

# torch's three CPU implementations of one update: single-tensor (foreach=False,
# fused=False), foreach=True and fused=True. Their float32 constants agree (the fused
# kernel takes sqrt(1-b2**t) from std::sqrt instead of pow(., 0.5): within CONST_REL);
# their op orders differ, and the bound's native allowance covers each (audited per
# implementation against its own bit-exact replay, docs/replay.md).
TORCH_IMPLEMENTATIONS = {"single": "", "foreach": "-foreach", "fused": "-fused"}
TORCH_OP_MODELS = tuple(base + suffix for suffix in TORCH_IMPLEMENTATIONS.values()
                        for base in ("torch-adam", "torch-adamw"))
CPU_OP_MODELS = ("torch-adam", "torch-adamw", "optax-adam", "optax-adamw") + TORCH_OP_MODELS[2:]


@dataclasses.dataclass(frozen=True)
class GpuKernel:
    """One GPU kernel family an op model names (simulated on CPU: docs/gpu.md).

    framework: ``"torch"`` or ``"optax"``; implementation: torch's ``"single"``,
    ``"foreach"``, ``"foreach-capturable"``, ``"fused-f64"`` (fused_adam_utils.cuh up to
    about torch 2.10: moments and step size in double, rounded once) or ``"fused-f32"``
    (after pytorch PRs 172505/173224: float, explicit FMA), or ``"xla-gpu"`` for optax;
    device_constants: the bias corrections are formed on the device in float32 from a
    float32 step with ``powf`` (so the betas enter as float32 and the step must stay
    below 2**24); pow_ulps, div_ulps, sqrt_ulps: the error allowed for the device's
    ``powf``, its float32 division and its sqrt (0.5 = IEEE, correctly rounded).
    """

    framework: str
    implementation: str
    device_constants: bool
    pow_ulps: float = 0.0
    div_ulps: float = 0.5
    sqrt_ulps: float = 0.5


# CUDA's math API documents powf within 4 ulp (not measured here: docs/gpu.md); allowed 8.
# PTX's div.full.f32 (XLA:GPU's float division) is documented within 2 ulp.
CUDA_POWF_ULPS = 8.0
DIV_FULL_ULPS = 2.0
GPU_KERNELS = {
    "cuda": GpuKernel("torch", "single", False),
    "cuda-foreach": GpuKernel("torch", "foreach", False),
    "cuda-foreach-capturable": GpuKernel("torch", "foreach-capturable", True, CUDA_POWF_ULPS),
    "cuda-fused-f64": GpuKernel("torch", "fused-f64", False),
    "cuda-fused-f32": GpuKernel("torch", "fused-f32", True, CUDA_POWF_ULPS),
    "gpu": GpuKernel("optax", "xla-gpu", True, CUDA_POWF_ULPS, DIV_FULL_ULPS, 2.0),
}
# torch-adam-cuda, torch-adamw-cuda-foreach, ..., optax-adam-gpu, optax-adamw-gpu: the CPU
# name plus the kernel's suffix (torch-adam* / torch-adamw* prefixes keep their meaning)
GPU_OP_MODELS = {f"{base}-{suffix}": kernel for suffix, kernel in GPU_KERNELS.items()
                 for base in (("torch-adam", "torch-adamw") if kernel.framework == "torch"
                              else ("optax-adam", "optax-adamw"))}
OP_MODELS = CPU_OP_MODELS + tuple(GPU_OP_MODELS)
DEVICE_STEP_LIMIT = 2**24    # a float32 step counter stops counting here


def gpu_kernel(op_model: str):
    """The `GpuKernel` of a GPU op model, or None for a CPU one.

    Args:
      op_model: an op model name.

    Returns:
      A `GpuKernel` (``op_model in GPU_OP_MODELS``) or None.
    """
    return GPU_OP_MODELS.get(op_model)


def is_decoupled(op_model: str) -> bool:
    """True for the AdamW op models (decoupled weight decay), CPU or GPU.

    Args:
      op_model: one of `OP_MODELS`.

    Returns:
      Whether the name is an ``-adamw`` model.
    """
    return op_model.startswith(("torch-adamw", "optax-adamw"))


def torch_op_model(*, decoupled: bool, implementation: str = "single") -> str:
    """The op model name of torch's Adam (``decoupled``: AdamW) run by ``implementation``.

    Args:
      decoupled: True for ``torch.optim.AdamW`` (decoupled weight decay).
      implementation: ``"single"``, ``"foreach"`` or ``"fused"`` (torch's CPU kernels).

    Returns:
      e.g. ``"torch-adam"``, ``"torch-adamw-fused"``.

    Raises:
      ConfigError: an unknown implementation.
    """
    if implementation not in TORCH_IMPLEMENTATIONS:
        raise ConfigError(f"implementation={implementation!r} is unknown; "
                          f"use one of {', '.join(TORCH_IMPLEMENTATIONS)}")
    return ("torch-adamw" if decoupled else "torch-adam") + TORCH_IMPLEMENTATIONS[implementation]


def split_torch_op_model(op_model: str) -> tuple:
    """``(decoupled, implementation)`` of a torch op model name, e.g. ("torch-adamw-fused").

    Args:
      op_model: one of `TORCH_OP_MODELS`.

    Returns:
      ``(decoupled: bool, implementation: str)``, the inverse of `torch_op_model`.

    Raises:
      ConfigError: not a torch op model.
    """
    for implementation, suffix in TORCH_IMPLEMENTATIONS.items():
        for base in ("torch-adam", "torch-adamw"):
            if op_model == base + suffix:
                return base == "torch-adamw", implementation
    raise ConfigError(f"op_model={op_model!r} is not a torch op model; use one of {', '.join(TORCH_OP_MODELS)}")


@dataclasses.dataclass(frozen=True)
class StepConstants:
    """Constants of one Adam step (Python floats holding float32 values)."""

    op_model: str
    lr: float
    keep: float      # weight of m in m' (real number)
    a: float         # weight of g in m'
    b2f: float       # weight of v in v'
    c2: float        # weight of g*g in v'
    S: float         # step size lr / (1 - b1**(t+1))
    B: float         # sqrt(1 - b2**(t+1))
    eps: float
    weight_decay: float
    decay_in_update: bool   # optax-adamw: -lr*wd*p is added inside the update
    coupled_decay: bool     # torch-adam with weight_decay: g += wd * p
    const_rel: float = 2.0**-20   # bound on the relative gap between S, B here and the framework's

    def to_json(self):
        """The constants as a JSON-ready dict (field name -> value)."""
        return dataclasses.asdict(self)


def f32(x: float) -> float:
    """`x` rounded to the nearest float32, as a Python float.

    Args:
      x: a real number.

    Returns:
      ``float(np.float32(x))`` (+-inf where it overflows float32; no warning).
    """
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def validate_hparams(lr, betas, eps, step, weight_decay=0.0, op_model=None):
    """Check the next update's hyperparameters once, in float32 as the frameworks use them.

    Args:
      lr: learning rate of the next update.
      betas: ``(beta1, beta2)``.
      eps: Adam's epsilon.
      step: the optimizer's step count at the checkpoint (int >= 0).
      weight_decay: the weight decay (>= 0).
      op_model: the op model name, or None (the optax beta check is skipped).

    Raises:
      ConfigError: (one line naming the value and the fix) for a non-number or non-finite
        value, ``lr``/``eps`` that are not > 0 in float32, negative ``weight_decay``,
        betas outside [0, 1) x (0, 1), for the optax op models a beta that rounds to 1.0
        in float32 (optax's ``1 - b**t`` would be 0), or a step that is not an int >= 0.
    """
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ConfigError(f"betas={betas!r} must be a pair (beta1, beta2); use e.g. (0.9, 0.999)")
    b1, b2 = betas
    for name, val in (("lr", lr), ("eps", eps), ("beta1", b1), ("beta2", b2), ("weight_decay", weight_decay)):
        if isinstance(val, bool) or not isinstance(val, numbers.Real) or not math.isfinite(float(val)):
            raise ConfigError(f"{name}={val!r} is not a finite number; pass a float")
        if not math.isfinite(f32(val)):
            raise ConfigError(f"{name}={val!r} overflows float32 (the frameworks use it in float32); pass a value "
                              "below 3.4e38")
    if lr <= 0 or f32(lr) == 0:
        raise ConfigError(f"lr={lr!r} must be > 0 in float32; pass the learning rate of the next update")
    if not (0.0 <= b1 < 1.0 and 0.0 < b2 < 1.0):
        raise ConfigError(f"betas={tuple(betas)!r} must lie in [0, 1); use e.g. (0.9, 0.999)")
    kernel = gpu_kernel(op_model) if op_model is not None else None
    if op_model is not None and (op_model.startswith("optax") or (kernel is not None and kernel.device_constants)):
        for name, b in (("beta1", b1), ("beta2", b2)):
            if f32(b) == 1.0:
                raise ConfigError(f"{name}={b!r} rounds to 1.0 in float32, so {op_model}'s float32 1 - {name}**t is 0 "
                                  "(a division by zero); use a beta <= 0.99999994")
    if eps <= 0 or f32(eps) == 0:
        raise ConfigError(f"eps={eps!r} must be > 0 in float32 (the update divides by sqrt(v) + eps); use e.g. 1e-8")
    if weight_decay < 0:
        raise ConfigError(f"weight_decay={weight_decay!r} must be >= 0")
    if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
        raise ConfigError(f"step={step!r} must be an integer >= 0 (the optimizer's step count at the checkpoint)")
    if kernel is not None and kernel.device_constants and step + 1 >= DEVICE_STEP_LIMIT:
        raise ConfigError(f"step={step!r}: {op_model} keeps the step in float32 on the device, which stops counting "
                          f"at 2**24; certify a step below {DEVICE_STEP_LIMIT - 1} or name a host-step op model")


def step_constants(op_model: str, *, lr: float, step: int, betas=(0.9, 0.999), eps=1e-8,
                   weight_decay: float = 0.0) -> StepConstants:
    """The constants of the next Adam step as the op model's framework computes them.

    torch op models take torch's float32 scalars exactly; optax ones allow 4 ulp for XLA's
    ``pow`` in ``1 - b**t`` (in ``const_rel``).  Results are cached per distinct (typed)
    argument tuple: every tensor of a param group asks for the same constants.

    Args:
      op_model: one of `OP_MODELS`.
      lr: learning rate of the next update.
      step: the optimizer's step count at the checkpoint; the update uses ``t = step + 1``.
      betas: ``(beta1, beta2)``.
      eps: Adam's epsilon.
      weight_decay: the weight decay.

    Returns:
      A `StepConstants` (Python floats holding float32 values; frozen, so sharing is safe).

    Raises:
      ConfigError: an unknown op model or bad hyperparameters (`validate_hparams`).
    """
    try:
        betas_key = tuple(betas)
        hash((op_model, lr, step, betas_key, eps, weight_decay))
    except TypeError:      # unhashable or not a sequence: the uncached path says what is wrong
        return _step_constants(op_model, lr=lr, step=step, betas=betas, eps=eps, weight_decay=weight_decay)
    return _step_constants_cached(op_model, lr, step, tuple((type(b), b) for b in betas_key), eps, weight_decay)


@functools.lru_cache(maxsize=1024, typed=True)   # typed: step=True must not hit step=1's entry
def _step_constants_cached(op_model, lr, step, typed_betas, eps, weight_decay):
    return _step_constants(op_model, lr=lr, step=step, betas=tuple(b for _, b in typed_betas), eps=eps,
                           weight_decay=weight_decay)


def _step_constants(op_model: str, *, lr: float, step: int, betas=(0.9, 0.999), eps=1e-8,
                    weight_decay: float = 0.0) -> StepConstants:
    """`step_constants` without the cache."""
    if op_model not in OP_MODELS:
        raise ConfigError(f"op_model={op_model!r} is unknown; use one of {', '.join(OP_MODELS)}")
    validate_hparams(lr, betas, eps, step, weight_decay, op_model)
    b1, b2 = float(betas[0]), float(betas[1])
    t = int(step) + 1
    bc1 = 1.0 - b1**t
    bc2 = 1.0 - b2**t
    kernel = gpu_kernel(op_model)
    if kernel is not None:
        return _gpu_step_constants(op_model, kernel, lr=lr, t=t, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if op_model.startswith("torch"):
        a = f32(1.0 - b1)
        keep = 1.0 - a
        S = f32(lr / bc1)       # exactly the float32 scalars torch feeds its kernels
        B = f32(math.sqrt(bc2))
        const_rel = 2.0**-20
    else:
        # optax computes 1 - b**t in float32 from the float32 beta (decay**count); XLA's
        # pow measured within 0.70 ulp here, allowed 4 ulp (2**-21 relative), then 1 - x
        # and the division round once each.
        a = f32(1.0 - b1)
        keep = f32(b1)
        b1t, b2t = f32(b1) ** t, f32(b2) ** t
        bc1, bc2 = 1.0 - b1t, 1.0 - b2t
        S = f32(lr) / bc1
        B = math.sqrt(bc2)
        d1 = 2.0**-21 * b1t / bc1 + 2.0**-24
        d2 = 2.0**-21 * b2t / bc2 + 2.0**-24
        const_rel = max(2.0**-20, 2 * (d1 + 2.0**-24), 2 * (d2 / 2 + 2.0**-24))
    return StepConstants(
        op_model=op_model, lr=float(lr), keep=keep, a=a, b2f=f32(b2), c2=f32(1.0 - b2),
        S=S, B=B, eps=f32(eps), weight_decay=float(weight_decay),
        decay_in_update=(op_model == "optax-adamw" and weight_decay > 0),
        coupled_decay=(op_model.startswith("torch") and not split_torch_op_model(op_model)[0] and weight_decay > 0),
        const_rel=const_rel,
    )


def _device_bias_rel(pow_ulps: float, bt: float, bc: float) -> float:
    """Relative error of ``1 - powf(b, t)`` formed in float32 on the device: powf within
    `pow_ulps` ulp (one ulp <= 2u of the value), then one rounding of the subtraction."""
    return pow_ulps * 2.0**-23 * bt / bc + 2.0**-24


def _gpu_step_constants(op_model: str, kernel: GpuKernel, *, lr, t, b1, b2, eps, weight_decay) -> StepConstants:
    """`step_constants` of a GPU op model (the kernels' sequences: torch_compat.gpu_sim).

    Host-constant torch kernels (single, foreach, fused-f64) take torch's Python-double
    scalars exactly as the CPU models do (fused-f64 keeps the betas in double: its
    ``keep``, ``a`` are the doubles, rounded by `bound.pack_constants`, within ``u`` of the
    kernel's; the bound's per-branch moment allowance covers that gap).  Device-constant
    kernels (foreach-capturable, fused-f32, XLA:GPU) form ``1 - b**t`` in float32 from the
    float32 betas with ``powf``: S and B here are the exact values from the float32 betas,
    and ``const_rel`` covers powf's allowed error and the float32 roundings after it.
    """
    u = 2.0**-24
    b1f, b2f = f32(b1), f32(b2)
    decoupled = is_decoupled(op_model)
    impl = kernel.implementation
    if not kernel.device_constants:
        bc1, bc2 = 1.0 - b1**t, 1.0 - b2**t
        if impl == "fused-f64":
            keep, a, b2w, c2 = b1, 1.0 - b1, b2, 1.0 - b2
        else:
            a = f32(1.0 - b1)
            keep, b2w, c2 = 1.0 - a, b2f, f32(1.0 - b2)
        S, B, const_rel = f32(lr / bc1), f32(math.sqrt(bc2)), 2.0**-20
    else:
        b1t, b2t = b1f ** t, b2f ** t
        bc1, bc2 = 1.0 - b1t, 1.0 - b2t
        S, B = f32(lr) / bc1, math.sqrt(bc2)
        d1 = _device_bias_rel(kernel.pow_ulps, b1t, bc1)
        d2 = _device_bias_rel(kernel.pow_ulps, b2t, bc2)
        if impl == "foreach-capturable":
            # S = 1 / ((b1^t - 1) / lr): sub, div, reciprocal; B = sqrt(-(b2^t - 1)).  The
            # step is m / (denom / S): denom / S may be subnormal (absolute error 2**-150,
            # relative <= 2**-150 S / eps), and must not overflow.
            const_rel = max(2.0**-20, 2 * (d1 + 2 * u) + 2.0**-150 * S / f32(eps), 2 * (d2 / 2 + u))
            if (2.0**60 / B + f32(eps)) / S > 2.0**120:
                raise ConfigError(f"lr={lr!r}: {op_model} divides the denominator by the step size "
                                  f"{S:.3g}, which could overflow float32; use a learning rate above 1e-20")
        else:
            const_rel = max(2.0**-20, 2 * (d1 + u), 2 * (d2 / 2 + u))
        if kernel.framework == "optax":
            keep, a, b2w, c2 = b1f, f32(1.0 - b1), b2f, f32(1.0 - b2)
        elif impl == "fused-f32":
            keep, a, b2w, c2 = b1f, 1.0 - b1f, b2f, 1.0 - b2f    # fma(b1, m, fma(-b1, g, g))
        else:
            a = f32(1.0 - b1)
            keep, b2w, c2 = 1.0 - a, b2f, f32(1.0 - b2)
    optax = kernel.framework == "optax"
    return StepConstants(
        op_model=op_model, lr=float(lr), keep=keep, a=a, b2f=b2w, c2=c2, S=S, B=B, eps=f32(eps),
        weight_decay=float(weight_decay),
        decay_in_update=(optax and decoupled and weight_decay > 0),
        coupled_decay=(not optax and not decoupled and weight_decay > 0),
        const_rel=const_rel,
    )


# ---------------------------------------------------------------- choosing the model as torch does
# fused_adam_utils.cuh: double-evaluated moments up to torch 2.10 (read from source: docs/gpu.md);
# float with std::fma from 2.13 (read in torch 2.13.0's installed header).  2.11 and 2.12 are
# not known here: refused unless the user names the kernel.
FUSED_F64_LAST = (2, 10)
FUSED_F32_FIRST = (2, 13)
FOREACH_DEVICES = ("cuda", "xpu", "mtia")     # torch's _get_foreach_kernels_supported_devices (+ privateuse1)


def _torch_minor(torch_version) -> tuple:
    """``(major, minor)`` of a torch version string such as ``"2.13.0+cu128"``."""
    head = str(torch_version).split("+")[0].split(".")
    try:
        return int(head[0]), int("".join(ch for ch in head[1] if ch.isdigit()) or "x")
    except (IndexError, ValueError):
        raise ConfigError(f"torch_version={torch_version!r} is not a torch version; pass torch.__version__") from None


def resolve_op_model(device_type: str, *, foreach=None, fused=None, capturable=False, decoupled=False,
                     torch_version=None, differentiable=False, lr_is_tensor=False, op_model=None) -> str:
    """The op model of the torch Adam/AdamW kernel that a param group runs, resolved as torch does.

    torch's ``adam()``: with ``foreach`` and ``fused`` both None it calls
    ``_default_to_fused_or_foreach(params, differentiable, use_fused=False)``, which picks
    foreach for plain tensors on cuda/xpu/mtia and the single-tensor loop elsewhere (CPU),
    then keeps the single-tensor loop where ``lr`` is a tensor and capturable is off.

    Args:
      device_type: where the state lives and the run resumes (``"cpu"``, ``"cuda"``).
      foreach, fused, capturable, differentiable: the param group's flags (None: unset).
      decoupled: AdamW (decoupled weight decay).
      torch_version: ``torch.__version__`` of the run (CUDA fused only: which generation).
      lr_is_tensor: the group's lr is a tensor.
      op_model: the kernel the user names (overrides the resolution; checked).

    Returns:
      One of `OP_MODELS` (``torch-adam``, ``torch-adamw-cuda-foreach``, ...).

    Raises:
      ConfigError: (one line) a named op model that is unknown or of the other optimizer,
        fused and foreach both True, a combination no op model covers (capturable on CPU,
        capturable single-tensor CUDA, another device type), or a fused CUDA kernel of a
        torch version whose numeric generation is not known.
    """
    base = "torch-adamw" if decoupled else "torch-adam"
    if op_model is not None:
        if op_model not in OP_MODELS or not op_model.startswith("torch"):
            raise ConfigError(f"op_model={op_model!r} is not a torch op model; use one of "
                              f"{', '.join(m for m in OP_MODELS if m.startswith('torch'))}")
        if is_decoupled(op_model) != bool(decoupled):
            raise ConfigError(f"op_model={op_model!r} is {'AdamW' if is_decoupled(op_model) else 'Adam'} but the "
                              f"param group is {'AdamW' if decoupled else 'Adam'}; name the {base}* model")
        return op_model
    if fused and foreach:
        raise ConfigError("fused=True and foreach=True together, which torch rejects; set one of them")
    if fused is None and foreach is None:
        foreach = device_type in FOREACH_DEVICES and not differentiable and not (lr_is_tensor and not capturable)
    fused, foreach = bool(fused), bool(foreach)
    if device_type == "cpu":
        if capturable:
            raise ConfigError("capturable=True on CPU is not a torch Adam kernel jaxguard models; save the state with "
                              "capturable=False or name the kernel the run resumes on (op_model=)")
        return base + TORCH_IMPLEMENTATIONS["fused" if fused else "foreach" if foreach else "single"]
    if device_type != "cuda":
        raise ConfigError(f"device_type={device_type!r}: jaxguard models torch Adam on cpu and cuda only; name the "
                          "kernel the run resumes on with op_model= (e.g. torch-adam-cuda-foreach)")
    if fused:
        if torch_version is None:
            raise ConfigError("fused=True on cuda needs torch_version (the fused kernel's numerics changed after "
                              "torch 2.10); pass torch.__version__ or op_model=")
        ver = _torch_minor(torch_version)
        if ver <= FUSED_F64_LAST:
            return base + "-cuda-fused-f64"
        if ver >= FUSED_F32_FIRST:
            return base + "-cuda-fused-f32"
        raise ConfigError(f"torch {torch_version}: which fused CUDA Adam kernel generation it runs (double moments up "
                          f"to 2.10, float with fma from 2.13) is not known; pass op_model='{base}-cuda-fused-f32' or "
                          f"'{base}-cuda-fused-f64' after checking its fused_adam_utils.cuh (or bench/gpu_check.py)")
    if foreach:
        return base + ("-cuda-foreach-capturable" if capturable else "-cuda-foreach")
    if capturable:
        raise ConfigError("capturable=True with the single-tensor CUDA kernel (foreach=False) is not modelled; "
                          "use foreach (the CUDA default) or capturable=False")
    return base + "-cuda"


# jax Device.platform of a GPU (CUDA and ROCm devices report "gpu"; the plugin names too)
GPU_PLATFORMS = ("gpu", "cuda", "rocm")
OPTAX_OP_MODELS = tuple(m for m in OP_MODELS if m.startswith("optax"))


def resolve_optax_op_model(*, decoupled: bool, platforms=(), op_model=None) -> str:
    """The op model of optax's Adam/AdamW update where the state lives, or the named one.

    The CPU model (``optax-adam[w]``, XLA:CPU) unless every platform the state's arrays
    live on is a GPU (`GPU_PLATFORMS`): then ``optax-adam[w]-gpu`` (XLA:GPU).

    Args:
      decoupled: the update has decoupled weight decay (weight_decay > 0: AdamW).
      platforms: the jax ``Device.platform`` of every device the state's arrays live on
        (empty: host arrays, the CPU model).
      op_model: the kernel the run resumes on, named by the user (checked).

    Returns:
      One of `OPTAX_OP_MODELS`.

    Raises:
      ConfigError: (one line) a named model that is not an optax one, or of the other
        optimizer (adam for a weight decay > 0, adamw for none); state spread over a GPU
        and another platform without a named model.
    """
    base = "optax-adamw" if decoupled else "optax-adam"
    if op_model is not None:
        if op_model not in OPTAX_OP_MODELS:
            raise ConfigError(f"op_model={op_model!r} is not an optax op model; use one of {', '.join(OPTAX_OP_MODELS)}")
        if is_decoupled(op_model) != bool(decoupled):
            has = "a weight decay > 0 (AdamW)" if decoupled else "no weight decay (Adam)"
            raise ConfigError(f"op_model={op_model!r} is {'AdamW' if is_decoupled(op_model) else 'Adam'} but the "
                              f"state has {has}; name {base}{'-gpu' if op_model.endswith('-gpu') else ''} or pass "
                              "the weight_decay of the next update")
        return op_model
    platforms = {str(p).lower() for p in platforms}
    gpu = {p for p in platforms if p in GPU_PLATFORMS}
    if gpu and gpu != platforms:
        raise ConfigError(f"the optax state lives on {', '.join(sorted(platforms))} devices, whose updates run "
                          f"different kernels; name the one the run resumes on (op_model='{base}-gpu' or '{base}')")
    return base + "-gpu" if gpu else base


# ---------------------------------------------------------------- stage 2 coverage of the GPU kernels
def stage2_budget(op_model: str) -> dict:
    """First-order error of a GPU kernel's op sequence, in units of ``u = 2**-24``, per
    chain of the bound's stage 2 (docs/bound.md, section 9), beside what stage 2 allows.

    One ulp is at most ``2u`` relative; an IEEE op errs by ``u``.  ``denominator``: relative
    error of ``sqrt(v')/B + eps`` (allowed ``64u``: `bound.rho_d` less ``const_rel``);
    ``step``: relative error the step's own ops add to ``S m'/d`` (allowed ``24u``);
    ``moment``: error of ``m'`` in units of ``u (|m| + |g|)`` (allowed ``24``: ``e_m =
    3 R(2|m| + |g|)``).  The constants' gap is ``const_rel`` (`step_constants`), added
    to both allowances by the bound.

    Args:
      op_model: one of `GPU_OP_MODELS`.

    Returns:
      ``{"denominator": (need, allowed), "step": (need, allowed), "moment": (need, allowed)}``.

    Raises:
      ConfigError: not a GPU op model.
    """
    k = gpu_kernel(op_model)
    if k is None:
        raise ConfigError(f"op_model={op_model!r} is not a GPU op model; use one of {', '.join(GPU_OP_MODELS)}")
    div, sq = 2 * max(k.div_ulps, 0.5), 2 * max(k.sqrt_ulps, 0.5)   # in units of u
    impl = k.implementation
    v_new = 3.0                  # b2*v, g*g (or c2*g), then the add/fma: nonnegative terms
    if impl == "xla-gpu":
        v_over_bc = v_new + div                      # nu / bc2 (div.full)
        den = v_over_bc / 2 + sq + 1                 # sqrt, + eps
        step = div + div + 1                         # mu / bc1, / den, * -lr
    elif impl == "fused-f64":
        den = (1.0 + 2.0**-26) / 2 + 1 + 1.01        # v' rounded once; sqrtf; (double / B + eps) rounded once
        step = 2.0                                   # S * m, / den
    else:
        scale = 2.0 if impl == "single" else 1.0     # single: reciprocal of B, then a multiply
        den = v_new / 2 + 1 + scale + 1              # sqrt, / B, + eps
        step = 2.0                                   # m / den, * S (capturable: den / S, m / that)
    moment = {"fused-f64": 3.0, "fused-f32": 2.0}.get(impl, 3.0)   # lerp: g - m, w*diff, + m
    return {"denominator": (den, 64.0), "step": (step, 24.0), "moment": (moment, 24.0)}
