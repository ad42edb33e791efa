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

from torch_compat.replay import (AdamVariant, ReplayVariantWarning, adam_step, detect_variant, numpy_adam_step,
                     torch_adam_step)
from torch_compat.migrate import from_optax, to_optax
from torch_compat.quant_adamw import QuantAdamW
from torch_compat.state import audit, compress_checkpoint, load, restore_tree, save

__all__ = ["QuantAdamW", "AdamVariant", "ReplayVariantWarning", "adam_step", "audit", "compress_checkpoint", "detect_variant", "from_optax",
           "load", "numpy_adam_step", "restore_tree", "save", "to_optax", "torch_adam_step"]
