"""The core's codec table: for each registry id (`jaxguard.format.spec.CODECS`) its JAX
propose and decode.

`TABLE[id]` is a `CoreCodec`; the guard, the jit path and the joint search look a codec
up here instead of branching on its name.  An id whose registry entry names another
decode (``block8-unguarded`` -> block8, ``logrel-aw`` and ``logrel-ans`` -> log8-rel) shares
that decode (log8-rel's decode powers 16-bit v codes, logrel-aw's 9..12-bit blocks, at 12 bits);
``logrel-ans`` is logrel-aw's entry with its own payload count (rANS storage) and, after the
width search, the rate pass (`jaxguard.core.rate`: certified codes of fewer coded bits).
Adding a codec: its `spec.CodecSpec`, its encode/decode in `jaxguard.core.codes`, one
entry here, golden vectors (docs/architecture.md).

Numerical contract
------------------
``decode_blocks`` is the reader's arithmetic (`jaxguard.format.reader`) bit for bit,
and ``propose`` returns with its codes the values ``decode_blocks`` gives for them: the
guard certifies exactly what a reader will produce (tests/golden/codes_v1.npz).
"""
from __future__ import annotations

__all__ = ["TABLE", "get", "propose"]

import dataclasses
import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard.core import adaptive as _adaptive
from jaxguard.core import codes
from jaxguard.core import rate as _rate
from jaxguard.core import floatbits as _fb
from jaxguard.errors import ConfigError
from jaxguard.format import container as _container
from jaxguard.format import entropy as _entropy
from jaxguard.format import packed as _packed
from jaxguard.format import spec as _spec

_log8 = functools.partial(codes.log_encode_block, bits=8)
_log8_decode = functools.partial(codes.log_decode_block, bits=8)


# ---------------------------------------------------------------- propose: blocks [nb, 256] -> codes, params, m~, v~
def _propose_log8(mb, vb, valid, vpos):
    mq, ms = jax.vmap(codes.linear8_encode_block)(mb, valid)
    vq, lo, r = jax.vmap(_log8)(vb, valid, positive=vpos)
    mt = jax.vmap(codes.linear8_decode_block)(mq, ms)
    vt = jax.vmap(_log8_decode)(vq, lo, r)
    return mq, vq, ms[:, None], jnp.stack([lo, r], axis=1), mt, vt


def _propose_log8_rel(mb, vb, valid, vpos):
    return _propose_log8_rel_m(mb, vb, valid, vpos, *_propose_log8_rel_v(mb, vb, valid, vpos))


def _propose_log8_rel_v(mb, vb, valid, vpos):
    """log8-rel's first stage: v's log codes and grid ``(vq, lo, r)``."""
    return jax.vmap(_log8)(vb, valid, positive=vpos)


def _propose_log8_rel_m(mb, vb, valid, vpos, vq, lo, r):
    """log8-rel's second stage: m's codes on v's sqrt grid, both decodes (the proposal's output)."""
    # stored, then decoded by the reader as given: XLA must not fold rr * rr back into r
    z = _fb.opaque_zero()
    wlo, rr = _fb.barrier(jnp.sqrt(lo), z), _fb.barrier(jnp.sqrt(r), z)
    w = jax.vmap(codes.sqrt_scale_block)(vq, wlo, rr)
    mq, ms = jax.vmap(codes.rel8_encode_block)(mb, valid, w, wlo)
    mt = jax.vmap(codes.rel8_decode_block)(mq, ms, w)
    vt = jax.vmap(_log8_decode)(vq, lo, r)
    return mq, vq, ms[:, None], jnp.stack([lo, r, wlo, rr], axis=1), mt, vt


def _propose_bf16(mb, vb, valid, vpos):
    mq, vq = codes.bf16_encode(mb), codes.bf16_encode(vb)
    empty = jnp.zeros((mb.shape[0], 0), jnp.float32)
    return (jax.lax.bitcast_convert_type(mq, jnp.uint16), jax.lax.bitcast_convert_type(vq, jnp.uint16),
            empty, empty, codes.bf16_decode(mq), codes.bf16_decode(vq))


def _propose_block8(mb, vb, valid, vpos):
    ts, tu = codes.dynamic_map(True), codes.dynamic_map(False)
    mq, ma = jax.vmap(lambda x, ok: codes.dynamic8_encode_block(x, ok, ts, True))(mb, valid)
    vq, va = jax.vmap(lambda x, ok: codes.dynamic8_encode_block(x, ok, tu, False))(vb, valid)
    mt = jax.vmap(lambda q, s: codes.dynamic8_decode_block(q, s, ts))(mq, ma)
    vt = jax.vmap(lambda q, s: codes.dynamic8_decode_block(q, s, tu))(vq, va)
    return mq, vq, ma[:, None], va[:, None], mt, vt


