"""Framed zstd streams, the storage of every section of a ``log8-rel-zstd`` entry
(`jaxguard.format.entropy`): varint headers, frames that decode independently, and
float32 values in byte planes.  Numpy only; ``zstandard`` is imported when a frame is
written or read.

A stream is ``varint D`` (decoded bytes), ``varint S_i`` for each of ``ceil(D / FRAME)``
frames, then the frames: frame i decodes to ``d_i = min(FRAME, D - i*FRAME)`` bytes and is
stored as is when ``S_i == d_i``, else as one zstd frame without the magic number, its
content size written (and equal to ``d_i``), no dictionary, ``S_i < d_i`` bytes exactly.

Numerical contract
------------------
Lossless: a stream decodes to exactly the bytes it was given (zstd decodes bit-exactly;
a frame stored as is is those bytes), and byte planes only regroup a value's bytes.
"""
from __future__ import annotations

__all__ = ["FRAME", "LEVEL", "MAX_STREAM", "StreamError", "frame_lengths", "compress_frames", "join_frames",
           "encode_stream", "bytes_view", "stream_frames", "decode_frame", "decode_stream", "to_planes", "from_planes"]

import threading

import numpy as np

from jaxguard.errors import JaxguardError
from jaxguard.format import packed


FRAME = 1 << 20          # decoded bytes per frame (a whole number of blocks of 1-byte codes)


LEVEL = 1                # zstd level: 1 and 3 store the same +-0.03% here, level 1 at 1.5x the speed


MAX_STREAM = 1 << 44     # decoded bytes a stream may declare (the reader's 2**40 elements x 20 bytes)


class StreamError(JaxguardError):
    """A zstd stream of an entry is malformed (the message names the section and the fault)."""


# ---------------------------------------------------------------- varints
def _varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b = x & 0x7F
        x >>= 7
        out.append(b | (0x80 if x else 0))
        if not x:
            return bytes(out)


def _read_varint(buf, pos: int, what: str):
    try:
        first = buf[pos]
    except IndexError:
        raise StreamError(f"{what}: the stream ends inside its header") from None
    if first < 0x80:                      # one byte: most lengths of a small entry's streams
        return first, pos + 1
    val, shift = 0, 0
    for k in range(packed.MAX_VARINT_BYTES):
        if pos + k >= len(buf):
            raise StreamError(f"{what}: the stream ends inside its header")
        b = int(buf[pos + k])
        val |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return val, pos + k + 1
    raise StreamError(f"{what}: a header varint is longer than {packed.MAX_VARINT_BYTES} bytes")


# ---------------------------------------------------------------- zstd, imported when used
_LOCAL = threading.local()


def _zstd():
    try:
        import zstandard
    except ImportError:   # pragma: no cover - a dependency; kept for a broken environment
        raise StreamError("this entry's streams are zstd frames and the zstandard package is not installed; "
                          "pip install zstandard") from None
    return zstandard


def _compressor(level: int):
    """A zstd compressor of this thread (they are not shareable between threads)."""
    key = f"c{level}"
    c = getattr(_LOCAL, key, None)
    if c is None:
        zs = _zstd()
        params = zs.ZstdCompressionParameters.from_level(level, format=zs.FORMAT_ZSTD1_MAGICLESS,
                                                         write_content_size=True, write_checksum=False,
                                                         write_dict_id=False)
        c = zs.ZstdCompressor(compression_params=params)
        setattr(_LOCAL, key, c)
    return c


def _decompressor():
    d = getattr(_LOCAL, "d", None)
    if d is None:
        zs = _zstd()
        d = zs.ZstdDecompressor(format=zs.FORMAT_ZSTD1_MAGICLESS)
        _LOCAL.d = d
        _LOCAL.error = zs.ZstdError
    return d


# ---------------------------------------------------------------- streams
def frame_lengths(decoded: int) -> list:
    """Decoded bytes of each frame of a stream of `decoded` bytes (``[]`` for none).

    Args:
      decoded: the stream's decoded length in bytes.
    """
    return [min(FRAME, decoded - s) for s in range(0, decoded, FRAME)]


