"""torch parity layer: torch state_dicts in and out of jaxguard containers, and a
bit-exact JAX replay of torch's single-tensor FP32 Adam/AdamW.

Needs torch >= 2.4 (``pip install "jaxguard[torch]"``); the rest of jaxguard does not.
"""
import re as _re

try:
    import torch as _torch
except ImportError:
    raise ImportError('torch_compat needs torch; install it with pip install "jaxguard[torch]"') from None
if tuple(int(x) for x in _re.findall(r"\d+", _torch.__version__)[:2]) < (2, 4):
    raise ImportError(f"torch_compat needs torch >= 2.4 (this is torch {_torch.__version__}); "
                      'upgrade it with pip install "jaxguard[torch]"')

# the public names are imported on first use, so that `jaxguard restore` (torch and the
# numpy reader) does not pay for jax, optax and the replay
_LAZY = {
    "AdamVariant": "replay", "ReplayVariantWarning": "replay", "adam_step": "replay", "detect_variant": "replay",
    "numpy_adam_step": "replay", "torch_adam_step": "replay",
    "from_optax": "migrate", "to_optax": "migrate",
    "QuantAdamW": "quant_adamw",
    "audit": "state", "compress_checkpoint": "state", "load": "state", "restore_tree": "state", "save": "state",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        import importlib
        value = getattr(importlib.import_module(f"torch_compat.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'torch_compat' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