# ---------------------------------------------------------------- decode: blocked codes + params -> m~, v~ blocked
def _decode_log8(mq, vq, mp, vp):
    return jax.vmap(codes.linear8_decode_block)(mq, mp[:, 0]), jax.vmap(_log8_decode)(vq, vp[:, 0], vp[:, 1])


def _decode_log8_rel(mq, vq, mp, vp):
    # 16-bit v codes: logrel-aw / logrel-ans blocks of up to 12 bits, powered at 12 bits (the
    # same values for narrower codes); 8-bit codes keep log8-rel's 8 powers
    bits = 8 if jnp.dtype(vq.dtype).itemsize == 1 else _packed.MAX_WIDTH
    w = jax.vmap(functools.partial(codes.sqrt_scale_block, bits=bits))(vq, vp[:, 2], vp[:, 3])
    vt = jax.vmap(functools.partial(codes.log_decode_block, bits=bits))(vq, vp[:, 0], vp[:, 1])
    return jax.vmap(codes.rel8_decode_block)(mq, mp[:, 0], w), vt


def _decode_bf16(mq, vq, mp, vp):
    return (codes.bf16_decode(jax.lax.bitcast_convert_type(mq, jnp.bfloat16)),
            codes.bf16_decode(jax.lax.bitcast_convert_type(vq, jnp.bfloat16)))


def _decode_block8(mq, vq, mp, vp):
    ts, tu = codes.dynamic_map(True), codes.dynamic_map(False)
    return (jax.vmap(lambda q, s: codes.dynamic8_decode_block(q, s, ts))(mq, mp[:, 0]),
            jax.vmap(lambda q, s: codes.dynamic8_decode_block(q, s, tu))(vq, vp[:, 0]))


# ---------------------------------------------------------------- decode of single coordinates (joint search)
def _points_v(qv, vp_rows):
    return codes.log_decode_block(qv, jnp.asarray(vp_rows[:, 0]), jnp.asarray(vp_rows[:, 1]))


def _points_log8(qm, qv, mp_rows, vp_rows):
    return codes.linear8_decode_block(qm, jnp.asarray(mp_rows[:, 0])), _points_v(qv, vp_rows)


def _points_log8_rel(qm, qv, mp_rows, vp_rows):
    w = codes.sqrt_scale_block(qv, jnp.asarray(vp_rows[:, 2]), jnp.asarray(vp_rows[:, 3]))
    return codes.rel8_decode_block(qm, jnp.asarray(mp_rows[:, 0]), w), _points_v(qv, vp_rows)