def compress_frames(data, level: int = LEVEL) -> list:
    """The stored frames of `data` (bytes-like): each `FRAME` bytes as a zstd frame, or as
    is where zstd does not make it smaller.

    Args:
      data: the bytes to store (a uint8 array or anything with the buffer protocol).
      level: the zstd level.

    Returns:
      A list of ``bytes``-like frames, one per `frame_lengths`.
    """
    view = memoryview(_as_bytes(data))
    out = []
    c = _compressor(level) if len(view) > 64 else None   # below that a frame's header outweighs it
    for s in range(0, len(view), FRAME):
        part = view[s:s + FRAME]
        z = c.compress(part) if c is not None else None
        out.append(z if z is not None and len(z) < len(part) else bytes(part))
    return out


def join_frames(decoded: int, frames) -> np.ndarray:
    """A stream's bytes from its frames (`compress_frames`) and decoded length.

    Args:
      decoded: the stream's decoded length in bytes.
      frames: the stored frames, in order (`compress_frames`).
    """
    head = _varint(decoded) + b"".join(_varint(len(f)) for f in frames)
    if len(frames) == 1:
        return np.frombuffer(head + bytes(frames[0]), np.uint8)
    out = np.empty(len(head) + sum(len(f) for f in frames), np.uint8)
    out[:len(head)] = np.frombuffer(head, np.uint8)
    pos = len(head)
    for f in frames:
        out[pos:pos + len(f)] = np.frombuffer(f, np.uint8)
        pos += len(f)
    return out


def encode_stream(data, level: int = LEVEL) -> np.ndarray:
    """One stream (module docstring) holding `data`.

    Args:
      data: bytes-like or a numpy array (its bytes, C order).
      level: the zstd level.

    Returns:
      The stream as a uint8 array.
    """
    arr = _as_bytes(data)
    return join_frames(arr.size, compress_frames(arr, level))


def _as_bytes(data) -> np.ndarray:
    """`data`'s bytes as a flat contiguous uint8 array (a numpy array's in C order)."""
    if isinstance(data, np.ndarray):
        return np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    return np.frombuffer(data, np.uint8)


def bytes_view(buf) -> memoryview:
    """`buf` as a flat byte memoryview (no copy).

    Args:
      buf: bytes, a memoryview of the payload, a uint8 array.
    """
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def stream_frames(buf, what: str, expected=None, limit: int = MAX_STREAM):
    """Parse a stream's header.

    Args:
      buf: the stream's bytes (bytes-like or a uint8 array).
      what: how errors name the section (``"entry.section"``).
      expected: the decoded lengths the stream may declare (an int or a tuple of ints);
        None: any up to `limit`.
      limit: the most decoded bytes the stream may declare.

    Returns:
      ``(decoded bytes, [(start, stored, decoded) per frame])``, offsets into `buf`.

    Raises:
      StreamError: a malformed header, a length other than `expected`, frame sizes that do
        not tile the stream, or a frame stored larger than it decodes.
    """
    return _stream_frames(bytes_view(buf), what, expected, limit)


def _stream_frames(mv, what, expected=None, limit=MAX_STREAM):
    """`stream_frames` of a flat byte memoryview (the readers' form: no second view)."""
    decoded, pos = _read_varint(mv, 0, what)
    if expected is not None and decoded != expected and (isinstance(expected, int) or decoded not in expected):
        want = " or ".join(str(a) for a in ((expected,) if isinstance(expected, int) else expected))
        raise StreamError(f"{what}: the stream declares {decoded} decoded bytes where {want} are needed")
    if decoded > min(limit, MAX_STREAM):
        raise StreamError(f"{what}: the stream declares {decoded} decoded bytes, more than its entry can hold "
                          f"({min(limit, MAX_STREAM)})")
    sizes = []
    for d in (frame_lengths(decoded) if decoded > FRAME else (decoded,) if decoded else ()):
        s, pos = _read_varint(mv, pos, what)
        if s > d or s == 0:
            raise StreamError(f"{what}: frame {len(sizes)} is stored in {s} bytes for {d} decoded; a frame is "
                              "stored as is or smaller")
        sizes.append((s, d))
    frames, start = [], pos
    for s, d in sizes:
        frames.append((start, s, d))
        start += s
    if start != len(mv):
        raise StreamError(f"{what}: the frames take {start - pos} bytes but the stream has {len(mv) - pos} "
                          "after its header")
    return decoded, frames


