"""A jittable guard with fixed shapes, for a training loop's jitted save hook.

`guard.encode` compacts candidates on the host; `encode_jit(m, v, p, config, capacity=K)`
does the same work with static shapes so that it can run inside ``jax.jit`` (config,
capacity and escape_capacity are static; a second call with arrays of the same shapes
does not retrace).  It proposes codes with `codecs.propose` (so the codes and decoded
values are those of `guard.encode`), then certifies with `bound.batch_bound` over the
fixed level chain (`bound.LEVELS`): level 0 gathers at most ``capacity`` candidates with
``jnp.nonzero(size=...)``; later levels only see what level 0 gathered and could not
certify.  Candidates beyond ``capacity`` escape (escaping is always safe).

`to_encoded(je, m, v)` turns the fixed-size result into a normal `guard.Encoded` for the
container on the host (`jaxguard.format.container.build`).

Numerical contract
------------------
As `jaxguard.core.guard.encode`: every coordinate of ``decode_jit(je)`` (or of
``guard.decode(to_encoded(je))``) is either the input pair bit for bit or certified to
move the first native update by at most ``tau * lr`` for every ``|g| <= clip``.  Inside a
big XLA graph on CPU, subnormals may be flushed and bit tests rewritten into float
compares, so classification here is on integer bit patterns XOR-ed with an opaque zero
(`lax.optimization_barrier`), and every coordinate with a nonzero moment of magnitude
below ``2**-80`` (subnormals included) escapes exactly; the decoded values the bound
sees pass the same barrier so that XLA cannot fuse their rounding into the bound.
``to_encoded(je, m, v)`` re-checks the tiny/subnormal classification in numpy and adds
any escape the device missed.
"""
from __future__ import annotations

__all__ = ["JitEncoded", "encode_traced", "level_sizes", "sample_positions", "encode_jitted", "constants",
           "encode_jit", "decode_jit", "to_encoded"]

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard.core import bound as _bound
from jaxguard.core import certify as _certify
from jaxguard.core import codecs, codes
from jaxguard.core import guard as _guard
from jaxguard.core import fastbound as _fastbound
from jaxguard.core import floatbits as fb
from jaxguard.core.config import GuardConfig, GuardSpec
from jaxguard.core.encoded import ArrayPytree
from jaxguard.errors import ConfigError

# rows of each fixed level's `lax.map` step inside the jitted encode, fewer as a level's
# cells grow (8 at level 0, 1,335 at level 4); the host path's own call sizes are
# `certify.stages`'
LEVEL_CHUNK = {0: 1 << 16, 1: 1 << 13, 2: 1 << 12, 3: 1 << 11, 4: 1 << 10}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass
class JitEncoded(ArrayPytree):
    """Fixed-shape guarded encoding: ``m_codes``, ``v_codes`` ([n]), ``m_params``,
    ``v_params`` ([nblocks, k]), ``escape_index`` ([E] int32, sorted, filled with n),
    ``escape_m``, ``escape_v`` ([E] float32, 0 past the count), ``escape_count`` (int32),
    ``overflow`` (int32: escapes that did not fit in E; nonzero makes `to_encoded` raise)."""

    arrays: dict
    codec: str
    shape: tuple


