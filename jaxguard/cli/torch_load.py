"""Loading the torch checkpoints users have, safely: the CLI's one ``torch.load``.

A checkpoint as found holds more than tensors: ``best_val_loss=np.float64(...)``, numpy's
RNG state (``np.random.get_state()``: a uint32 array), ``argparse.Namespace`` of the run's
arguments.  torch's weights-only unpickler refuses all of them.  `load_checkpoint` runs it
with torch's safe globals extended by exactly the numpy and argparse names those values
pickle to (`SAFE_NAMES`: numpy's array and scalar constructors, its dtypes,
``argparse.Namespace``), none of which runs code a file chooses.  Anything else is refused
in one line naming what the file asks for and ``--trust``, which loads with a plain
``torch.load`` (it runs whatever the file names: for files the user trusts).
"""
from __future__ import annotations

__all__ = ["SAFE_NAMES", "load_checkpoint"]

import io
import pickle
import re

from jaxguard.errors import CheckpointError

# The globals a weights-only load may build beyond torch's own, as the pickle names them
# (numpy 1.x files say numpy.core, numpy 2.x files numpy._core).
_NUMPY_CORE = ("_reconstruct", "scalar")
_NUMPY_DTYPES = ("Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64", "Float16",
                 "Float32", "Float64", "LongDouble", "Complex64", "Complex128", "Str", "Bytes", "Byte", "UByte",
                 "Short", "UShort", "Int", "UInt", "Long", "ULong", "LongLong", "ULongLong")
SAFE_NAMES = (tuple(f"numpy.{core}.multiarray.{fn}" for core in ("core", "_core") for fn in _NUMPY_CORE)
              + ("numpy.ndarray", "numpy.dtype", "argparse.Namespace")
              + tuple(f"numpy.dtypes.{d}DType" for d in _NUMPY_DTYPES))
TRUST = ("if you trust the file, pass --trust (a plain torch.load, which runs whatever the file names)")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def safe_globals() -> list:
    """`SAFE_NAMES` as ``torch.serialization.safe_globals`` takes them: ``(object, name)``.

    Returns:
      The pairs this numpy provides (a dtype class an older numpy lacks is left out).
    """
    import argparse
    import numpy as np
    core = getattr(np, "_core", None) or np.core
    found = {"numpy.ndarray": np.ndarray, "numpy.dtype": np.dtype, "argparse.Namespace": argparse.Namespace}
    for fn in _NUMPY_CORE:
        for mod in ("core", "_core"):
            found[f"numpy.{mod}.multiarray.{fn}"] = getattr(core.multiarray, fn)
    dtypes = getattr(np, "dtypes", None)
    for d in _NUMPY_DTYPES:
        cls = getattr(dtypes, f"{d}DType", None) if dtypes is not None else None
        if cls is not None:
            found[f"numpy.dtypes.{d}DType"] = cls
    return [(obj, name) for name, obj in found.items()]


def load_checkpoint(path, *, trust: bool = False):
    """``torch.load`` of a checkpoint file or URL onto the CPU, memory-mapped where it can be.

    Args:
      path: a local path or an fsspec URL.
      trust: load with ``weights_only=False`` (the file may run code: only for files the
        user trusts).

    Returns:
      The checkpoint object (tensors on the CPU; numpy scalars and arrays, RNG states and
      ``argparse.Namespace`` as they were saved).

    Raises:
      CheckpointError: no such file; an object outside `SAFE_NAMES` (one line naming it
        and ``--trust``); a file torch cannot read.
    """
    import torch
    from jaxguard.format import storage
    if not storage.exists(path):
        raise CheckpointError(f"{path}: no such file; pass a checkpoint written with torch.save")
    remote = storage.is_url(path)
    src = io.BytesIO(storage.read_bytes(path)) if remote else storage.local_path(path)

    def load(**kw):
        if not remote:
            try:   # mmap: tensors are read from the page cache as they are used, not copied up front
                return torch.load(src, map_location="cpu", mmap=True, **kw)
            except RuntimeError as exc:   # legacy (non-zip) files cannot be mapped
                if "mmap" not in str(exc):
                    raise
        else:
            src.seek(0)
        return torch.load(src, map_location="cpu", **kw)

    try:
        if trust:
            return load(weights_only=False)
        allowed = getattr(torch.serialization, "safe_globals", None)
        if allowed is None:      # torch 2.4: its own safe set only
            return load(weights_only=True)
        with allowed(safe_globals()):
            return load(weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(_refusal(path, src, exc)) from None
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        raise CheckpointError(f"{path} is not a readable torch checkpoint ({_first_line(exc)})") from None


def _refusal(path, src, exc) -> str:
    """The one line for a weights-only refusal: the global the file names that is not allowed."""
    import torch
    names = []
    finder = getattr(torch.serialization, "get_unsafe_globals_in_checkpoint", None)
    if finder is not None and isinstance(src, str):
        try:
            names = [n for n in finder(src) if n not in SAFE_NAMES]
        except Exception:  # noqa: BLE001 - only the message's detail depends on it
            names = []
    if names:
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return (f"{path} was refused without running it: it names {', '.join(sorted(names)[:3])}{more}, which a "
                f"weights-only load does not build; jaxguard loads "
                f"tensors, numbers, strings, numpy scalars and arrays, RNG states and argparse.Namespace safely; "
                + TRUST)
    return f"{path} was refused by torch's weights-only load ({_unpickler_detail(exc)}); " + TRUST


def _unpickler_detail(exc) -> str:
    """What torch's weights-only error says went wrong, without its advice, ANSI codes or line breaks."""
    text = _ANSI.sub("", str(exc))
    m = re.search(r"WeightsUnpickler error:\s*(.+?)(?:\n\s*\n|\nCheck the documentation|$)", text, re.S)
    detail = (m.group(1) if m else text).strip()
    return " ".join(detail.split()) or type(exc).__name__


def _first_line(exc) -> str:
    text = _ANSI.sub("", str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__