def _zstd_frame_end(frame, what):
    """The length of the (magic-less) zstd frame at the start of `frame` and its content
    size, from its header and block headers (RFC 8878 3.1.1)."""
    n = len(frame)
    if n < 1:
        raise StreamError(f"{what}: an empty zstd frame")
    fhd = frame[0]
    fcs_flag, single, reserved, checksum, dict_flag = fhd >> 6, (fhd >> 5) & 1, (fhd >> 3) & 1, (fhd >> 2) & 1, fhd & 3
    if reserved or dict_flag:
        raise StreamError(f"{what}: a zstd frame header with {'a reserved bit' if reserved else 'a dictionary'} set")
    pos = 1 + (0 if single else 1)
    fcs_size = (1 if single else 0, 2, 4, 8)[fcs_flag]
    if fcs_size == 0:
        raise StreamError(f"{what}: a zstd frame without its content size")
    if pos + fcs_size > n:
        raise StreamError(f"{what}: a zstd frame header runs past the frame")
    content = int.from_bytes(frame[pos:pos + fcs_size], "little") + (256 if fcs_size == 2 else 0)
    pos += fcs_size
    while True:
        if pos + 3 > n:
            raise StreamError(f"{what}: a zstd block header runs past the frame")
        bh = frame[pos] | (frame[pos + 1] << 8) | (frame[pos + 2] << 16)
        last, btype, bsize = bh & 1, (bh >> 1) & 3, bh >> 3
        if btype == 3:
            raise StreamError(f"{what}: a zstd block of the reserved type")
        pos += 3 + (1 if btype == 1 else bsize)
        if pos > n:
            raise StreamError(f"{what}: a zstd block runs past the frame")
        if last:
            break
    return pos + (4 if checksum else 0), content


def _zstd_exact(frame, decoded):
    """The `decoded` bytes of the zstd frame `frame` (a flat byte memoryview), or None
    where `decode_frame`'s checks are needed to name a fault: a frame header with a
    reserved bit, a dictionary or no content size, a content size other than `decoded`
    (read before zstd allocates it), a frame zstd refuses or that leaves bytes unused.
    Whatever this accepts, the block-by-block parse (`_zstd_frame_end`) accepts too, with
    the same bytes: zstd walks the same block headers, and ``allow_extra_data=False``
    refuses a frame that ends before `frame` does."""
    fhd = frame[0]
    if fhd & 0x0B:                           # the reserved bit, a dictionary id
        return None
    single = fhd & 0x20
    size = (1 if single else 0, 2, 4, 8)[fhd >> 6]
    pos = 1 if single else 2
    if not size or pos + size > len(frame):
        return None
    content = int.from_bytes(frame[pos:pos + size], "little") + (256 if size == 2 else 0)
    if content != decoded:
        return None
    d = _decompressor()
    try:
        out = d.decompress(frame, max_output_size=decoded, allow_extra_data=False)
    except _LOCAL.error:
        return None
    return out if len(out) == decoded else None


def decode_frame(buf, start: int, stored: int, decoded: int, what: str):
    """One frame's decoded bytes (a bytes-like object of `decoded` bytes).

    Args:
      buf: the stream (bytes-like); start, stored, decoded: the frame (`stream_frames`).
      what: how errors name the section.

    Raises:
      StreamError: a zstd frame that does not take exactly `stored` bytes, declares
        another content size, or that zstd refuses.
    """
    frame = bytes_view(buf)[start:start + stored]
    if stored == decoded:
        return frame
    out = _zstd_exact(frame, decoded) if stored else None
    return out if out is not None else _decode_frame_checked(frame, decoded, what)


