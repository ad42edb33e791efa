"""Decoding of jaxguard codes with torch tensor ops (float32 multiplies only), for
bit-identity checks against JAX and the numpy reader."""
from __future__ import annotations

import torch

BLOCK = 256


def _blocks(q, n):
    nb = max(1, -(-n // BLOCK))
    out = torch.zeros(nb * BLOCK, dtype=q.dtype)
    out[:n] = q
    return out.reshape(nb, BLOCK)


def linear8_decode(q, scale, n):
    return (_blocks(q, n).to(torch.float32) * scale.to(torch.float32)[:, None]).reshape(-1)[:n]


def log_decode(q, lo, r, n, bits=8):
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
    return (table[_blocks(q, n).to(torch.int64)] * absmax[:, None]).reshape(-1)[:n]


def bf16_decode(q):
    return (q.to(torch.int32) << 16).view(torch.float32)


def rel8_decode(qm, scale, qv, wlo, rr, n):
    w = log_decode(torch.where(qv == 0, torch.ones_like(qv), qv), wlo, rr, n)
    return (_blocks(qm, n).to(torch.float32) * scale.to(torch.float32)[:, None]).reshape(-1)[:n] * w
