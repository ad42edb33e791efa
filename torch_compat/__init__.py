"""torch parity layer: torch state_dicts in and out of jaxguard containers, and a
bit-exact JAX replay of torch's single-tensor FP32 Adam/AdamW.

Two parts, which never import each other upward:

* the arithmetic model of torch's Adam (JAX and numpy, no torch I/O): ``float32`` <-
  ``variant`` (+ ``variant_cache``) <- ``calibrate`` <- ``replay``; ``enclosure`` (the
  audit of the bound against the replay) and ``gpu_sim`` (numpy simulations of the CUDA
  and XLA:GPU kernels);
* torch I/O on top of it: ``state`` (state_dict <-> container records, the first-update
  audit with real torch), ``dcp`` (torch.distributed.checkpoint planners), ``migrate``
  (torch <-> optax), ``codes_torch`` (the torch decoder), ``quant_adamw``, ``models``
  (the demo zoo).

Needs torch >= 2.4 (``pip install -e ".[torch]"`` in the clone); the rest of jaxguard does not.
"""
import importlib.metadata as _metadata
import importlib.util as _util
import re as _re
import sys as _sys

from jaxguard.errors import install_hint as _install_hint


def _installed_torch_version():
    # asked without importing torch: `jaxguard compress` of a file read without torch never imports it
    if "torch" in _sys.modules:
        return _sys.modules["torch"].__version__
    try:
        if _util.find_spec("torch") is None:
            return None
    except (ImportError, ValueError):   # a finder that refuses torch: as good as not installed
        return None
    try:
        return _metadata.version("torch")
    except _metadata.PackageNotFoundError:   # importable but not installed by pip (a source tree)
        import torch
        return torch.__version__


_version = _installed_torch_version()
if _version is None:
    raise ImportError(f"torch_compat needs torch; install it with {_install_hint('torch')}")
if tuple(int(x) for x in _re.findall(r"\d+", _version)[:2]) < (2, 4):
    raise ImportError(f"torch_compat needs torch >= 2.4 (this is torch {_version}); "
                      f"upgrade it with {_install_hint('torch')}")

# the public names are imported on first use (as in jaxguard/__init__.py), so that
# `jaxguard restore` (torch and the numpy reader) does not pay for jax, optax and the replay
_LAZY = {
    "AdamVariant": ("torch_compat.replay", "AdamVariant"),
    "ReplayVariantWarning": ("torch_compat.replay", "ReplayVariantWarning"),
    "adam_step": ("torch_compat.replay", "adam_step"),
    "detect_variant": ("torch_compat.replay", "detect_variant"),
    "numpy_adam_step": ("torch_compat.replay", "numpy_adam_step"),
    "torch_adam_step": ("torch_compat.replay", "torch_adam_step"),
    "from_optax": ("torch_compat.migrate", "from_optax"),
    "to_optax": ("torch_compat.migrate", "to_optax"),
    "QuantAdamW": ("torch_compat.quant_adamw", "QuantAdamW"),
    "audit": ("torch_compat.state", "audit"),
    "compress_checkpoint": ("torch_compat.state", "compress_checkpoint"),
    "load": ("torch_compat.state", "load"),
    "restore_tree": ("torch_compat.state", "restore_tree"),
    "save": ("torch_compat.state", "save"),
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    import importlib
    if name in _LAZY:
        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
    else:   # a submodule (torch_compat.state, ...), which importing the package used to load
        try:
            value = importlib.import_module(f"torch_compat.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"torch_compat.{name}":
                raise
            raise AttributeError(f"module 'torch_compat' has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
