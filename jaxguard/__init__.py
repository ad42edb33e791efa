"""jaxguard: guarded compression of Adam optimizer state.

Nothing here imports torch: the torch layer is the `torch_compat` package
(``pip install -e ".[torch]"`` in the clone). Public API (imported lazily so that
`python -m jaxguard.reader` needs numpy only; ``dir(jaxguard)`` lists it)::

    import jaxguard as jg
    enc = jg.encode(m, v, p, jg.GuardConfig(lr=1e-3, step=t))
    m2, v2 = jg.decode(enc)
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_LAZY = {
    "GuardConfig": ("jaxguard.core.guard", "GuardConfig"),
    "GuardSpec": ("jaxguard.core.config", "GuardSpec"),
    "NextUpdate": ("jaxguard.core.config", "NextUpdate"),
    "StepRow": ("jaxguard.core.bound", "StepRow"),
    "encode_v_only": ("jaxguard.core.guard", "encode_v_only"),
    "Encoded": ("jaxguard.core.guard", "Encoded"),
    "encode": ("jaxguard.core.guard", "encode"),
    "decode": ("jaxguard.core.guard", "decode"),
    "CODECS": ("jaxguard.core.guard", "CODECS"),
    "DEFAULT_CODEC": ("jaxguard.format.spec", "DEFAULT_CODEC"),
    "quant": ("jaxguard.quant", None),
    "save": ("jaxguard.optax_adapter", "save"),
    "load": ("jaxguard.optax_adapter", "load"),
    "encode_jit": ("jaxguard.core.jit_encode", "encode_jit"),
    "state_constants": ("jaxguard.jit_state", "state_constants"),
    "encode_state_jit": ("jaxguard.jit_state", "encode_state_jit"),
    "write": ("jaxguard.jit_state", "write"),
    "JaxguardError": ("jaxguard.errors", "JaxguardError"),
    "ConfigError": ("jaxguard.errors", "ConfigError"),
    "CheckpointError": ("jaxguard.errors", "CheckpointError"),
    "ContainerError": ("jaxguard.errors", "ContainerError"),
    "UnsupportedOptimizerError": ("jaxguard.errors", "UnsupportedOptimizerError"),
}

__all__ = sorted(_LAZY) + ["__version__"]

if TYPE_CHECKING:   # what type checkers and IDEs see; at run time `__getattr__` imports on first use
    from jaxguard import quant
    from jaxguard.core.bound import StepRow
    from jaxguard.core.config import GuardSpec, NextUpdate
    from jaxguard.core.guard import CODECS, Encoded, GuardConfig, decode, encode, encode_v_only
    from jaxguard.core.jit_encode import encode_jit
    from jaxguard.errors import (CheckpointError, ConfigError, ContainerError, JaxguardError,
                                 UnsupportedOptimizerError)
    from jaxguard.format.spec import DEFAULT_CODEC
    from jaxguard.jit_state import encode_state_jit, state_constants, write
    from jaxguard.optax_adapter import load, save


def __getattr__(name):
    if name in _LAZY:
        mod, attr = _LAZY[name]
        module = importlib.import_module(mod)
        value = module if attr is None else getattr(module, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jaxguard' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
