"""AdamW for torch with AL8 second moment and uf8 (or d8) first moment between steps.

The state codes are *the same* as :func:`jaxguard.quant.quantized` with ``policy="al8"``:
encoding calls the one implementation in :mod:`jaxguard.core.codes` (through
:mod:`jaxguard.quant.codecs`, on CPU via numpy), decoding uses the bit-identical torch
decoders in :mod:`torch_compat.codes_torch` (float32 multiplies only).  So a state written
here decodes to the same float32 values in JAX, numpy and torch.

Per parameter, each step: decode ``m``, ``v`` -> float32 AdamW step (torch's op order:
``m.lerp_(g, 1-b1)``, ``v.mul_(b2).addcmul_(g, g, 1-b2)``, decoupled weight decay
``p *= 1 - lr*wd``, ``p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)``) -> encode ``m``, ``v``.
Parameters with fewer than ``min_size`` elements, or in a param group with
``quantize=False`` (use that for norms, biases, embeddings, the LM head), keep float32 state.

Numerical contract: ``v`` obeys AL8's contract (exact zeros, half-a-log-step relative
error within the block's range; see :mod:`jaxguard.quant.codecs`); ``m`` obeys uf8's
(``|m~ - m| <= scale/2``).  State tensors are plain torch tensors, so ``state_dict()`` /
``load_state_dict()`` round-trip them exactly and a resumed run continues bit-identically.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from jaxguard.errors import CheckpointError, ConfigError
from jaxguard.format import spec
from jaxguard.quant import codecs
from torch_compat import codes_torch

__all__ = ["QuantAdamW", "STATE_FIELDS", "encode_state_tensor", "decode_state_tensor", "state_fields"]

STATE_FIELDS = {"al8": ("codes", "lo", "r"), "al16": ("codes", "lo", "r"), "uf8": ("codes", "scale"),
                "d8": ("codes", "absmax")}
"""The tensors each state code stores; ``state[f"{name}_{field}"]`` in an optimizer state."""


def _check_code(code: str) -> None:
    if code not in STATE_FIELDS:
        raise ConfigError(f"code={code!r} is not a QuantAdamW state code; use al8, al16, uf8 or d8")


def encode_state_tensor(x: torch.Tensor, code: str) -> dict:
    """Encode a float32 CPU tensor with one state code.

    Args:
      x: the moment (any shape; float32 on CPU after conversion).
      code: ``al8``/``al16`` (v), ``uf8``/``d8`` (m).

    Returns:
      a dict of tensors keyed by ``STATE_FIELDS[code]``.

    Raises:
      ConfigError: an unknown code.
    """
    _check_code(code)
    xn = x.detach().to(torch.float32).cpu().numpy()
    if code in ("al8", "al16"):
        e = codecs.al_encode(xn, 8 if code == "al8" else 16)
        return {"codes": torch.from_numpy(np.array(e.codes).astype(np.int16 if code == "al16" else np.uint8)
                                          .reshape(-1)),
                "lo": torch.from_numpy(np.array(e.lo)), "r": torch.from_numpy(np.array(e.r))}
    if code == "uf8":
        e = codecs.uf8_encode(xn)
        return {"codes": torch.from_numpy(np.array(e.codes).reshape(-1)),
                "scale": torch.from_numpy(np.array(e.scale))}
    if code == "d8":
        e = codecs.d8_encode(xn, signed=True)
        return {"codes": torch.from_numpy(np.array(e.codes).reshape(-1)),
                "absmax": torch.from_numpy(np.array(e.absmax))}
    raise ConfigError(f"code={code!r} is not a QuantAdamW state code; use al8, al16, uf8 or d8")


def decode_state_tensor(enc: dict, code: str, shape) -> torch.Tensor:
    """Decode what `encode_state_tensor` wrote, bit-identically to the JAX and numpy decoders.

    Args:
      enc: the tensors of ``STATE_FIELDS[code]``, exactly those.
      code: ``al8``, ``al16``, ``uf8`` or ``d8``.
      shape: the moment's shape.

    Returns:
      the float32 moment.

    Raises:
      ConfigError: an unknown code, or ``enc`` has other fields than the code's.
    """
    _check_code(code)
    if set(enc) != set(STATE_FIELDS[code]):
        raise ConfigError(f"a {code} state has the fields {', '.join(STATE_FIELDS[code])}, got "
                          f"{', '.join(sorted(enc)) or 'none'}")
    n = math.prod(shape)
    if code in ("al8", "al16"):
        q = enc["codes"].to(torch.int64) & 0xFFFF  # int16 storage of uint16 codes
        return codes_torch.log_decode(q, enc["lo"], enc["r"], n, 8 if code == "al8" else 16).reshape(shape)
    if code == "uf8":
        return codes_torch.linear8_decode(enc["codes"], enc["scale"], n).reshape(shape)
    if code == "d8":
        table = torch.from_numpy(spec.dynamic_map(True))
        return codes_torch.table_decode(enc["codes"], enc["absmax"], table, n).reshape(shape)


def state_fields(state: dict, name: str, code: str) -> dict:
    """The encoded tensors of moment ``name`` in one parameter's optimizer state.

    Only ``name``'s own fields: ``exp_avg`` never picks up ``exp_avg_sq_*``.

    Args:
      state: ``optimizer.state[p]`` of a `QuantAdamW`.
      name: ``"exp_avg"`` or ``"exp_avg_sq"``.
      code: the code it was stored with (``STATE_FIELDS``).

    Returns:
      ``{field: tensor}`` for the fields of ``code``.

    Raises:
      ConfigError: an unknown code.
      CheckpointError: a field is missing (a state written with another code or by another optimizer).
    """
    _check_code(code)
    missing = [f"{name}_{f}" for f in STATE_FIELDS[code] if f"{name}_{f}" not in state]
    if missing:
        raise CheckpointError(f"QuantAdamW state has no {', '.join(missing)} for a {code} {name}; load a state "
                              "written with the same m_code/v_code")
    return {f: state[f"{name}_{f}"] for f in STATE_FIELDS[code]}


class QuantAdamW(torch.optim.Optimizer):
    """AdamW whose ``exp_avg`` (uf8 or d8) and ``exp_avg_sq`` (AL8 or AL16) stay encoded."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 m_code="uf8", v_code="al8", min_size=4096, quantize=True):
        if not 0.0 <= lr:
            raise ConfigError(f"lr={lr!r} must be >= 0")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ConfigError(f"betas={betas!r} must lie in [0, 1)")
        if m_code not in ("uf8", "d8", "fp32"):
            raise ConfigError(f"m_code={m_code!r} is unknown; use 'uf8', 'd8' or 'fp32'")
        if v_code not in ("al8", "al16", "fp32"):
            raise ConfigError(f"v_code={v_code!r} is unknown; use 'al8', 'al16' or 'fp32'")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, m_code=m_code,
                        v_code=v_code, min_size=min_size, quantize=quantize)
        super().__init__(params, defaults)

    @staticmethod
    def _get(state, name, code, shape):
        if code == "fp32":
            return state[name]
        return decode_state_tensor(state_fields(state, name, code), code, shape)

    @staticmethod
    def _put(state, name, code, x):
        if code == "fp32":
            state[name] = x
            return
        for k, v in encode_state_tensor(x, code).items():
            state[f"{name}_{k}"] = v

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamW step (decoupled decay, torch's op order), moments decoded and re-encoded.

        Parameters with at least ``min_size`` elements keep their moments in the group's
        ``m_code``/``v_code``; smaller ones, or groups with ``quantize=False``, in fp32.

        Args:
          closure: optional callable that re-evaluates the model and returns the loss
            (run with gradients enabled).

        Returns:
          The closure's loss, or None.

        Raises:
          ConfigError: a sparse gradient.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise ConfigError("QuantAdamW got a sparse gradient; use dense gradients")
                g = p.grad.to(torch.float32)
                st = self.state[p]
                quant = group["quantize"] and p.numel() >= group["min_size"]
                mc = group["m_code"] if quant else "fp32"
                vc = group["v_code"] if quant else "fp32"
                if "step" not in st:
                    st["step"] = torch.tensor(0.0)
                    self._put(st, "exp_avg", mc, torch.zeros_like(g))
                    self._put(st, "exp_avg_sq", vc, torch.zeros_like(g))
                m = self._get(st, "exp_avg", mc, p.shape).clone()
                v = self._get(st, "exp_avg_sq", vc, p.shape).clone()
                st["step"] = st["step"] + 1  # new tensor: load_state_dict may share it
                t = float(st["step"])
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                denom = (v.sqrt() / math.sqrt(1 - b2 ** t)).add_(group["eps"])
                p.addcdiv_(m, denom, value=-group["lr"] / (1 - b1 ** t))
                self._put(st, "exp_avg", mc, m)
                self._put(st, "exp_avg_sq", vc, v)
        return loss

    def state_bytes(self) -> int:
        """Bytes of every tensor in the optimizer state (codes, scales, step counters)."""
        return sum(v.numel() * v.element_size() for st in self.state.values()
                   for v in st.values() if torch.is_tensor(v))
