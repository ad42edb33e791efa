"""The writer's agreement check: the numpy reader decodes a sample of every moments entry
as written and compares it bit for bit with what the guard certified; any disagreement
writes nothing (docs/architecture.md, "How a save works").  Numpy only.

Numerical contract
------------------
Bit for bit: the sampled blocks' decoded float32 values must equal the certified values'
bits exactly (NaN payloads and signed zeros included).
"""
from __future__ import annotations

__all__ = ["SAMPLE_EVERY", "SAMPLE_BATCH", "SampleCheck", "decoded_moments"]

import numpy as np

from jaxguard.errors import ContainerError
from jaxguard.format import entropy, reader, spec
from jaxguard.format.entries import Pieces, values_at


# the writer's agreement check decodes every SAMPLE_EVERY-th block (and each entry's
# first and last) with the numpy reader
SAMPLE_EVERY = 64


SAMPLE_BATCH = 1 << 12     # sampled blocks decoded per reader call (entries batched per codec)


def decoded_moments(entry, body, tables, certified, n, sample):
    """The (m~, v~) the decoded hash records for one moments entry as written.

    With the guard's certified values at hand (`Encoded.decoded`) those are hashed, so the
    hash records what was certified; the numpy reader reads the entry as written and a
    sample of its blocks goes to `sample` (a `SampleCheck`), which decodes it and compares
    bit for bit.  Without them (another writer) the reader decodes the whole entry.

    Args:
      entry: the entry's header record as written (``name``, ``codec``, ``sections``, ...).
      body: the entry's payload sections (a uint8 array; offsets as in ``entry``).
      tables: the stored tables the container carries (name -> float32 array).
      certified: the guard's certified ``(m, v)`` (arrays or `Pieces`), a jitted encode's
        certified sample (a dict), or None.
      n: the entry's coordinate count.
      sample: the `SampleCheck` that collects the sampled blocks.

    Returns:
      ``(m, v)``: the values the decoded hash records.

    Raises:
      ContainerError: the reader refuses the entry, or its decode disagrees with a
        certified sample, or the certified values have the wrong dtype or size.
    """
    name = entry["name"]
    try:
        if certified is None or isinstance(certified, dict):
            m, v = reader.read_moments(entry, body, tables)
        else:   # a zstd entry's codes decoded frame by frame, only at the sampled positions
            codes = reader.read_codes(entry, body, tables, lazy=True)
    except reader.ReaderError as exc:
        raise ContainerError(f"the reader refused entry {name!r} as written: {exc}") from None
    if certified is None:
        return m, v
    if isinstance(certified, dict):   # a sample of what a jitted encode certified (jaxguard.jit_state)
        _check_sampled(name, m, v, certified)
        return m, v
    m, v = (x if isinstance(x, Pieces) else np.asarray(x).reshape(-1) for x in certified)
    if m.dtype != np.float32 or v.dtype != np.float32 or m.size != n or v.size != n:
        raise ContainerError(f"entry {name!r}: its certified values are {m.dtype}[{m.size}] and {v.dtype}[{v.size}], "
                             f"expected float32[{n}]; encode it again with jaxguard.core.guard.encode")
    if n:
        try:
            sample.add(name, entry["codec"], codes, m, v, n)
        except entropy.StreamError as exc:   # a lazily read zstd frame the reader refuses
            raise ContainerError(f"the reader refused entry {name!r} as written: {exc}") from None
    return m, v


def _check_sampled(name, m, v, certified):
    """The reader's decode `m`, `v` of an entry against the certified values at
    ``certified["positions"]`` (``"m"``, ``"v"``), bit for bit."""
    pos = np.asarray(certified["positions"], np.int64)
    cm, cv = (np.asarray(certified[k], np.float32).reshape(-1) for k in ("m", "v"))
    m, v = np.asarray(m).reshape(-1), np.asarray(v).reshape(-1)
    if cm.size != pos.size or cv.size != pos.size or (pos.size and (pos.min() < 0 or pos.max() >= m.size)):
        raise ContainerError(f"entry {name!r}: its certified sample does not match the entry ({pos.size} positions, "
                             f"{cm.size} and {cv.size} values, {m.size} coordinates); encode it again")
    bad = (m[pos].view(np.uint32) != cm.view(np.uint32)) | (v[pos].view(np.uint32) != cv.view(np.uint32))
    if bad.any():
        j = int(np.argmax(bad))
        i = int(pos[j])
        raise ContainerError(f"entry {name!r}: the numpy reader decodes coordinate {i} (block {i // spec.BLOCK}) "
                             f"to ({m[i]!r}, {v[i]!r}) but the guard certified ({cm[j]!r}, {cv[j]!r}); "
                             "nothing was written")


