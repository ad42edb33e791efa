"""torch parity layer: torch state_dicts in and out of jaxguard containers, and a
bit-exact JAX replay of torch's single-tensor FP32 Adam/AdamW."""
from .replay import (AdamVariant, ReplayVariantWarning, adam_step, detect_variant, numpy_adam_step,
                     torch_adam_step)
from .migrate import from_optax, to_optax
from .quant_adamw import QuantAdamW
from .state import audit, compress_checkpoint, load, restore_tree, save

__all__ = ["QuantAdamW", "AdamVariant", "ReplayVariantWarning", "adam_step", "audit", "compress_checkpoint", "detect_variant", "from_optax",
           "load", "numpy_adam_step", "restore_tree", "save", "to_optax", "torch_adam_step"]