# ---------------------------------------------------------------- payload accounting
def _fixed_payload(arrays, n):
    """Codes + block metadata + escape bitmask + 8 B per escape (the paper's accounting)."""
    return int(arrays["m_codes"].nbytes + arrays["v_codes"].nbytes + arrays["m_params"].nbytes
               + arrays["v_params"].nbytes + -(-n // 8) + 8 * arrays["escape_index"].size)


def _packed_payload(arrays, n):
    return _packed.payload_bytes(arrays["widths"], arrays["escape_index"], n)


def _ans_payload(arrays, n):
    """logrel-ans: the exact sections the writer stores (rANS or packed, whichever is smaller)."""
    return _packed.entry_payload_bytes(arrays, n, entropy=True)


SECTIONS_ATTR = _container.KEPT_SECTIONS   # an Encoded's stored sections: (the arrays they came from, sections)


def _ans_payload_many(encs):
    """logrel-ans: each encoding's sections built once (every tensor's rANS buffer in one lane
    loop) and kept on it for the container writer, which then does not encode again; returns
    each one's payload in bytes."""
    secs = _packed.entry_sections_many([(e.arrays, e.n) for e in encs], entropy=True)
    for e, sec in zip(encs, secs):
        setattr(e, SECTIONS_ATTR, (dict(e.arrays), sec))
    return [int(sum(a.nbytes for a in sec.values())) for sec in secs]


def _keep(enc, sections) -> int:
    """Keep `sections` on `enc` for the container writer; returns their size in bytes."""
    setattr(enc, SECTIONS_ATTR, (dict(enc.arrays), sections))
    return int(sum(a.nbytes for a in sections.values()))


def _zstd_payload(arrays, n):
    """log8-rel-zstd: the exact sections the writer stores (`jaxguard.format.entropy`)."""
    return int(sum(a.nbytes for a in _entropy.entry_sections(arrays, n).values()))


def _zstd_payload_many(encs):
    """log8-rel-zstd: each encoding's zstd sections, built where the guard runs (the encode
    threads) and kept for the writer; returns each one's payload in bytes."""
    return [_keep(e, _entropy.entry_sections(e.arrays, e.n)) for e in encs]


def _zstd_join(pieces, enc):
    """log8-rel-zstd: a tensor certified in pieces (`guard.join_pieces`) takes its pieces'
    code frames as they are (`entropy.join_sections`); None where they cannot be joined."""
    parts = [(e.n, _container.kept_sections(e)) for _, e in pieces]
    if any(sec is None for _, sec in parts):
        return None
    sections = _entropy.join_sections(parts, enc.arrays, enc.n)
    return None if sections is None else _keep(enc, sections)


# ---------------------------------------------------------------- host-side width choice (logrel-aw)
def _decode_flat(qm, qv, mp, vp, m_dtype, v_dtype):
    """Flat codes (as `m_dtype` / `v_dtype`) -> flat (m~, v~), as the reader decodes them."""
    mtb, vtb = _adaptive.decode_blocks(qm.reshape(-1, codes.BLOCK).astype(m_dtype),
                                       qv.reshape(-1, codes.BLOCK).astype(v_dtype), mp, vp)
    return np.asarray(mtb).reshape(-1), np.asarray(vtb).reshape(-1)


def _decode_at(qm, qv, mp_rows, vp_rows, m_dtype, v_dtype):
    """Codes of single coordinates (as `m_dtype` / `v_dtype`) with their blocks' parameter
    rows -> flat (m~, v~): the reader's block decode on one-coordinate rows (every value
    depends only on its own codes and its block's parameters); padded to a power of two
    (few compiled shapes)."""
    n = qm.shape[0]
    size = 1 << max(8, (n - 1).bit_length())

    def pad(x, dtype):
        x = np.asarray(x).astype(dtype, copy=False)
        return np.concatenate([x, np.zeros((size - n,) + x.shape[1:], dtype)])

    mp_rows, vp_rows = np.asarray(mp_rows), np.asarray(vp_rows)
    mt, vt = _adaptive.decode_blocks(pad(qm, m_dtype)[:, None], pad(qv, v_dtype)[:, None],
                                     pad(mp_rows, mp_rows.dtype), pad(vp_rows, vp_rows.dtype))
    return np.asarray(mt)[:n, 0], np.asarray(vt)[:n, 0]


def _choose_logrel_aw(mh, vh, ph, valid, vpos, in_tensor, classify, certify_fn, tensors):
    """Per-block widths chosen on certified escapes; returns the assembled codes and the
    values the reader decodes them to (certified again from scratch by the caller)."""
    mq, vq, mp, vp, widths = _adaptive.choose_and_certify(mh, vh, ph, valid, vpos, in_tensor, classify, certify_fn)
    return (mq, vq, mp, vp, widths) + _decode_flat(mq, vq, mp, vp, mq.dtype, vq.dtype)


def _choose_logrel_ans(mh, vh, ph, valid, vpos, in_tensor, classify, certify_fn, tensors):
    """logrel-aw's widths (searched with certificates up to `rate.SEARCH_MAX_LEVEL`), then the
    codes moved to certified neighbours of fewer rANS-coded bits (`jaxguard.core.rate`)."""
    mq, vq, mp, vp, widths = _adaptive.choose_and_certify(mh, vh, ph, valid, vpos, in_tensor, classify, certify_fn,
                                                          max_level=_rate.SEARCH_MAX_LEVEL)
    mq, vq, mt, vt = _rate.optimize(
        mq, vq, widths, in_tensor, tensors, lambda a, b, idx: classify(a, b, idx=idx),
        lambda a, b, idx, max_level=None, reject_first=False: certify_fn(a, b, idx, max_level=max_level, at_idx=True,
                                                                         reject_first=reject_first),
        lambda qm, qv: _decode_flat(qm, qv, mp, vp, mq.dtype, vq.dtype),
        lambda qm, qv, idx: _decode_at(qm, qv, mp[idx // codes.BLOCK], vp[idx // codes.BLOCK], mq.dtype, vq.dtype))
    return mq, vq, mp, vp, widths, mt, vt


@dataclasses.dataclass(frozen=True)
class CoreCodec:
    """One codec's JAX side.

    Attributes:
      id: the registry id (`jaxguard.format.spec`).
      decode_blocks: ``(mq, vq, mp, vp)`` blocked -> ``(m~, v~)`` blocked.
      propose: ``(mb, vb, valid, vpos)`` blocks -> ``(mq, vq, mp, vp, m~, v~)``; None
        where the codes are chosen on the host (`choose`).
      propose_stages: optional ``(first, second)`` with ``propose(*a) == second(*a,
        *first(*a))``: the guard runs them as two programs, the classification as a third
        (log8-rel: in one program XLA's fusion of v's block reductions with m's made the
        proposal 1.3-1.7x slower, with the same bits).
      choose: host-side proposal for `choose`-codecs (logrel-aw), see `_choose_logrel_aw`.
      decode_points: single coordinates with their blocks' parameter rows -> (m~, v~);
        None where the joint search does not apply.
      payload_bytes: ``(arrays, n)`` -> moment payload in bytes.
      payload_many: optional ``[Encoded] -> [bytes]``, the payloads of many encodings at
        once (logrel-ans, log8-rel-zstd: builds their sections once and keeps them for the
        writer).
      join_payload: optional ``(pieces, joined Encoded) -> bytes or None``: the payload of a
        tensor encoded in pieces from its pieces' kept sections (None: built again).
      widen: optional, after certification: blocks that escape much proposed again with
        wider codes (`jaxguard.core.adaptive.widen_escaping_blocks`, log8-rel-zstd).
    """

    id: str
    decode_blocks: Callable
    propose: Optional[Callable] = None
    propose_stages: Optional[tuple] = None
    choose: Optional[Callable] = None
    decode_points: Optional[Callable] = None
    payload_bytes: Callable = _fixed_payload
    payload_many: Optional[Callable] = None
    join_payload: Optional[Callable] = None
    widen: Optional[Callable] = None

    @property
    def spec(self) -> _spec.CodecSpec:
        """The format registry's entry for this id (layout, dtypes, decode, tables)."""
        return _spec.get(self.id)


def _entries():
    log8 = CoreCodec("log8", _decode_log8, _propose_log8, decode_points=_points_log8)
    log8_rel = CoreCodec("log8-rel", _decode_log8_rel, _propose_log8_rel, decode_points=_points_log8_rel,
                         propose_stages=(_propose_log8_rel_v, _propose_log8_rel_m))
    bf16 = CoreCodec("bf16", _decode_bf16, _propose_bf16)
    block8 = CoreCodec("block8", _decode_block8, _propose_block8)
    unguarded = dataclasses.replace(block8, id="block8-unguarded")       # registry: decode="block8", certified=False
    aw = CoreCodec(_packed.CODEC, _decode_log8_rel, choose=_choose_logrel_aw, payload_bytes=_packed_payload)
    ans = dataclasses.replace(aw, id="logrel-ans", choose=_choose_logrel_ans, payload_bytes=_ans_payload,
                              payload_many=_ans_payload_many)
    # log8-rel's codes (proposed as log8-rel: `GuardSpec.decode_codec`), stored through zstd
    zstd = dataclasses.replace(log8_rel, id=_entropy.CODEC, payload_bytes=_zstd_payload,
                               payload_many=_zstd_payload_many, join_payload=_zstd_join,
                               widen=_adaptive.widen_escaping_blocks)
    return {c.id: c for c in (log8, log8_rel, bf16, block8, unguarded, aw, ans, zstd)}


TABLE: dict = _entries()


def joined_payload(pieces, enc) -> int:
    """The payload in bytes of `enc`, the join of `pieces` (``[(start, Encoded)]``).

    Args:
      pieces: the encodings of a tensor's consecutive pieces (`guard.join_pieces`).
      enc: their join.

    Returns:
      Bytes, from the pieces' kept sections where the codec can join them, else counted
      (and, for codecs with `payload_many`, kept) from `enc`'s arrays.
    """
    entry = get(enc.codec)
    if entry.join_payload is not None:
        got = entry.join_payload(pieces, enc)
        if got is not None:
            return got
    if entry.payload_many is not None:
        return entry.payload_many([enc])[0]
    return entry.payload_bytes(enc.arrays, enc.n)


def get(codec_id: str) -> CoreCodec:
    """The core codec of a registry id.

    Args:
      codec_id: an id of `jaxguard.format.spec.CODECS`.

    Returns:
      Its `CoreCodec`.

    Raises:
      ConfigError: an id the core has no entry for.
    """
    try:
        return TABLE[codec_id]
    except KeyError:
        raise ConfigError(f"codec {codec_id!r} is unknown; use one of {', '.join(TABLE)}") from None


@functools.partial(jax.jit, static_argnames=("codec",))
def propose(mb, vb, valid, vpos, codec):
    """Blocks [nb, 256] -> (m_codes, v_codes, m_params, v_params, m~, v~), all blocked.

    Args:
      mb, vb: float32 moments as blocks [nb, 256].
      valid: [nb, 256] bool, coordinates that may enter the block statistics.
      vpos: [nb, 256] bool, strictly positive finite v.
      codec: the registry id (static).

    Returns:
      Codes and block parameters as the container stores them, and m~, v~ decoded exactly
      as the reader will.

    Raises:
      ConfigError: a codec whose codes are chosen on the host (logrel-aw).
    """
    entry = get(codec)
    if entry.propose is None:
        raise ConfigError(f"codec {codec!r} chooses widths per block on the host (guard.encode); the fixed-shape "
                          "paths (encode_jit, nu-only) take log8-rel")
    return entry.propose(mb, vb, valid, vpos)