def encode_traced(m, v, p, k, spec: GuardSpec, capacity, escape_capacity, sample=None, counts=False, fast=False):
    """The body of `encode_jit`, traceable inside a caller's ``jit`` or ``shard_map``.

    Args:
      m, v, p: float32 arrays of one shape (traced).
      k: the certificate's constants, a `bound.StepRow` of float32 scalars (traced).
      spec: the static `GuardSpec`.
      capacity: candidates the cell levels examine (static): an int (level 0 gathers at
        most this many and the later levels see only those), or one int per level of
        `bound.LEVELS` (each level gathers at most its own; see `level_sizes`).
      escape_capacity: length of the escape buffers (static).
      sample: flat positions whose certified values the result also carries as
        ``sample_m``/``sample_v`` (escapes exact): what this program certified, for the
        container writer's check against the reader.  A numpy int array (static), or an
        int32 jax array (traced; its length is then part of the compiled shape).
      counts: also return ``pending_counts`` (int32 per level: candidates pending when
        the level gathered; more than `level_sizes` gave it means some escaped for lack
        of capacity), ``block_exact`` and ``block_uncertifiable`` (int32 per 256-block).
      fast: first certify with the closed-form tier (`fastbound.fast_bound`, as
        `guard.encode` does for the shared bound and mixed partition), so the cell levels
        see only what it left; elementwise, so it needs no capacity.

    Returns:
      A `JitEncoded`.
    """
    shape = tuple(m.shape)
    n = int(np.prod(shape, dtype=np.int64))
    nb = codes.num_blocks(n)
    npad = nb * codes.BLOCK
    z = fb.opaque_zero()

    def flat(x):
        x = jnp.ravel(x).astype(jnp.float32)
        return jnp.concatenate([x, jnp.zeros((npad - n,), jnp.float32)]) if npad > n else x

    mf, vf, pf = flat(m), flat(v), flat(p)
    in_t = jnp.arange(npad) < n
    valid, vpos = _certify.device_masks(mf, vf, pf, in_t)
    mq, vq, mp, vp, mtb, vtb = codecs.propose(mf.reshape(-1, codes.BLOCK), vf.reshape(-1, codes.BLOCK),
                                               valid.reshape(-1, codes.BLOCK), vpos.reshape(-1, codes.BLOCK),
                                               spec.decode_codec)
    mt, vt = fb.barrier(mtb.reshape(-1), z), fb.barrier(vtb.reshape(-1), z)
    exact, ok = _certify.device_classify(mf, vf, pf, mt, vt)
    if not spec.certify:
        escape = in_t & ~exact & ~ok
    else:
        thr = k.threshold   # lr, step, betas, eps, weight decay and tau enter through `k` (traced)
        pabs = jnp.abs(pf)
        clip = jnp.full((npad,), np.float32(spec.clip), jnp.float32)
        if spec.op_model.startswith("torch-adam") and not spec.op_model.startswith("torch-adamw"):
            # torch-adam with weight decay folds wd*p into g (opmodel.StepConstants.coupled_decay)
            clip = jnp.where(k.weight_decay > 0, (clip + k.weight_decay * pabs) * np.float32(1 + 2.0**-20), clip)
        lower = _bound.batch_lower(k, mf, vf, mt, vt, clip)
        pending = in_t & ~exact & ok & ~(lower > thr)
        cert = jnp.zeros((npad,), bool)
        if fast and spec.bound == "shared" and spec.partition == "mixed":
            bnd, usable = _fastbound.fast_bound(k, mf, vf, mt, vt, pabs, clip)
            cert = pending & usable & (bnd <= thr)
            pending = pending & ~cert
        per_level = not isinstance(capacity, int)
        sizes = level_sizes(capacity)
        pending_counts = []
        for level in range(len(_bound.LEVELS)):
            edges = jnp.asarray(_bound.unit_edges(level, spec.partition))
            size = sizes[level]
            chunk = min(size, LEVEL_CHUNK[level])
            pending_counts.append(jnp.sum(pending, dtype=jnp.int32))
            idx = jnp.nonzero(pending, size=size, fill_value=npad)[0]
            take = jnp.minimum(idx, npad - 1).reshape(-1, chunk)

            def one(t, edges=edges):
                return _bound.batch_bound(k, mf[t], vf[t], mt[t], vt[t], pabs[t], clip[t], edges,
                                          bound=spec.bound, decay_in_update=None)

            b = jax.lax.map(one, take).reshape(-1)
            good = (b >= 0) & (b <= thr) & (idx < npad)  # NaN and -inf never certify
            cert = cert.at[jnp.where(good, idx, npad)].set(True, mode="drop")
            if level == 0 or per_level:  # coordinates beyond capacity escape
                pending = jnp.zeros((npad,), bool).at[idx].set(True, mode="drop") & pending
            pending = pending & ~cert
        escape = in_t & ~exact & ~cert
    E = escape_capacity
    count = jnp.sum(escape, dtype=jnp.int32)
    eidx = jnp.nonzero(escape, size=E, fill_value=n)[0].astype(jnp.int32)
    inside = eidx < n
    safe = jnp.minimum(eidx, npad - 1)
    arrays = {
        "m_codes": mq.reshape(-1)[:n], "v_codes": vq.reshape(-1)[:n],
        "m_params": mp.astype(jnp.float32), "v_params": vp.astype(jnp.float32),
        "escape_index": eidx, "escape_m": jnp.where(inside, mf[safe], 0.0),
        "escape_v": jnp.where(inside, vf[safe], 0.0), "escape_count": count,
        "overflow": jnp.maximum(count - E, 0),
    }
    if counts:
        nl = len(_bound.LEVELS)
        arrays["pending_counts"] = jnp.stack(pending_counts) if spec.certify else jnp.zeros((nl,), jnp.int32)
        arrays["block_exact"] = jnp.sum((in_t & exact).reshape(-1, codes.BLOCK), axis=1, dtype=jnp.int32)
        arrays["block_uncertifiable"] = jnp.sum((in_t & ~exact & ~ok).reshape(-1, codes.BLOCK), axis=1,
                                                dtype=jnp.int32)
    if sample is not None:
        at = sample if isinstance(sample, jax.Array) else jnp.asarray(np.asarray(sample, np.int32))
        arrays["sample_m"] = jnp.where(escape[at], mf[at], mt[at])
        arrays["sample_v"] = jnp.where(escape[at], vf[at], vt[at])
    return JitEncoded(arrays, spec.codec, shape)


