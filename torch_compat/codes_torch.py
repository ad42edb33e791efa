"""Decoding of jaxguard codes with torch tensor ops (float32 multiplies only), for
bit-identity checks against JAX and the numpy reader.

Which decode a codec id uses comes from the registry (`jaxguard.format.spec`, the
``decode`` field): `DECODERS` holds one torch function per base decode, `decode_codes`
dispatches, `read_moments` decodes a container entry read by the numpy reader.
"""
from __future__ import annotations

__all__ = ["linear8_decode", "log_decode", "table_decode", "rel8_decode", "decode_codes", "read_moments"]

import numpy as np
import torch

from jaxguard.errors import ConfigError
from jaxguard.format import packed, reader, spec
from jaxguard.format.spec import BLOCK


def _blocks(q, n):
    nb = max(1, -(-n // BLOCK))
    out = torch.zeros(nb * BLOCK, dtype=q.dtype)
    out[:n] = q
    return out.reshape(nb, BLOCK)


def linear8_decode(q, scale, n):
    """linear8 codes -> float32: ``f32(q) * scale`` per block, as the numpy reader.

    Args:
      q: int8 codes, a 1-D tensor of n.
      scale: float32 per-block scales.
      n: the tensor's number of coordinates (the codes are padded to whole blocks here).

    Returns:
      A 1-D float32 tensor of n values.
    """
    return (_blocks(q, n).to(torch.float32) * scale.to(torch.float32)[:, None]).reshape(-1)[:n]


def log_decode(q, lo, r, n, bits=8):
    """log codes -> float32: ``lo * r**(q-1)`` by binary powering (the reader's order of
    float32 multiplies), 0 for q = 0.

    Args:
      q: unsigned codes (uint8 or uint16 values), a 1-D tensor of n.
      lo, r: float32 per-block parameters.
      n: the tensor's number of coordinates (the codes are padded to whole blocks here).
      bits: code width, 8, up to 12 (logrel-aw) or 16.

    Returns:
      A 1-D float32 tensor of n values.
    """
    qb = _blocks(q, n).to(torch.int64)
    k = qb - 1
    p = r.to(torch.float32)[:, None].expand(qb.shape).clone()
    val = lo.to(torch.float32)[:, None].expand(qb.shape).clone()
    for _ in range(bits):
        bit = (k & 1) == 1
        val = torch.where(bit, val * p, val)
        p = p * p
        k = k >> 1
    val = torch.where(qb == 0, torch.zeros_like(val), val)
    return val.reshape(-1)[:n]


def table_decode(q, absmax, table, n):
    """Table codes (dynamic8) -> float32: ``table[q] * absmax`` per block.

    Args:
      q: uint8 codes, a 1-D tensor of n.
      absmax: float32 per-block absmax.
      table: the 256 float32 map entries (a tensor).
      n: the tensor's number of coordinates (the codes are padded to whole blocks here).

    Returns:
      A 1-D float32 tensor of n values.
    """
    return (table[_blocks(q, n).to(torch.int64)] * absmax[:, None]).reshape(-1)[:n]


def bf16_decode(q):
    """bf16 codes -> float32 exactly: the 16 bits become the high half of a float32.

    Args:
      q: the bfloat16 bit patterns as a 16-bit integer tensor.

    Returns:
      A float32 tensor of q's shape.
    """
    return (q.to(torch.int32) << 16).view(torch.float32)


def rel8_decode(qm, scale, qv, wlo, rr, n, bits=8):
    """log8-rel m codes -> float32: ``(f32(q) * scale) * w`` with ``w`` the log decode of
    the v codes on the sqrt grid (q = 0 read as code 1).

    Args:
      qm: int8 m codes (int16 for logrel-aw blocks wider than 8 bits), a 1-D tensor of n.
      scale: float32 per-block m-scales.
      qv: the v codes (uint8; 16-bit for wider logrel-aw blocks).
      wlo, rr: float32 per-block sqrt-grid parameters.
      n: the tensor's number of coordinates (the codes are padded to whole blocks here).
      bits: the widest v code width (8, or up to 12 for logrel-aw).

    Returns:
      A 1-D float32 tensor of n values.
    """
    w = log_decode(torch.where(qv == 0, torch.ones_like(qv), qv), wlo, rr, n, bits)
    return (_blocks(qm, n).to(torch.float32) * scale.to(torch.float32)[:, None]).reshape(-1)[:n] * w


def _decode_log8(n, mq, vq, mp, vp, tables):
    return linear8_decode(mq, mp[:, 0], n), log_decode(vq, vp[:, 0], vp[:, 1], n)


def _decode_log8_rel(n, mq, vq, mp, vp, tables):
    bits = 8 if vq.element_size() == 1 else packed.MAX_WIDTH   # 16-bit v codes: logrel-aw blocks up to 12 bits
    return rel8_decode(mq, mp[:, 0], vq, vp[:, 2], vp[:, 3], n, bits), log_decode(vq, vp[:, 0], vp[:, 1], n, bits)


def _decode_bf16(n, mq, vq, mp, vp, tables):
    return bf16_decode(mq.view(torch.int16)), bf16_decode(vq.view(torch.int16))


def _decode_block8(n, mq, vq, mp, vp, tables):
    return (table_decode(mq, mp[:, 0], tables["dynamic8s"], n),
            table_decode(vq, vp[:, 0], tables["dynamic8u"], n))


DECODERS = {"log8": _decode_log8, "log8-rel": _decode_log8_rel, "bf16": _decode_bf16, "block8": _decode_block8}
"""The torch decode of each base decode id (a registry entry's ``decode`` field)."""


def _tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    x = np.asarray(x)
    if x.dtype == np.uint16:          # bf16 bits: torch has no uint16 view for shifts
        x = x.view(np.int16)
    return torch.from_numpy(np.array(x))


def decode_codes(codec, n, m_codes, v_codes, m_params, v_params, tables):
    """Decoded (m~, v~) float32 tensors from a codec's fixed-layout codes (as the numpy reader's).

    Args:
      codec: a registered codec id; its registry ``decode`` field picks the function.
      n: number of coordinates.
      m_codes, v_codes, m_params, v_params: numpy arrays or tensors, as
        `jaxguard.format.reader.decode_codes` takes them.
      tables: the stored tables by name (arrays or tensors), for codecs that use them.

    Returns:
      (m~, v~), float32 tensors of `n` values (escapes not applied).

    Raises:
      ConfigError: the id is not registered, or its decode has no torch implementation.
    """
    base = spec.get(codec).decode
    if base not in DECODERS:
        raise ConfigError(f"codec {codec!r} decodes as {base!r}, which has no torch decode; "
                          f"torch decodes {', '.join(DECODERS)}")
    t = [_tensor(x) for x in (m_codes, v_codes, m_params, v_params)]
    return DECODERS[base](n, *t, {k: _tensor(v) for k, v in tables.items()})


def read_moments(entry, payload, tables):
    """Decoded (m~, v~) float32 tensors of one container moments entry, decoded by torch.

    The sections are read (and checked) by the numpy reader (`reader.read_codes`); the
    arithmetic is torch's, so the result must equal `reader.read_moments` bit for bit.

    Args:
      entry, payload, tables: as for `jaxguard.format.reader.read_moments`.

    Returns:
      (m~, v~), float32 tensors of the entry's shape, escapes applied.

    Raises:
      ReaderError: the entry does not match the format.
    """
    codes = reader.read_codes(entry, payload, tables)
    n = int(codes["m_codes"].size)
    shape = tuple(entry["shape"])
    m, v = decode_codes(entry["codec"], n, codes["m_codes"], codes["v_codes"], codes["m_params"],
                        codes["v_params"], tables)
    m, v = m.clone(), v.clone()
    idx = torch.from_numpy(np.asarray(codes["escape_index"], np.int64))
    pairs = torch.from_numpy(np.array(codes["escape_pairs"], np.float32))
    m[idx] = pairs[:, 0]
    v[idx] = pairs[:, 1]
    return m.reshape(shape), v.reshape(shape)
