"""The encoded forms of one moment pair (pytrees) and their payload accounting.

`Encoded` is what `jaxguard.core.guard.encode` returns and `jaxguard.format.container`
writes; `jaxguard.core.jit_encode.JitEncoded` is its fixed-shape sibling.  Both are
pytrees whose leaves are the arrays (``m_codes``, ``v_codes``, ``m_params``,
``v_params``, ``escape_index``, ``escape_m``, ``escape_v``, optional ``widths``), with
the codec id and shape static; `Encoded` also carries its stats *inside* the pytree
(their numbers are leaves), so ``jax.tree_util.tree_map`` keeps them.
"""
from __future__ import annotations

__all__ = ["ArrayPytree", "Encoded", "payload_bytes"]

import dataclasses

import jax
import numpy as np


ARRAY_FIELDS = ("m_codes", "v_codes", "m_params", "v_params", "escape_index", "escape_m", "escape_v", "widths")


class ArrayPytree:
    """Base of the encoded forms: a dict of arrays (the pytree leaves) plus static codec
    and shape, so jit, vmap, orbax and DCP see plain leaves.  Each array is also an
    attribute (``enc.m_codes``)."""

    def tree_flatten(self):
        keys = tuple(sorted(self.arrays))
        return tuple(self.arrays[k] for k in keys), (keys, self.codec, self.shape)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        keys, codec, shape = aux
        return cls(dict(zip(keys, leaves)), codec, shape)

    def __getattr__(self, name):
        if name in ARRAY_FIELDS or name in ("escape_count", "overflow"):
            arrays = self.__dict__.get("arrays", {})
            if name in arrays:
                return arrays[name]
            if name == "widths":
                return None
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @property
    def n(self) -> int:
        """The number of coordinates, ``prod(shape)`` (1 for a scalar)."""
        return int(np.prod(self.shape, dtype=np.int64))


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class Encoded(ArrayPytree):
    """One guarded moment pair: named arrays plus static codec id and shape.

    arrays: ``m_codes``, ``v_codes`` ([n]), ``m_params``, ``v_params`` ([nblocks, k]),
    ``escape_index`` (int32, sorted), ``escape_m``, ``escape_v`` (float32 exact pairs),
    ``widths`` (logrel-aw only); each also an attribute.  stats: a mapping
    (``enc.stats["escapes"]``, ...) that is part of the pytree (its numbers are leaves).
    decoded: the flat float32 ``(m~, v~)`` the guard certified (escapes applied), which
    the container writer hashes instead of decoding again; only with ``keep_decoded=True``
    (`guard.encode`), else None, and None after any pytree transform (it is no leaf).
    """

    arrays: dict
    codec: str
    shape: tuple
    stats: dict = dataclasses.field(default_factory=dict)
    decoded: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    def tree_flatten(self):
        keys = tuple(sorted(self.arrays))
        return (tuple(self.arrays[k] for k in keys), dict(self.stats)), (keys, self.codec, self.shape)

    @classmethod
    def tree_unflatten(cls, aux, children):
        keys, codec, shape = aux
        arrays, stats = children
        return cls(dict(zip(keys, arrays)), codec, shape, dict(stats))


def payload_bytes(enc: ArrayPytree) -> int:
    """Moment payload as in the paper: codes + block metadata + escape bitmask + 8 B/escape.

    Args:
      enc: an `Encoded` (compact escapes).
    Returns:
      The payload in bytes (logrel-aw: its packed codes, `jaxguard.format.packed`;
      logrel-ans, log8-rel-zstd: their stored sections, kept on `enc` for the writer).
    """
    from jaxguard.core import codecs   # the codec table imports the codes (JAX)
    entry = codecs.get(enc.codec)
    if entry.payload_many is not None and isinstance(enc, Encoded):   # built once, kept for the writer
        return entry.payload_many([enc])[0]
    return entry.payload_bytes(enc.arrays, enc.n)
