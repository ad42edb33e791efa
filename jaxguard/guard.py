"""Propose codes -> decode exactly as the reader will -> certify -> escape.

`encode(m, v, p, config)` is the public entry point for one moment pair.  Codes are
proposed per 256-block (jaxguard.codes), decoded with the reader's exact arithmetic, and
each coordinate whose decoded moments are not bitwise equal to the originals is
certified with `jaxguard.bound`: first one cell over ``[0, clip]`` per sign (the cheap
early accept), then the mixed linear-logarithmic partition, re-checked with 64, 256 and
1024 linear cells.  Whatever is not certified escapes: its FP32 pair is stored exactly.

Numerical contract
------------------
For every coordinate, ``decode(encode(m, v, p, cfg))`` returns either the exact input
pair (bitwise; always so for NaN, +-Inf, negative ``v``, non-finite ``p`` and nonzero
moments below ``2**-80``) or a pair whose first native update (op model
``cfg.op_model``, bias corrections at ``cfg.step + 1``) differs from the original's by
at most ``cfg.tau * cfg.lr`` for every gradient ``|g| <= cfg.clip``.  The codec
``block8-unguarded`` skips certification and carries no such guarantee.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import bound as _bound
from . import codes
from .errors import ConfigError
from .opmodel import OP_MODELS, step_constants

CODECS = ("log8", "log8-rel", "bf16", "block8", "block8-unguarded")
# log8-rel codes m relative to sqrt(v~): same bytes as log8 (+8 B per block) and, on
# trained transformers, ~100x fewer escapes at early checkpoints (see README).
DEFAULT_CODEC = "log8-rel"
BOUNDS = ("shared", "separate")
PARTITIONS = ("mixed", "linear")


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """What to certify: the next update's hyperparameters and the contract (tau, clip).

    Frozen and hashable (a jit static argument); `to_json` / `from_json` round-trip it.
    """

    lr: float
    step: int
    tau: float = 0.01
    clip: float = 0.2
    betas: tuple = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    op_model: str = "torch-adam"
    codec: str = DEFAULT_CODEC
    bound: str = "shared"
    partition: str = "mixed"
    joint: bool = False

    def __post_init__(self):
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if self.codec not in CODECS:
            raise ConfigError(f"codec={self.codec!r} is unknown; use one of {', '.join(CODECS)}")
        if self.bound not in BOUNDS:
            raise ConfigError(f"bound={self.bound!r} is unknown; use 'shared' or 'separate'")
        if self.partition not in PARTITIONS:
            raise ConfigError(f"partition={self.partition!r} is unknown; use 'mixed' or 'linear'")
        if self.op_model not in OP_MODELS:
            raise ConfigError(f"op_model={self.op_model!r} is unknown; use one of {', '.join(OP_MODELS)}")
        for name in ("tau", "clip"):
            val = getattr(self, name)
            if not isinstance(val, (int, float)) or not np.isfinite(val) or val <= 0:
                raise ConfigError(f"{name}={val!r} must be a finite number > 0")
        step_constants(self.op_model, lr=self.lr, step=self.step, betas=self.betas,
                       eps=self.eps, weight_decay=self.weight_decay)  # validates

    def constants(self):
        return step_constants(self.op_model, lr=self.lr, step=self.step, betas=self.betas,
                              eps=self.eps, weight_decay=self.weight_decay)

    def to_json(self) -> dict:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_json(cls, d: dict) -> "GuardConfig":
        return cls(**{**d, "betas": tuple(d["betas"])})


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class Encoded:
    """One guarded moment pair: arrays only (plus static metadata), so jit/orbax see leaves.

    arrays: ``m_codes``, ``v_codes`` ([n]), ``m_params``, ``v_params`` ([nblocks, k]),
    ``escape_index`` (int32, sorted), ``escape_m``, ``escape_v`` (float32 exact pairs).
    """

    arrays: dict
    codec: str
    shape: tuple
    stats: dict = dataclasses.field(default_factory=dict)

    def tree_flatten(self):
        keys = tuple(sorted(self.arrays))
        return tuple(self.arrays[k] for k in keys), (keys, self.codec, self.shape)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        keys, codec, shape = aux
        return cls(dict(zip(keys, leaves)), codec, shape)

    @property
    def n(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


# ---------------------------------------------------------------- proposals (per block, vmapped)
def _code_names(codec):
    return {"log8": ("linear8", "log8"), "log8-rel": ("rel8", "log8"), "bf16": ("bf16", "bf16"),
            "block8": ("dynamic8s", "dynamic8u"), "block8-unguarded": ("dynamic8s", "dynamic8u")}[codec]


@functools.partial(jax.jit, static_argnames=("codec",))
def _propose(mb, vb, valid, vpos, codec):
    """Blocks [nb, 256] -> (m_codes, v_codes, m_params, v_params, m~, v~), all blocked."""
    if codec == "log8":
        mq, ms = jax.vmap(codes.linear8_encode_block)(mb, valid)
        vq, lo, r = jax.vmap(functools.partial(codes.log_encode_block, bits=8))(vb, valid, positive=vpos)
        mt = jax.vmap(codes.linear8_decode_block)(mq, ms)
        vt = jax.vmap(functools.partial(codes.log_decode_block, bits=8))(vq, lo, r)
        return mq, vq, ms[:, None], jnp.stack([lo, r], axis=1), mt, vt
    if codec == "log8-rel":
        vq, lo, r = jax.vmap(functools.partial(codes.log_encode_block, bits=8))(vb, valid, positive=vpos)
        wlo, rr = jnp.sqrt(lo), jnp.sqrt(r)
        w = jax.vmap(codes.sqrt_scale_block)(vq, wlo, rr)
        mq, ms = jax.vmap(codes.rel8_encode_block)(mb, valid, w, wlo)
        mt = jax.vmap(codes.rel8_decode_block)(mq, ms, w)
        vt = jax.vmap(functools.partial(codes.log_decode_block, bits=8))(vq, lo, r)
        return mq, vq, ms[:, None], jnp.stack([lo, r, wlo, rr], axis=1), mt, vt
    if codec == "bf16":
        mq, vq = codes.bf16_encode(mb), codes.bf16_encode(vb)
        empty = jnp.zeros((mb.shape[0], 0), jnp.float32)
        return (jax.lax.bitcast_convert_type(mq, jnp.uint16), jax.lax.bitcast_convert_type(vq, jnp.uint16),
                empty, empty, codes.bf16_decode(mq), codes.bf16_decode(vq))
    ts, tu = codes.dynamic_map(True), codes.dynamic_map(False)
    mq, ma = jax.vmap(lambda x, ok: codes.dynamic8_encode_block(x, ok, ts, True))(mb, valid)
    vq, va = jax.vmap(lambda x, ok: codes.dynamic8_encode_block(x, ok, tu, False))(vb, valid)
    mt = jax.vmap(lambda q, s: codes.dynamic8_decode_block(q, s, ts))(mq, ma)
    vt = jax.vmap(lambda q, s: codes.dynamic8_decode_block(q, s, tu))(vq, va)
    return mq, vq, ma[:, None], va[:, None], mt, vt


def decode_arrays(arrays: dict, codec: str, n: int):
    """Codes -> float32 flat (m~, v~) before escapes; identical to jaxguard.reader."""
    mq, vq = jnp.asarray(arrays["m_codes"]), jnp.asarray(arrays["v_codes"])
    nb = codes.num_blocks(n)
    pad = nb * codes.BLOCK - n

    def blocks(q):
        q = jnp.ravel(q)
        if pad:
            q = jnp.concatenate([q, jnp.zeros((pad,), q.dtype)])
        return q.reshape(nb, codes.BLOCK)

    mp, vp = jnp.asarray(arrays["m_params"]), jnp.asarray(arrays["v_params"])
    if codec == "log8":
        mt = jax.vmap(codes.linear8_decode_block)(blocks(mq), mp[:, 0])
        vt = jax.vmap(functools.partial(codes.log_decode_block, bits=8))(blocks(vq), vp[:, 0], vp[:, 1])
    elif codec == "log8-rel":
        vqb = blocks(vq)
        w = jax.vmap(codes.sqrt_scale_block)(vqb, vp[:, 2], vp[:, 3])
        mt = jax.vmap(codes.rel8_decode_block)(blocks(mq), mp[:, 0], w)
        vt = jax.vmap(functools.partial(codes.log_decode_block, bits=8))(vqb, vp[:, 0], vp[:, 1])
    elif codec == "bf16":
        mt = codes.bf16_decode(jax.lax.bitcast_convert_type(blocks(mq), jnp.bfloat16))
        vt = codes.bf16_decode(jax.lax.bitcast_convert_type(blocks(vq), jnp.bfloat16))
    else:
        ts, tu = codes.dynamic_map(True), codes.dynamic_map(False)
        mt = jax.vmap(lambda q, s: codes.dynamic8_decode_block(q, s, ts))(blocks(mq), mp[:, 0])
        vt = jax.vmap(lambda q, s: codes.dynamic8_decode_block(q, s, tu))(blocks(vq), vp[:, 0])
    return mt.reshape(-1)[:n], vt.reshape(-1)[:n]


# ---------------------------------------------------------------- classification (host, on bits)
# Done in numpy on the raw bits: XLA on CPU flushes subnormals and may turn bit tests
# into float compares, which would call a subnormal zero.
def _bits(x):
    return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def _finite(x):
    return (_bits(x) & 0x7F800000) != 0x7F800000


def _zero(x):
    return (_bits(x) & 0x7FFFFFFF) == 0


def _negative(x):
    b = _bits(x)
    return ((b >> 31) == 1) & ((b & 0x7FFFFFFF) != 0)


def _not_tiny(x):
    return _zero(x) | (np.abs(np.asarray(x, np.float32)) >= _bound.TINY_MOMENT)


def _classify(m, v, p, mt, vt):
    """(exact, certifiable) masks on flat arrays."""
    fin = _finite(m) & _finite(v) & _finite(p) & _finite(mt) & _finite(vt)
    nonneg = ~_negative(v) & ~_negative(vt)
    ok = fin & nonneg & _not_tiny(m) & _not_tiny(v) & _not_tiny(mt) & _not_tiny(vt)
    exact = (_bits(m) == _bits(mt)) & (_bits(v) == _bits(vt))
    return exact, ok


def _stats_valid(m, v, p):
    return _finite(m) & _finite(v) & _finite(p) & ~_negative(v) & _not_tiny(v)


# ---------------------------------------------------------------- certification
CHUNK = {0: 1 << 16, 1: 1 << 13, 2: 1 << 12, 3: 1 << 11, 4: 1 << 10}


def certify(k, m, v, mt, vt, pabs, clip, idx, cfg, decay_in_update, level_counts=None):
    """Indices `idx` (host int array) -> boolean array, True where certified.

    Runs the refinement levels on compacted candidates: each level only sees the
    coordinates the previous one could not certify.
    """
    certified = np.zeros(idx.shape[0], bool)
    thr = float(np.asarray(k)[9])
    if idx.size:
        # the ideal difference at a few gradients is a lower bound of the supremum:
        # coordinates above the threshold there can never be certified.
        parts = []
        for s in range(0, idx.size, CHUNK[0]):
            part = idx[s:s + CHUNK[0]]
            take = np.concatenate([part, np.full(CHUNK[0] - part.size, part[0])])
            lo = _bound.batch_lower(k, m[take], v[take], mt[take], vt[take], clip[take])
            parts.append(np.asarray(lo)[:part.size])
        lower = np.concatenate(parts)
        pending = np.flatnonzero(~(lower > thr))
    else:
        pending = np.arange(0)
    for level in range(len(_bound.LEVELS)):
        if pending.size == 0:
            break
        edges = jnp.asarray(_bound.unit_edges(level, cfg.partition))
        chunk = CHUNK[level]
        sel = idx[pending]
        out = np.empty(sel.shape[0], np.float32)
        for s in range(0, sel.shape[0], chunk):
            part = sel[s:s + chunk]
            pad = chunk - part.shape[0]
            take = np.concatenate([part, np.full(pad, part[0])]) if pad else part
            b = _bound.batch_bound(k, m[take], v[take], mt[take], vt[take], pabs[take], clip[take], edges,
                                   bound=cfg.bound, decay_in_update=decay_in_update)
            out[s:s + part.shape[0]] = np.asarray(b)[:part.shape[0]]
        ok = out <= thr
        if level_counts is not None:
            level_counts.append(int(ok.sum()))
        certified[pending[ok]] = True
        pending = pending[~ok]
    return certified


def encode(m, v, p, config: GuardConfig) -> Encoded:
    """Guarded encoding of one Adam moment pair (see the module's numerical contract)."""
    t0 = time.perf_counter()
    shape = tuple(np.shape(m))
    for name, x in (("m", m), ("v", v), ("p", p)):
        if np.dtype(getattr(x, "dtype", np.asarray(x).dtype)) != np.float32:
            raise ConfigError(f"{name} has dtype {x.dtype}; jaxguard certifies float32 moments and parameters, cast with .astype(float32)")
        if tuple(np.shape(x)) != shape:
            raise ConfigError(f"{name} has shape {tuple(np.shape(x))} but m has {shape}; pass the moments of one parameter")
    m, v, p = jnp.asarray(m), jnp.asarray(v), jnp.asarray(p)
    n = int(np.prod(shape, dtype=np.int64))
    nb = codes.num_blocks(n)
    # pad to a power-of-two number of blocks so that jit compiles once per size class
    npad = _bucket(nb) * codes.BLOCK
    mf, vf, pf = (_pad(x.reshape(-1), npad) for x in (m, v, p))
    in_tensor = np.arange(npad) < n
    mh, vh, ph = np.asarray(mf), np.asarray(vf), np.asarray(pf)
    valid = (in_tensor & _stats_valid(mh, vh, ph)).reshape(-1, codes.BLOCK)
    vpos = (_finite(vh) & ~_zero(vh) & ~_negative(vh)).reshape(-1, codes.BLOCK)
    mq, vq, mp, vp, mtb, vtb = _propose(mf.reshape(-1, codes.BLOCK), vf.reshape(-1, codes.BLOCK), valid, vpos,
                                        config.codec)
    mt = mtb.reshape(-1)
    vt = vtb.reshape(-1)
    exact, ok = (x[:n] for x in _classify(mh, vh, ph, np.asarray(mt), np.asarray(vt)))
    mq, vq, mp, vp = mq.reshape(-1)[:n], vq.reshape(-1)[:n], mp[:nb], vp[:nb]
    level_counts: list[int] = []
    if config.codec == "block8-unguarded":
        escape = ~exact & ~ok
    else:
        c = config.constants()
        k = jnp.asarray(_bound.pack_constants(c, config.tau))
        pabs = jnp.abs(pf)
        clip = jnp.full((npad,), np.float32(config.clip), jnp.float32)
        if c.coupled_decay:
            clip = (clip + np.float32(c.weight_decay) * pabs) * np.float32(1 + 2.0**-20)
        cand = np.flatnonzero(~exact & ok)
        cert = certify(k, mf, vf, mt, vt, pabs, clip, cand, config, c.decay_in_update, level_counts)
        escape = ~exact
        escape[cand[cert]] = False
    esc_idx = np.flatnonzero(escape).astype(np.int32)
    mf_np, vf_np = mh[:n], vh[:n]
    arrays = {
        "m_codes": np.asarray(mq).reshape(-1)[:n], "v_codes": np.asarray(vq).reshape(-1)[:n],
        "m_params": np.asarray(mp, np.float32), "v_params": np.asarray(vp, np.float32),
        "escape_index": esc_idx, "escape_m": mf_np[esc_idx], "escape_v": vf_np[esc_idx],
    }
    enc = Encoded(arrays, config.codec, shape)
    enc.stats = {
        "coordinates": n, "escapes": int(esc_idx.size), "exact": int(exact.sum()),
        "uncertifiable": int((~exact & ~ok).sum()),
        "certified_by_level": level_counts,
        "payload_bytes": payload_bytes(enc), "raw_fp32_bytes": 8 * n,
        "encode_seconds": time.perf_counter() - t0,
    }
    return enc


def _bucket(nb: int) -> int:
    return 1 << max(0, (nb - 1).bit_length())


def _pad(x, size):
    return jnp.concatenate([x, jnp.zeros((size - x.shape[0],), x.dtype)]) if size > x.shape[0] else x


def payload_bytes(enc: Encoded) -> int:
    """Moment payload as in the paper: codes + block metadata + escape bitmask + 8 B/escape."""
    a = enc.arrays
    return int(a["m_codes"].nbytes + a["v_codes"].nbytes + a["m_params"].nbytes + a["v_params"].nbytes
               + -(-enc.n // 8) + 8 * a["escape_index"].size)


def decode(enc: Encoded):
    """Encoded -> (m~, v~) float32 arrays of the original shape, escapes restored exactly."""
    mt, vt = decode_arrays(enc.arrays, enc.codec, enc.n)
    idx = jnp.asarray(enc.arrays["escape_index"])
    if idx.size:
        mt = mt.at[idx].set(jnp.asarray(enc.arrays["escape_m"]))
        vt = vt.at[idx].set(jnp.asarray(enc.arrays["escape_v"]))
    return mt.reshape(enc.shape), vt.reshape(enc.shape)
