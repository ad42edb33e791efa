"""The entries a container holds, as the writer is given them: `Raw` arrays stored as they
are, `Moments` (an entry's encoding and its certified values, whole or in `Pieces`), and
the dtype names the header records.  Numpy only.

Numerical contract
------------------
Nothing here computes: entries carry the encoder's arrays and certified values unchanged.
"""
from __future__ import annotations

__all__ = ["SCHEMA", "Raw", "Pieces", "Moments", "flat_parts", "values_at", "checked_entry", "numpy_dtype_name"]

from typing import Any, NamedTuple

import numpy as np

from jaxguard.errors import ContainerError
from jaxguard.format import reader


SCHEMA = "jaxguard-container"


class Raw(NamedTuple):
    """A container entry stored exactly: `array` as it is (``dtype``: the container dtype
    name when it is not numpy's, e.g. ``"bfloat16"`` for uint16 bits; None: numpy's name)."""

    name: str
    array: Any
    dtype: str | None = None


class Pieces:
    """A flat float32 array kept as its consecutive pieces: the certified values of a tensor
    certified a slab-sized piece at a time (`jaxguard.core.guard.join_pieces`).  The writer
    hashes the pieces in order and gathers its sampled blocks from them, so the tensor's
    values are never joined into fresh memory (8 bytes a coordinate: 0.76 GB of GPT-2's
    moments, about 1 CPU-second of page faults and copies); ``np.asarray`` joins them.

    Args:
      parts: 1-D arrays in order.
    """

    def __init__(self, parts):
        self.parts = [np.asarray(p).reshape(-1) for p in parts]
        self.offsets = np.cumsum([0] + [p.size for p in self.parts]).astype(np.int64)
        self.size = int(self.offsets[-1])
        self.shape = (self.size,)
        self.dtype = np.result_type(*self.parts) if self.parts else np.dtype(np.float32)

    def __len__(self):
        return self.size

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate(self.parts) if self.parts else np.zeros(0, self.dtype)
        return out if dtype is None else out.astype(dtype, copy=False)

    def take(self, idx) -> np.ndarray:
        """The values at flat positions, gathered piece by piece (``np.asarray(self)[idx]``).

        Args:
          idx: an int array of positions in ``[0, size)``.

        Returns:
          An array of `idx`'s shape.
        """
        idx = np.asarray(idx, np.int64)
        out = np.empty(idx.shape, self.dtype)
        flat, dst = idx.reshape(-1), out.reshape(-1)
        if flat.size > 1 and not (flat[1:] >= flat[:-1]).all():
            order = np.argsort(flat, kind="stable")
            dst[order] = self.take(flat[order])
            return out
        # sorted positions: each piece's are one run, found by bisection (no sort, no masks)
        cuts = np.searchsorted(flat, self.offsets)
        for i, part in enumerate(self.parts):
            a, b = cuts[i], cuts[i + 1]
            if b > a:
                dst[a:b] = part[flat[a:b] - self.offsets[i]]
        return out


def flat_parts(x):
    """The consecutive flat pieces of certified values, in order.

    Args:
      x: a `Pieces` or one array.

    Returns:
      A list of 1-D arrays (``x.parts``, or ``[x]`` flattened).
    """
    return x.parts if isinstance(x, Pieces) else [np.asarray(x).reshape(-1)]


def values_at(x, idx):
    """The certified values at flat positions, from pieces or one array.

    Args:
      x: a `Pieces` or a flat array.
      idx: an int array of positions in ``[0, len(x))``.

    Returns:
      ``np.asarray(x)[idx]``, without joining a `Pieces`.
    """
    return x.take(idx) if isinstance(x, Pieces) else x[idx]


class Moments(NamedTuple):
    """A guarded moment pair: `encoded` is a `jaxguard.core.encoded.Encoded` (arrays, codec,
    shape, stats and, from the one writer `jaxguard.writer`, the certified values ``decoded``);
    `info` is the entry's ``config`` (the `GuardConfig` JSON plus the adapter's fields)."""

    name: str
    encoded: Any
    info: dict


def checked_entry(e):
    """`e` if it is a container entry (`Raw` or `Moments`).

    Args:
      e: what a writer was handed as an entry.

    Returns:
      `e`.

    Raises:
      ContainerError: anything else (e.g. the untyped tuples of older code), in one line.
    """
    if isinstance(e, (Raw, Moments)):
        return e
    raise ContainerError(f"a container entry is a {type(e).__name__}; pass jaxguard.format.container.Raw or "
                         "Moments (jaxguard.writer builds them from MomentJob / Raw records)")


def numpy_dtype_name(arr) -> str:
    """The container dtype name of `arr` (numpy's name, e.g. ``"float32"``).

    Args:
      arr: a numpy array (or anything with a ``dtype``).

    Returns:
      Its dtype name, one of `jaxguard.format.reader.DTYPES`.

    Raises:
      ContainerError: a dtype the container cannot store (the message lists those it can).
    """
    name = np.dtype(arr.dtype).name
    if name not in reader.DTYPES:
        raise ContainerError(f"dtype {name} cannot be stored; supported: {', '.join(reader.DTYPES)}")
    return name
