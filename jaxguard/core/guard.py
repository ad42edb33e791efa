"""Propose codes -> decode exactly as the reader will -> certify -> escape.

`encode(m, v, p, config)` is the public entry point for one moment pair.  Codes are
proposed per 256-block (jaxguard.core.codes), decoded with the reader's exact arithmetic, and
each coordinate whose decoded moments are not bitwise equal to the originals is
certified with `jaxguard.core.bound`: first one cell over ``[0, clip]`` per sign (the cheap
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

from jaxguard.core import adaptive as _adaptive
from jaxguard.core import bound as _bound
from jaxguard.core import fastbound as _fastbound
from jaxguard.core import codes
from jaxguard.format import packed as _packed
from jaxguard.errors import ConfigError
from jaxguard.core.opmodel import OP_MODELS, f32, step_constants

CODECS = ("log8", "log8-rel", "bf16", "block8", "block8-unguarded", _packed.CODEC, "logrel-ans")
ADAPTIVE = (_packed.CODEC, "logrel-ans")   # widths chosen per block on the host; logrel-ans: logrel-aw's codes
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
            if (isinstance(val, bool) or not isinstance(val, (int, float)) or not np.isfinite(val) or val <= 0
                    or not 0 < f32(val) < np.inf):
                raise ConfigError(f"{name}={val!r} must be a number > 0 that is finite and nonzero in float32")
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


class ArrayPytree:
    """Base of the encoded forms: a dict of arrays (the pytree leaves) plus static codec
    and shape, so jit, vmap, orbax and DCP see plain leaves."""

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


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class Encoded(ArrayPytree):
    """One guarded moment pair: arrays only (plus static metadata), so jit/orbax see leaves.

    arrays: ``m_codes``, ``v_codes`` ([n]), ``m_params``, ``v_params`` ([nblocks, k]),
    ``escape_index`` (int32, sorted), ``escape_m``, ``escape_v`` (float32 exact pairs).
    """

    arrays: dict
    codec: str
    shape: tuple
    stats: dict = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------- proposals (per block, vmapped)
@functools.partial(jax.jit, static_argnames=("codec",))
def _propose(mb, vb, valid, vpos, codec):
    """Blocks [nb, 256] -> (m_codes, v_codes, m_params, v_params, m~, v~), all blocked."""
    if codec in ADAPTIVE:
        raise ConfigError(f"codec {codec!r} chooses widths per block on the host (guard.encode); the fixed-shape "
                          "paths (encode_jit, nu-only) take log8-rel")
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
    """Codes -> float32 flat (m~, v~) before escapes; identical to jaxguard.format.reader."""
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
    elif codec in ("log8-rel",) + ADAPTIVE:   # logrel-aw: log8-rel's decode, narrower codes
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
SMALL_CHUNK = 1 << 10


def certify(k, m, v, mt, vt, pabs, clip, idx, cfg, decay_in_update=None, level_counts=None):
    """Indices `idx` (host int array) -> boolean array, True where certified, for one
    constants row `k` (from `bound.pack_constants`, which carries the adamw decay flag;
    `decay_in_update` is accepted for compatibility and must agree with it)."""
    K = np.asarray(k, np.float32)[None]
    if decay_in_update is not None and bool(K[0, 10]) != bool(decay_in_update):
        raise ConfigError("decay_in_update disagrees with the constants row; build k with bound.pack_constants")
    level_of = certify_pc(K, np.zeros(np.shape(m)[0], np.int32), m, v, mt, vt, pabs, clip, idx, cfg.bound,
                          cfg.partition)
    if level_counts is not None:
        level_counts.extend(int((level_of == L).sum()) for L in range(len(_bound.LEVELS)))
    return level_of >= 0


FAST_TIER = 100          # level_of value of coordinates certified by the closed form
FAST_CHUNK = 1 << 18     # coordinates per call of the closed-form tier (one compiled shape)


def fast_accept(K, gidx, m, v, mt, vt, pabs, clip, valid=None):
    """The closed-form tier (`jaxguard.core.fastbound`) over whole flat arrays, in fixed-size
    chunks (one compiled program for any checkpoint).  Returns a host bool mask, True
    where the closed form certifies; callers AND it with their candidate mask."""
    n = np.shape(m)[0]
    out = np.zeros(n, bool)
    K = jnp.asarray(np.asarray(K, np.float32))
    arrays = [np.asarray(x, np.float32) for x in (m, v, mt, vt, pabs, clip)]
    gidx = np.asarray(gidx, np.int32)
    for s in range(0, n, FAST_CHUNK):
        e = min(n, s + FAST_CHUNK)
        if valid is not None and not valid[s:e].any():
            continue   # padding only
        part = [x[s:e] for x in arrays] + [gidx[s:e]]
        if e - s < FAST_CHUNK:   # pad with zeros (certifiable, never read back)
            part = [np.concatenate([x, np.zeros(FAST_CHUNK - (e - s), x.dtype)]) for x in part]
        mm, vv, mmt, vvt, pp, cc, gg = part
        out[s:e] = np.asarray(_fastbound.batch_fast_accept(K, gg, mm, vv, mmt, vvt, pp, cc))[:e - s]
    return out


def certify_pc(K, gidx, m, v, mt, vt, pabs, clip, idx, bound, partition, progress=False, fast=True):
    """Certify with per-coordinate constants: row ``gidx[i]`` of ``K`` [G, 12].

    With `fast` (the shared bound, mixed partition: the ablations keep their own
    certificate), the closed-form tier (`jaxguard.core.fastbound`)
    goes first.  Then the refinement levels run on compacted candidates: each level only
    sees the coordinates the previous one could not certify, after an early reject of
    those whose ideal difference at a few gradients already exceeds the threshold.

    Returns the refinement level (0..4) that certified each of `idx`, `FAST_TIER` for
    the closed form, or -1 (escape).
    """
    level_of = np.full(idx.shape[0], -1, np.int8)
    if idx.size == 0:
        return level_of
    K = np.asarray(K, np.float32)
    m, v, mt, vt, pabs, clip = (np.asarray(x, np.float32) for x in (m, v, mt, vt, pabs, clip))
    if fast and bound == "shared" and partition == "mixed":
        ok = fast_accept(K, gidx[idx], m[idx], v[idx], mt[idx], vt[idx], pabs[idx], clip[idx])
        level_of[ok] = FAST_TIER
        rest = np.flatnonzero(~ok)
        level_of[rest] = certify_pc(K, gidx, m, v, mt, vt, pabs, clip, idx[rest], bound, partition, progress,
                                    fast=False)
        return level_of
    thr = K[:, 9][gidx[idx]]

    def padded(sel, chunk):
        # gathers on the host: eager jnp indexing costs more than the bound itself.  Few
        # candidates (the closed form took the bulk) run in small chunks: two compiled
        # shapes per level, and no 64x padding of a handful of coordinates.
        if sel.shape[0] < chunk:
            chunk = min(chunk, SMALL_CHUNK)
        for s in range(0, sel.shape[0], chunk):
            part = sel[s:s + chunk]
            take = np.concatenate([part, np.full(chunk - part.size, part[0])]) if part.size < chunk else part
            yield s, part.size, take, K[gidx[take]]

    from tqdm import tqdm
    bar = tqdm(total=idx.size, desc="certify", unit="coord", unit_scale=True, leave=False,
               disable=not progress)
    lower = np.empty(idx.size, np.float32)
    for s, cnt, take, kc in padded(idx, CHUNK[0]):
        lower[s:s + cnt] = np.asarray(_bound.batch_lower_pc(kc, m[take], v[take], mt[take], vt[take], clip[take]))[:cnt]
    pending = np.flatnonzero(~(lower > thr))
    bar.update(idx.size - pending.size)
    for level in range(len(_bound.LEVELS)):
        if pending.size == 0:
            break
        bar.set_postfix(level=level)
        edges = jnp.asarray(_bound.unit_edges(level, partition))
        sel = idx[pending]
        out = np.empty(sel.shape[0], np.float32)
        for s, cnt, take, kc in padded(sel, CHUNK[level]):
            b = _bound.batch_bound_pc(kc, m[take], v[take], mt[take], vt[take], pabs[take], clip[take], edges,
                                      bound=bound)
            out[s:s + cnt] = np.asarray(b)[:cnt]
            if level == len(_bound.LEVELS) - 1:
                bar.update(cnt)
        ok = (out >= 0) & (out <= thr[pending])   # NaN and -inf never certify
        level_of[pending[ok]] = level
        if level < len(_bound.LEVELS) - 1:
            bar.update(int(ok.sum()))
        pending = pending[~ok]
    bar.close()
    return level_of


def _check_inputs(m, v, p):
    shape = tuple(np.shape(m))
    for name, x in (("m", m), ("v", v), ("p", p)):
        if np.dtype(getattr(x, "dtype", np.asarray(x).dtype)) != np.float32:
            raise ConfigError(f"{name} has dtype {np.dtype(getattr(x, 'dtype', np.asarray(x).dtype))}; jaxguard "
                              "certifies float32 moments and parameters, cast with .astype(float32)")
        if tuple(np.shape(x)) != shape:
            raise ConfigError(f"{name} has shape {tuple(np.shape(x))} but m has {shape}; pass the moments of one parameter")
    return shape


def encode(m, v, p, config: GuardConfig) -> Encoded:
    """Guarded encoding of one Adam moment pair (see the module's numerical contract)."""
    return encode_many([(m, v, p, config)])[0]


def encode_many(items, *, progress: bool = False) -> list:
    """Guarded encoding of many moment pairs [(m, v, p, config), ...] in one pass.

    All tensors sharing a codec, bound and partition are laid side by side (each padded
    to whole blocks) and certified together with per-coordinate constants, so a
    checkpoint of many small tensors costs a few large jitted calls, not many small ones.
    """
    items = list(items)
    shapes = [_check_inputs(m, v, p) for m, v, p, _ in items]
    if any(int(np.prod(s, dtype=np.int64)) > MAX_PIECE for s in shapes):
        return _encode_in_pieces(items, shapes, progress)
    groups: dict = {}
    for i, (_, _, _, cfg) in enumerate(items):
        groups.setdefault((cfg.codec, cfg.bound, cfg.partition), []).append(i)
    out = [None] * len(items)
    for (codec, bound, partition), idxs in groups.items():
        encs = _encode_group([items[i] for i in idxs], [shapes[i] for i in idxs], codec, bound, partition, progress)
        for i, e in zip(idxs, encs):
            out[i] = e
    return out


# Tensors above this many elements are encoded in pieces (a multiple of the block size,
# so blocks never straddle pieces) and reassembled with 64-bit escape indices: the
# chunked path for tensors of 2**31 elements or more.
MAX_PIECE = 1 << 28


def _encode_in_pieces(items, shapes, progress):
    flat, owner = [], []
    for i, ((m, v, p, cfg), shape) in enumerate(zip(items, shapes)):
        n = int(np.prod(shape, dtype=np.int64))
        mf, vf, pf = (np.asarray(x, np.float32).reshape(-1) for x in (m, v, p))
        step = max(codes.BLOCK, MAX_PIECE - MAX_PIECE % codes.BLOCK)
        for s in range(0, max(n, 1), step):
            flat.append((mf[s:s + step], vf[s:s + step], pf[s:s + step], cfg))
            owner.append((i, s))
    out: list = [[] for _ in items]
    for (i, start), piece in zip(owner, flat):
        # one piece at a time: the point is never to hold 2**31 coordinates of work at once
        out[i].append((start, encode_many([piece], progress=progress)[0]))
    return [_join_pieces(pieces, shape) for pieces, shape in zip(out, shapes)]


def _join_pieces(pieces, shape):
    if len(pieces) == 1:
        start, enc = pieces[0]
        return Encoded(enc.arrays, enc.codec, tuple(shape), enc.stats)
    a = {k: np.concatenate([e.arrays[k] for _, e in pieces]) for k in
         ("m_codes", "v_codes", "m_params", "v_params", "escape_m", "escape_v", "widths") if k in pieces[0][1].arrays}
    a["escape_index"] = np.concatenate([e.arrays["escape_index"].astype(np.int64) + s for s, e in pieces])
    enc = Encoded(a, pieces[0][1].codec, tuple(shape))
    stats = {}
    for _, e in pieces:
        for k, val in e.stats.items():
            if isinstance(val, list):
                stats[k] = [x + y for x, y in zip(stats.get(k, [0] * len(val)), val)]
            else:
                stats[k] = stats.get(k, 0) + val
    stats["payload_bytes"] = payload_bytes(enc)
    enc.stats = stats
    return enc


def _group_constants(items, gidx, ph):
    """(K rows, |p|, per-coordinate clip) of a group laid side by side (`gidx`: item per coordinate)."""
    consts = [cfg.constants() for *_, cfg in items]
    K = np.stack([_bound.pack_constants(c, cfg.tau) for c, (*_, cfg) in zip(consts, items)])
    K = np.concatenate([K, np.repeat(K[:1], _bucket(max(16, len(K))) - len(K), 0)])  # few compiled shapes
    pabs = np.abs(ph)
    clip = np.array([cfg.clip for *_, cfg in items], np.float32)[gidx]
    wd_coupled = np.array([c.weight_decay if c.coupled_decay else 0.0 for c in consts], np.float32)[gidx]
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite p escapes anyway
        clip = np.where(wd_coupled > 0, (clip + wd_coupled * pabs) * np.float32(1 + 2.0**-20), clip)
    return K, pabs, clip.astype(np.float32)


def _encode_group(items, shapes, codec, bound, partition, progress=False):
    t0 = time.perf_counter()
    ns = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    nbs = [codes.num_blocks(n) for n in ns]
    offs = np.concatenate([[0], np.cumsum(nbs)]).astype(np.int64)
    nblk = _bucket(int(offs[-1])) if offs[-1] <= PROPOSE_CHUNK else -(-int(offs[-1]) // PROPOSE_CHUNK) * PROPOSE_CHUNK
    npad = nblk * codes.BLOCK
    mh, vh, ph = (np.zeros(npad, np.float32) for _ in range(3))
    in_tensor = np.zeros(npad, bool)
    gidx = np.zeros(npad, np.int32)
    for i, ((m, v, p, _), n) in enumerate(zip(items, ns)):
        b = int(offs[i]) * codes.BLOCK
        mh[b:b + n] = np.asarray(m, np.float32).reshape(-1)
        vh[b:b + n] = np.asarray(v, np.float32).reshape(-1)
        ph[b:b + n] = np.asarray(p, np.float32).reshape(-1)
        in_tensor[b:b + n] = True
        gidx[b:b + int(nbs[i]) * codes.BLOCK] = i
    valid = (in_tensor & _stats_valid(mh, vh, ph)).reshape(-1, codes.BLOCK)
    vpos = (_finite(vh) & ~_zero(vh) & ~_negative(vh)).reshape(-1, codes.BLOCK)
    mf, vf = mh, vh
    widths = None
    if codec in ADAPTIVE:
        # per-block widths chosen on certified escapes; the assembled codes are decoded
        # again below exactly as the reader decodes them and certified from scratch
        K, pabs, clip = _group_constants(items, gidx, ph)
        mq, vq, mp, vp, widths = _adaptive.choose_and_certify(
            mh, vh, ph, valid, vpos, in_tensor, lambda a, b: _classify(mh, vh, ph, a, b),
            lambda a, b, idx: certify_pc(K, gidx, mf, vf, a, b, pabs, clip, idx, bound, partition), )
        mtb, vtb = _adaptive.decode_blocks(mq.reshape(-1, codes.BLOCK), vq.reshape(-1, codes.BLOCK), mp, vp)
        mt, vt = np.asarray(mtb).reshape(-1), np.asarray(vtb).reshape(-1)
    else:
        mq, vq, mp, vp, mt, vt = _propose_chunked(mh.reshape(-1, codes.BLOCK), vh.reshape(-1, codes.BLOCK), valid,
                                                  vpos, codec)
    exact, ok = _classify(mh, vh, ph, mt, vt)
    level_of = np.full(npad, -1, np.int8)
    if codec == "block8-unguarded":
        escape = in_tensor & ~exact & ~ok
    else:
        K, pabs, clip = _group_constants(items, gidx, ph)
        cand_mask = in_tensor & ~exact & ok
        if bound == "shared" and partition == "mixed":   # closed-form tier (the ablations keep their own)
            fast = cand_mask & fast_accept(K, gidx, mh, vh, mt, vt, pabs, clip, valid=cand_mask)
            level_of[fast] = FAST_TIER
            cand_mask &= ~fast
        cand = np.flatnonzero(cand_mask)
        level_of[cand] = certify_pc(K, gidx, mf, vf, mt, vt, pabs, clip, cand, bound, partition, progress,
                                    fast=False)
        escape = in_tensor & ~exact & (level_of < 0)
    mq, vq = mq.reshape(-1), vq.reshape(-1)
    rescued = np.zeros(npad, bool)
    if codec != "block8-unguarded" and any(cfg.joint for *_, cfg in items):
        joint_on = np.zeros(npad, bool)
        for i, (*_, cfg) in enumerate(items):
            if cfg.joint:
                joint_on[int(offs[i]) * codes.BLOCK:int(offs[i] + nbs[i]) * codes.BLOCK] = True
        rescued = _joint_search(codec, np.flatnonzero(escape & ok & joint_on), mq, vq, mp, vp, mh, vh, pabs, clip,
                                K, gidx, bound, partition)
        escape &= ~rescued
    elapsed = time.perf_counter() - t0
    total = max(sum(ns), 1)
    encs = []
    for i, (n, shape) in enumerate(zip(ns, shapes)):
        b, nb = int(offs[i]) * codes.BLOCK, int(nbs[i])
        esc = np.flatnonzero(escape[b:b + n]).astype(np.int32)
        arrays = {"m_codes": mq[b:b + n].copy(), "v_codes": vq[b:b + n].copy(),
                  "m_params": mp[int(offs[i]):int(offs[i]) + nb].astype(np.float32),
                  "v_params": vp[int(offs[i]):int(offs[i]) + nb].astype(np.float32),
                  "escape_index": esc, "escape_m": mh[b + esc], "escape_v": vh[b + esc]}
        if widths is not None:
            arrays["widths"] = widths[int(offs[i]):int(offs[i]) + nb].copy()
        enc = Encoded(arrays, codec, tuple(shape))
        lv = level_of[b:b + n]
        ex, okk = exact[b:b + n], ok[b:b + n]
        enc.stats = {
            "coordinates": n, "escapes": int(esc.size), "exact": int(ex.sum()),
            "uncertifiable": int((~ex & ~okk).sum()),
            "certified_by_level": [int((lv == L).sum()) for L in range(len(_bound.LEVELS))],
            "certified_fast": int((lv == FAST_TIER).sum()),
            "joint_rescued": int(rescued[b:b + n].sum()),
            "payload_bytes": payload_bytes(enc), "raw_fp32_bytes": 8 * n,
            "encode_seconds": elapsed * n / total,
        }
        encs.append(enc)
    return encs


JOINT_MOVES = tuple((dm, dv) for dm in (-1, 0, 1) for dv in (-1, 0, 1) if (dm, dv) != (0, 0))


def _joint_search(codec, idx, mq, vq, mp, vp, mh, vh, pabs, clip, K, gidx, bound, partition):
    """Joint code choice: for coordinates that escaped, try the 8 neighbouring (m, v) code
    pairs (block parameters fixed, so only that coordinate changes) and keep the first
    pair that certifies.  Updates mq/vq in place; returns the rescued mask."""
    rescued = np.zeros(mh.shape[0], bool)
    if idx.size == 0:
        return rescued
    if codec not in ("log8", "log8-rel"):
        raise ConfigError(f"joint=True applies to the log8 and log8-rel codecs, not {codec!r}")
    blk = idx // codes.BLOCK
    todo = idx
    for dm, dv in JOINT_MOVES:
        if todo.size == 0:
            break
        b = todo // codes.BLOCK
        qm = np.clip(mq[todo].astype(np.int32) + dm, -127, 127)
        qv0 = vq[todo].astype(np.int32)
        qv = np.where(qv0 == 0, 0, np.clip(qv0 + dv, 1, 255))    # v == 0 keeps code 0
        mt, vt = _decode_points(codec, qm, qv, mp[b], vp[b])
        lv = certify_pc(K, gidx, mh[todo], vh[todo], mt, vt, pabs[todo], clip[todo],
                        np.arange(todo.size), bound, partition)
        ok = lv >= 0
        hit = todo[ok]
        mq[hit] = qm[ok].astype(mq.dtype)
        vq[hit] = qv[ok].astype(vq.dtype)
        rescued[hit] = True
        todo = todo[~ok]
    del blk
    return rescued


def _decode_points(codec, qm, qv, mp_rows, vp_rows):
    """Decode individual (m, v) codes with their blocks' parameters (as the reader does)."""
    qv_j = jnp.asarray(qv, jnp.int32)
    vt = codes.log_decode_block(qv_j, jnp.asarray(vp_rows[:, 0]), jnp.asarray(vp_rows[:, 1]))
    if codec == "log8":
        mt = codes.linear8_decode_block(jnp.asarray(qm, jnp.int32), jnp.asarray(mp_rows[:, 0]))
    else:
        w = codes.sqrt_scale_block(qv_j, jnp.asarray(vp_rows[:, 2]), jnp.asarray(vp_rows[:, 3]))
        mt = codes.rel8_decode_block(jnp.asarray(qm, jnp.int32), jnp.asarray(mp_rows[:, 0]), w)
    return np.asarray(mt, np.float32), np.asarray(vt, np.float32)


PROPOSE_CHUNK = 4096     # blocks per `_propose` call once a group exceeds it (one compiled shape)


def _propose_chunked(mb, vb, valid, vpos, codec):
    """`_propose` over host blocks in pieces of `PROPOSE_CHUNK` blocks -> host arrays
    (codes, params, flat m~, v~); a group of <= PROPOSE_CHUNK blocks is one call."""
    nb = mb.shape[0]
    step = min(nb, PROPOSE_CHUNK)
    outs = [_propose(mb[s:s + step], vb[s:s + step], valid[s:s + step], vpos[s:s + step], codec)
            for s in range(0, nb, step)]
    mq, vq, mp, vp, mt, vt = (np.concatenate([np.asarray(o[i]) for o in outs]) if len(outs) > 1
                              else np.array(outs[0][i]) for i in range(6))
    return mq, vq, mp, vp, mt.reshape(-1), vt.reshape(-1)


def _bucket(nb: int) -> int:
    return 1 << max(0, (nb - 1).bit_length())


def _pad(x, size):
    return jnp.concatenate([x, jnp.zeros((size - x.shape[0],), x.dtype)]) if size > x.shape[0] else x


def payload_bytes(enc: Encoded) -> int:
    """Moment payload as in the paper: codes + block metadata + escape bitmask + 8 B/escape."""
    a = enc.arrays
    if enc.codec in ADAPTIVE:
        return _packed.entry_payload_bytes(a, enc.n, entropy=enc.codec == "logrel-ans")
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
