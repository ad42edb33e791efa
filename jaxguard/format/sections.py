"""An entry's payload sections as the container writer lays them out: arrays as
little-endian bytes back to back, the stored tables a codec needs, and the sections of a
log8-rel-zstd or logrel-aw/logrel-ans entry (built here, or kept from the guard's payload
stat).  Numpy only.

Numerical contract
------------------
Lossless: every section holds its array's bytes (little-endian, C order) or the
lossless packing of `jaxguard.format.entropy` / `jaxguard.format.packed`.
"""
from __future__ import annotations

__all__ = ["KEPT_SECTIONS", "kept_sections", "le_bytes", "Sections", "codec_spec", "add_tables", "zstd_sections",
           "aw_sections"]

import numpy as np

from jaxguard.errors import ContainerError
from jaxguard.format import entropy, packed, rans, spec


def le_bytes(arr) -> np.ndarray:
    """`arr`'s bytes as a flat uint8 array: little-endian, C order, any dtype (bfloat16 too).

    Args:
      arr: a numpy array (or anything `np.ascontiguousarray` takes).
    """
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)


class Sections:
    """One entry's sections, laid out back to back in a buffer the writer reuses from
    entry to entry (`body`).

    The sections used to be appended to a fresh ``io.BytesIO`` per entry: two copies a
    section holding the GIL (``tobytes``, then the write) and fresh memory for every
    entry, ~250 MB of page faults on GPT-2's moments.  Here each section is copied once,
    by numpy (which releases the GIL for large copies), into memory the previous entries
    already faulted in."""

    def __init__(self, scratch):
        self.parts, self.size, self.scratch = [], 0, scratch

    def add(self, arr) -> list:
        """Append an array's bytes, little-endian, C order (any dtype, bfloat16 too).

        Args:
          arr: a numpy array.

        Returns:
          ``[start, end]``, its byte range in the entry.
        """
        flat = le_bytes(arr)
        b = self.size
        self.parts.append(flat)
        self.size += flat.size
        return [b, self.size]

    def body(self) -> np.ndarray:
        """Returns: the sections as one uint8 array, valid until the next entry's `body`."""
        if self.scratch[0].size < self.size:
            self.scratch[0] = np.empty(max(self.size, self.scratch[0].size * 5 // 4), np.uint8)
        out = self.scratch[0][:self.size]
        b = 0
        for part in self.parts:
            out[b:b + part.size] = part
            b += part.size
        self.parts = []
        return out


def codec_spec(codec, name):
    """The registry's spec of an entry's codec (`jaxguard.format.spec.get`).

    Args:
      codec: the codec name.
      name: the entry's name (for the error).

    Raises:
      ContainerError: a codec the registry does not know, naming the entry.
    """
    try:
        return spec.get(codec)
    except spec.UnknownCodecError as exc:
        raise ContainerError(f"entry {name!r}: {exc}") from None


def add_tables(pay, tables, table_arrays, names):
    """Append the stored tables `names` not yet in the payload (in the registry's order).

    Args:
      pay: the payload (a `Sections` or the writer's sink: anything with ``add(array)``).
      tables: table name -> byte range in the payload, updated.
      table_arrays: table name -> float32 array, updated.
      names: the tables an entry's codec needs.
    """
    for t in names:
        if t not in tables:
            table_arrays[t] = np.asarray(spec.TABLES[t](), np.float32)
            tables[t] = pay.add(table_arrays[t])


KEPT_SECTIONS = "_sections"   # an encoding's sections as its codec built them: (the arrays they came from, sections)


def kept_sections(enc):
    """The sections the guard already built from exactly this encoding's arrays (its payload
    stat; `jaxguard.core.codecs`), or None: the writer then does not build them again.

    Args:
      enc: an `Encoded` (its sections are kept only while its arrays are the very same objects).
    """
    kept = getattr(enc, KEPT_SECTIONS, None)
    if (kept is not None and kept[0].keys() == enc.arrays.keys()
            and all(enc.arrays[k] is a for k, a in kept[0].items())):
        return kept[1]
    return None


def zstd_sections(pay, enc) -> dict:
    """Sections of a log8-rel-zstd entry (`entropy.entry_sections`, or those kept on the encoding).

    Args:
      pay: the entry's `Sections`.
      enc: its `Encoded`.

    Returns:
      Section name -> byte range in the entry.

    Raises:
      ContainerError: arrays the packing refuses.
    """
    arrays = kept_sections(enc)
    try:
        arrays = arrays if arrays is not None else entropy.entry_sections(enc.arrays, enc.n)
    except packed.PackError as exc:
        raise ContainerError(f"cannot store {enc.codec} moments: {exc}") from None
    return {k: pay.add(a) for k, a in arrays.items()}


def aw_sections(pay, enc, rans_coded=False) -> dict:
    """Sections of a logrel-aw / logrel-ans entry (`packed.entry_sections`), appended to `pay`
    in the order the first release wrote them (the escape positions first).  An encoding
    whose sections the guard already built from these very arrays (logrel-ans: the payload
    stat) is not encoded again.

    Args:
      pay: the entry's `Sections`.
      enc: its `Encoded`.
      rans_coded: rANS-code the code streams (logrel-ans).

    Returns:
      Section name -> byte range in the entry.

    Raises:
      ContainerError: arrays the packing or the rANS coder refuses.
    """
    arrays = kept_sections(enc)
    try:
        arrays = arrays if arrays is not None else packed.entry_sections(enc.arrays, enc.n, entropy=rans_coded)
    except (packed.PackError, rans.RansError) as exc:
        raise ContainerError(f"cannot store {enc.codec} moments: {exc}") from None
    esc = next(k for k in arrays if k in spec.ESCAPE_FORMS)
    ranges = {esc: pay.add(arrays[esc])}
    ranges.update((k, pay.add(a)) for k, a in arrays.items() if k != esc)
    return {k: ranges[k] for k in arrays}