class SampleCheck:
    """Sampled blocks of many entries, decoded by the numpy reader a batch at a time (per
    codec: the reader decodes block by block) and compared with the certified values."""

    def __init__(self, tables):
        self.tables, self.pending, self.blocks = tables, {}, {}

    def add(self, name, codec, codes, m, v, n):
        """Queue an entry's sampled blocks (every `SAMPLE_EVERY`-th, and the last); a codec's
        batch is checked once it holds `SAMPLE_BATCH` blocks.

        Args:
          name: the entry's name (for the error).
          codec: its codec name.
          codes: its codes as the reader reads them (``m_codes``, ``v_codes``, params, escapes).
          m, v: its certified values (arrays or `Pieces`).
          n: its coordinate count (at least 1).

        Raises:
          ContainerError: a checked batch's decode disagrees with the certified values.
        """
        nb = -(-n // spec.BLOCK)
        blocks = np.arange(0, nb, SAMPLE_EVERY)
        if blocks[-1] != nb - 1:
            blocks = np.append(blocks, nb - 1)
        pos = (blocks[:, None] * spec.BLOCK + np.arange(spec.BLOCK)).reshape(-1)
        at = np.minimum(pos, n - 1)    # past the end: a copy of the last code, never compared
        esc = codes["escape_index"]
        if esc.size:
            b = esc // spec.BLOCK
            sel = np.flatnonzero((b % SAMPLE_EVERY == 0) | (b == nb - 1))
            k = np.searchsorted(blocks, b[sel]) * spec.BLOCK + esc[sel] % spec.BLOCK
            pairs = codes["escape_pairs"][sel]
        else:
            k, pairs = esc[:0], codes["escape_pairs"][:0]
        item = (name, pos, pos < n, codes["m_codes"][at], codes["v_codes"][at], codes["m_params"][blocks],
                codes["v_params"][blocks], k, pairs, values_at(m, at), values_at(v, at))
        self.pending.setdefault(codec, []).append(item)
        self.blocks[codec] = self.blocks.get(codec, 0) + blocks.size
        if self.blocks[codec] >= SAMPLE_BATCH:
            self.flush(codec)

    def flush(self, codec=None):
        """Check the queued blocks now.

        Args:
          codec: only this codec's queue; None: every queue.

        Raises:
          ContainerError: a decode disagrees with the certified values.
        """
        for c in [codec] if codec is not None else list(self.pending):
            items = self.pending.pop(c, [])
            self.blocks[c] = 0
            if items:
                self._check(c, items)

    def _check(self, codec, items):
        cat = [np.concatenate([it[j] for it in items]) for j in range(3, 7)]
        sizes = [it[1].size for it in items]
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        try:
            ms, vs = reader.decode_codes(codec, int(sum(sizes)), *cat, self.tables)
        except reader.ReaderError as exc:
            raise ContainerError(f"the reader refused entry {items[0][0]!r} as written: {exc}") from None
        ms, vs = ms.copy(), vs.copy()
        k = np.concatenate([it[7] + s for it, s in zip(items, starts)]).astype(np.int64)
        pairs = np.concatenate([it[8] for it in items])
        ms[k], vs[k] = pairs[:, 0], pairs[:, 1]
        want_m, want_v, inside = (np.concatenate([it[j] for it in items]) for j in (9, 10, 2))
        bad = ((ms.view(np.uint32) != want_m.view(np.uint32)) | (vs.view(np.uint32) != want_v.view(np.uint32))) & inside
        if bad.any():
            j = int(np.argmax(bad))
            e = int(np.searchsorted(starts, j, side="right")) - 1
            name, i = items[e][0], int(items[e][1][j - starts[e]])
            raise ContainerError(f"entry {name!r}: the numpy reader decodes coordinate {i} (block {i // spec.BLOCK}) "
                                 f"to ({ms[j]!r}, {vs[j]!r}) but the guard certified ({want_m[j]!r}, "
                                 f"{want_v[j]!r}); nothing was written")
