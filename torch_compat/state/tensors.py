"""torch tensors as the format's raw arrays and back, without importing torch or JAX
before they are needed (`jaxguard compress` of a file read without torch never imports it)."""
from __future__ import annotations

__all__ = ['is_tensor', 'dtype_name', 'torch_version', 'tensor_to_numpy', 'numpy_to_tensor', 'scalar_value',
           'jax_platform_of', 'HostTensor', 'writable_array']

import sys

import numpy as np

from jaxguard.format import container
from jaxguard.format.torchzip import FileTensor
from jaxguard.errors import CheckpointError, UnsupportedOptimizerError


class _LazyModule:
    """A module imported at its first attribute access: `jaxguard.writer` pulls in JAX
    (the guard), which compress needs and restore (numpy reader + torch) does not."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        import importlib
        return getattr(importlib.import_module(self._name), attr)


writer = _LazyModule("jaxguard.writer")   # compress only: restore never imports JAX


# `jaxguard compress` of a checkpoint read without torch (`jaxguard.format.torchzip.load`) never
# imports it: the compress path asks `is_tensor`, `dtype_name`, `torch_version`, never `torch.*`
torch = _LazyModule("torch")


def is_tensor(x) -> bool:
    """Whether `x` is a torch tensor or a `jaxguard.format.torchzip.FileTensor` (a tensor of a
    checkpoint read without torch), without importing torch to ask.

    Args:
      x: anything.

    Returns:
      A bool.
    """
    t = sys.modules.get("torch")
    return (t is not None and isinstance(x, t.Tensor)) or isinstance(x, FileTensor)


def dtype_name(t) -> str:
    """A tensor's dtype without the ``torch.`` prefix (``"float32"``, ``"bfloat16"``, ...).

    Args:
      t: a torch tensor or a `FileTensor`.

    Returns:
      The name.
    """
    return str(t.dtype).rsplit(".", 1)[-1]


def torch_version() -> str:
    """``torch.__version__``: from torch when it is imported, else as recorded beside the
    cached Adam variant of this environment (`torch_compat.variant_cache.fast_record`),
    else by importing torch.

    Returns:
      The version string.
    """
    if "torch" not in sys.modules:
        from torch_compat.variant_cache import fast_record
        rec = fast_record()
        if rec is not None:
            return rec["torch_version"]
    return torch.__version__


# ---------------------------------------------------------------- generic tree <-> JSON skeleton
def tensor_to_numpy(t: torch.Tensor):
    """A tensor's bits as a numpy array and the container dtype name.

    Args:
      t: any tensor (detached and copied to the CPU).

    Returns:
      ``(array, dtype name)``; bfloat16 travels as its uint16 bits with the name ``"bfloat16"``.
    """
    if isinstance(t, FileTensor):   # bfloat16 is held as its uint16 bits already
        return t.contiguous_array(), t.dtype_name
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), "bfloat16"
    arr = t.numpy()
    return arr, container.numpy_dtype_name(arr)


def writable_array(arr):
    """`arr` itself when torch may share it (writable: e.g. read from a container into a
    bytearray, or freshly decoded), else a copy.

    Args:
      arr: a numpy array.
    """
    return arr if arr.flags.writeable else np.array(arr)


def numpy_to_tensor(arr, dtype_name):
    """The inverse of `tensor_to_numpy`.

    Args:
      arr: the stored array (shared with the tensor when writable, else copied).
      dtype_name: its container dtype name (``"bfloat16"`` reinterprets uint16 bits).

    Returns:
      A CPU tensor with the same bits.
    """
    arr = writable_array(np.asarray(arr))
    if dtype_name == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


# ---------------------------------------------------------------- validation
def scalar_value(x, what):
    """A hyperparameter or step held as a Python number or a one-element tensor, as a number.

    Args:
      x: the value (``group["lr"]``, a beta, ``state["step"]``).
      what: its name, for the error.

    Returns:
      ``x.item()`` for a tensor, else `x`.

    Raises:
      CheckpointError: a tensor of more than one element.
    """
    if is_tensor(x):
        if x.numel() != 1:
            raise CheckpointError(f"{what} is a tensor of {x.numel()} elements; expected a scalar")
        return x.item()
    return x


def jax_platform_of(device_type: str):
    """The JAX platform that takes tensors of torch `device_type` through DLPack, or None.

    Args:
      device_type: ``tensor.device.type`` (``"cpu"``, ``"cuda"``, ...).

    Returns:
      ``"cpu"`` for CPU tensors, ``"gpu"`` for CUDA ones when JAX has a GPU backend
      (its CUDA or ROCm plugin), else None (the tensor is read on the host).
    """
    if device_type == "cpu":
        return "cpu"
    if device_type != "cuda":
        return None
    import jax
    try:
        return "gpu" if jax.devices("gpu") else None
    except RuntimeError:   # JAX without a GPU backend
        return None


class HostTensor:
    """A tensor the encoder reads on the host: ``numpy.asarray`` copies it there (the
    writer does so one slab of tensors at a time); shape, dtype and size need no copy.

    Args:
      t: the (detached) float32 tensor, on any device.
    """

    def __init__(self, t):
        if t.dtype != torch.float32:
            raise UnsupportedOptimizerError(f"a {t.dtype} tensor reached the encoder; jaxguard certifies float32 "
                                            "moments and parameters only")
        self.tensor = t
        self.shape = tuple(t.shape)
        self.ndim = t.dim()
        self.size = t.numel()
        self.dtype = np.dtype(np.float32)

    def __array__(self, dtype=None, copy=None):
        arr = self.tensor.cpu().contiguous().numpy()
        return arr if dtype is None else arr.astype(dtype, copy=False)