def level_sizes(capacity) -> tuple:
    """The candidates each level of `encode_traced` gathers for a `capacity`.

    Args:
      capacity: an int (every level gathers that many, rounded up to the level's chunk,
        `LEVEL_CHUNK`) or one int per level of `bound.LEVELS`.

    Returns:
      One int per level, each a multiple of ``min(its capacity, LEVEL_CHUNK[level])``.

    Raises:
      ConfigError: a capacity below 1 or a tuple of the wrong length.
    """
    nl = len(_bound.LEVELS)
    caps = (capacity,) * nl if isinstance(capacity, int) else tuple(int(c) for c in capacity)
    if len(caps) != nl or min(caps) < 1:
        raise ConfigError(f"capacity={capacity!r}: pass an int >= 1 or {nl} of them (one per level)")
    out = []
    for level, cap in enumerate(caps):
        chunk = min(cap, LEVEL_CHUNK[level])
        out.append(-(-cap // chunk) * chunk)
    return tuple(out)


def sample_positions(n: int, every: int) -> np.ndarray:
    """The flat positions of a tensor of `n` coordinates that the container writer checks:
    every `every`-th 256-block and the last one, whole blocks, clipped to `n`.

    Args:
      n: the coordinate count.
      every: the block stride (`jaxguard.format.container.SAMPLE_EVERY`).

    Returns:
      Sorted int64 positions in ``[0, n)``.
    """
    nb = codes.num_blocks(n)
    if nb == 0:
        return np.zeros(0, np.int64)
    blocks = np.arange(0, nb, every)
    if blocks[-1] != nb - 1:
        blocks = np.append(blocks, nb - 1)
    pos = (blocks[:, None] * codes.BLOCK + np.arange(codes.BLOCK)).reshape(-1)
    return pos[pos < n]


encode_jitted = jax.jit(encode_traced, static_argnums=(4, 5, 6))
"""`encode_traced` jitted with `spec`, `capacity` and `escape_capacity` static."""


def constants(config: GuardConfig) -> _bound.StepRow:
    """Deprecated alias: ``config.step_row()`` as jax arrays (a `bound.StepRow`).

    Args:
      config: the `GuardConfig` of the step being saved.

    Returns:
      Its `bound.StepRow` with float32 jax scalars.

    `encode_jit` now takes the static `config.spec` as its jit key, so passing a new
    `GuardConfig` per step no longer recompiles; pass ``constants=`` only to trace the
    constants explicitly (e.g. inside your own ``jax.jit``).
    """
    return config.step_row().as_float32(jnp)


def encode_jit(m, v, p, config, *, capacity: int = 4096, escape_capacity: int | None = None, constants=None):
    """Fixed-shape guarded encoding of one moment pair; jittable.

    Args:
      m, v, p: float32 arrays of one shape.
      config: a `GuardConfig` (its `spec` is the static key and its `step_row()` the
        traced constants, so a new lr or step does not recompile), or a `GuardSpec`
        together with `constants`.
      capacity: candidates the certificate examines (rounded up to a multiple of the
        level's chunk); beyond it they escape.
      escape_capacity: size of the escape buffers (default: n, never overflows).
      constants: a `bound.StepRow` (``config.step_row()``) passed as a traced argument;
        by default it is built from `config`.
    Returns:
      A `JitEncoded`.
    Raises:
      ConfigError: a config that is neither, a `GuardSpec` without constants, a
        non-float32 or mismatched input, a bad capacity.
    """
    if isinstance(config, GuardConfig):
        spec = config.spec
        if constants is None:
            constants = config.step_row()
    elif isinstance(config, GuardSpec):
        spec = config
        if constants is None:
            raise ConfigError("config is a GuardSpec; pass constants=cfg.step_row() for the step being saved")
    else:
        raise ConfigError(f"config is a {type(config).__name__}; pass a jaxguard.GuardConfig")
    if not isinstance(constants, _bound.StepRow):
        raise ConfigError(f"constants is a {type(constants).__name__}; pass cfg.step_row() (a bound.StepRow)")
    shape = tuple(np.shape(m))
    for name, x in (("m", m), ("v", v), ("p", p)):
        if np.dtype(x.dtype) != np.float32:
            raise ConfigError(f"{name} has dtype {x.dtype}; jaxguard certifies float32 moments and parameters, "
                              "cast with .astype(float32)")
        if tuple(np.shape(x)) != shape:
            raise ConfigError(f"{name} has shape {tuple(np.shape(x))} but m has {shape}; pass one parameter's moments")
    if not isinstance(capacity, int) or capacity < 1:
        raise ConfigError(f"capacity={capacity!r} must be an int >= 1 (candidates certified per call)")
    n = int(np.prod(shape, dtype=np.int64))
    E = n if escape_capacity is None else int(escape_capacity)
    if E < 1:
        E = 1
    return encode_jitted(m, v, p, constants.as_float32(jnp), spec, capacity, E)


def decode_jit(je: JitEncoded):
    """(m~, v~) of a `JitEncoded`, jittable; equal to ``guard.decode(to_encoded(je))``.

    Args:
      je: a `JitEncoded` from `encode_jit`.

    Returns:
      (m~, v~) float32 arrays of the original shape, escapes restored exactly.
    """
    n = je.n
    mt, vt = _guard.decode_arrays(je.arrays, je.codec, n)
    idx = je.arrays["escape_index"]
    mt = mt.at[idx].set(je.arrays["escape_m"], mode="drop")
    vt = vt.at[idx].set(je.arrays["escape_v"], mode="drop")
    return mt.reshape(je.shape), vt.reshape(je.shape)


def _host_tiny(x):
    return fb.host.tiny(np.asarray(x, np.float32).reshape(-1))


def to_encoded(je: JitEncoded, m=None, v=None) -> _guard.Encoded:
    """Host: fixed-size `JitEncoded` -> compact `guard.Encoded` (for `container.build`).

    With the original `m`, `v` it re-checks in numpy that every nonzero moment below
    ``2**-80`` (subnormals included) escapes, and adds the escape if the device missed it.

    Args:
      je: a `JitEncoded` (device or host arrays).
      m, v: the moments that were encoded (optional; enables the host re-check).

    Returns:
      A `guard.Encoded` with only the escapes that occurred.

    Raises:
      ConfigError: more escapes than `je`'s escape buffers hold (``overflow`` > 0).
    """
    a = {k: np.asarray(x) for k, x in je.arrays.items()}
    n = je.n
    count, over = int(a["escape_count"]), int(a["overflow"])
    if over:
        raise ConfigError(f"{count} coordinates escape but escape_capacity is {a['escape_index'].size}; call "
                          "encode_jit with a larger escape_capacity (or the default, n)")
    idx = a["escape_index"][:count].astype(np.int32)
    em, ev = a["escape_m"][:count].astype(np.float32), a["escape_v"][:count].astype(np.float32)
    if m is not None and v is not None:
        mh = np.asarray(m, np.float32).reshape(-1)
        vh = np.asarray(v, np.float32).reshape(-1)
        miss = np.flatnonzero(_host_tiny(mh) | _host_tiny(vh))
        miss = np.setdiff1d(miss, idx)
        if miss.size:
            idx = np.concatenate([idx, miss.astype(np.int32)])
            order = np.argsort(idx, kind="stable")
            idx = idx[order]
            em = np.concatenate([em, mh[miss]])[order]
            ev = np.concatenate([ev, vh[miss]])[order]
    arrays = {"m_codes": a["m_codes"], "v_codes": a["v_codes"], "m_params": a["m_params"],
              "v_params": a["v_params"], "escape_index": idx, "escape_m": em, "escape_v": ev}
    enc = _guard.Encoded(arrays, je.codec, je.shape)
    enc.stats = {"coordinates": n, "escapes": int(idx.size), "payload_bytes": _guard.payload_bytes(enc),
                 "raw_fp32_bytes": 8 * n, "exact": -1, "uncertifiable": -1, "certified_by_level": [],
                 "encode_seconds": 0.0}
    return enc