def _decode_frame_checked(frame, decoded, what):
    """`decode_frame` of a zstd frame by its parsed header and block headers first: the
    fault named (`_zstd_exact` refused it), or its bytes."""
    end, content = _zstd_frame_end(frame, what)
    stored = len(frame)
    if end != stored or content != decoded:
        raise StreamError(f"{what}: a zstd frame of {end} bytes decoding to {content} is stored in {stored} bytes "
                          f"for {decoded}")
    try:
        out = _decompressor().decompress(frame, max_output_size=decoded)
    except _zstd().ZstdError as exc:
        raise StreamError(f"{what}: zstd refuses a frame ({str(exc)[:80]})") from None
    if len(out) != decoded:
        raise StreamError(f"{what}: a zstd frame decodes to {len(out)} bytes, not {decoded}")
    return out


def _short_varint(mv, pos):
    """The varint of at most 3 bytes (below 2**21: a frame's lengths) at `pos` and the
    position after it; None where it is longer.  Raises IndexError past the end."""
    x = mv[pos]
    if x < 0x80:
        return x, pos + 1
    y = mv[pos + 1]
    if y < 0x80:
        return (x & 0x7F) | (y << 7), pos + 2
    z = mv[pos + 2]
    if z >= 0x80:
        return None
    return (x & 0x7F) | ((y & 0x7F) << 7) | (z << 14), pos + 3


def _one_frame(mv, expected, limit):
    """`decode_stream` of a stream of at most one frame (most sections of a small entry),
    its header read inline; None where anything is other than a valid stream of one frame
    (the general path then decodes it or names the fault, as it would have)."""
    n = len(mv)
    try:
        head = _short_varint(mv, 0)
        if head is None:
            return None
        d, pos = head
        if expected is not None and d != expected and (isinstance(expected, int) or d not in expected):
            return None
        if d > FRAME or d > limit:
            return None
        if d == 0:
            return np.empty(0, np.uint8) if pos == n else None
        head = _short_varint(mv, pos)
        if head is None:
            return None
        s, pos = head
    except IndexError:
        return None
    if s > d or s == 0 or pos + s != n:
        return None
    if s == d:                               # stored as is: a view of the payload
        return np.frombuffer(mv, np.uint8, d, pos)
    out = _zstd_exact(mv[pos:], d)
    return None if out is None else np.frombuffer(out, np.uint8)


def decode_stream(buf, what: str, expected=None, out=None, limit: int = MAX_STREAM) -> np.ndarray:
    """A whole stream's decoded bytes.

    Args:
      buf: the stream (bytes-like or a uint8 array).
      what: how errors name the section.
      expected, limit: as for `stream_frames`.
      out: optional uint8 array of the decoded length to decode into.

    Returns:
      uint8 array of the decoded bytes (a view of `buf` for a stream stored as is).

    Raises:
      StreamError: as `stream_frames` and `decode_frame`.
    """
    mv = bytes_view(buf)
    if out is None:
        one = _one_frame(mv, expected, limit)
        if one is not None:
            return one
    decoded, frames = _stream_frames(mv, what, expected, limit)
    if len(frames) == 1 and out is None:
        start, stored, d = frames[0]
        if stored == d:                      # stored as is: a view of the payload
            return np.frombuffer(mv, np.uint8, d, start)
        return np.frombuffer(decode_frame(mv, start, stored, d, what), np.uint8)
    out = np.empty(decoded, np.uint8) if out is None else out
    pos = 0
    for start, stored, d in frames:
        out[pos:pos + d] = np.frombuffer(decode_frame(mv, start, stored, d, what), np.uint8)
        pos += d
    return out


# ---------------------------------------------------------------- byte planes (float32 parameters)
def to_planes(values) -> np.ndarray:
    """float32 values -> their little-endian bytes regrouped by plane (every value's byte 0,
    then byte 1, 2, 3): the exponent bytes of similar values sit together.

    Args:
      values: float32 values (any shape; taken in C order).
    """
    b = np.ascontiguousarray(np.asarray(values, "<f4")).reshape(-1).view(np.uint8)
    return np.ascontiguousarray(b.reshape(-1, 4).T).reshape(-1)


def from_planes(planes) -> np.ndarray:
    """Inverse of `to_planes`: float32 values.

    Args:
      planes: the uint8 bytes `to_planes` returned.
    """
    p = np.asarray(planes, np.uint8)
    return np.ascontiguousarray(p.reshape(4, -1).T).reshape(-1).view("<f4")
