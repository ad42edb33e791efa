"""Propose codes -> decode exactly as the reader will -> certify -> escape.

`encode(m, v, p, config)` is the public entry point for one moment pair.  Codes are
proposed per 256-block (jaxguard.core.codes), decoded with the reader's exact arithmetic, and
each coordinate whose decoded moments are not bitwise equal to the originals is
certified with `jaxguard.core.bound`: first one cell over ``[0, clip]`` per sign (the cheap
early accept), then the mixed linear-logarithmic partition, re-checked with 64, 256 and
1024 linear cells.  Whatever is not certified escapes: its FP32 pair is stored exactly.

This module is the API (`encode`, the one guarded encode entry, with its batch
`encode_many` and its v-only mode ``mu="exact"`` = `encode_v_only`; `decode`,
`decode_arrays`) and the joint search.  The pieces live beside it and are re-exported
here: `config` (GuardConfig, GuardSpec, CODECS, DEFAULT_CODEC), `encoded` (Encoded,
payload_bytes), `certify` (certify, certify_pc, fast_accept, classify, chunk sizes),
`codecs` (the codec table keyed by the registry ids), `floatbits` (bit classification).

Numerical contract
------------------
For every coordinate, ``decode(encode(m, v, p, cfg))`` returns either the exact input
pair (bitwise; always so for NaN, +-Inf, negative ``v``, non-finite ``p`` and nonzero
moments below ``2**-80``) or a pair whose first native update (op model
``cfg.op_model``, bias corrections at ``cfg.step + 1``) differs from the original's by
at most ``cfg.tau * cfg.lr`` for every gradient ``|g| <= cfg.clip``.  With
``cfg.certify=False`` (or the codec id ``block8-unguarded``) certification is skipped and
there is no such guarantee: only the exact and the non-certifiable coordinates are exact.
"""
from __future__ import annotations

__all__ = ["decode_arrays", "encode", "encode_many", "MAX_PIECE", "join_pieces", "propose_blocks", "ALIGN",
           "aligned_zeros", "encode_v_only", "decode", "GuardConfig", "Encoded", "CODECS", "DEFAULT_CODEC"]

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard.core import adaptive as _adaptive
from jaxguard.core import bound as _bound
from jaxguard.core import codecs as _codecs
from jaxguard.core import codes
from jaxguard.core import fastbound as _fastbound
from jaxguard.core import floatbits as _fbits
from jaxguard.core import programs as _programs
from jaxguard.core.certify import (ADAPTIVE_TIER, CELLS_TIERS_ABOVE, FAST_CELLS_TIER, FAST_CHUNK, FAST_TIER,  # noqa: F401
                                   SPEED_TIERS_ABOVE, block_stats_valid, certify, certify_pc, classify, device_classify,
                                   device_masks, fast_accept, prepare_stages, v_positive)
from jaxguard.core.config import BOUNDS, CODECS, DEFAULT_CODEC, PARTITIONS, GuardConfig, GuardSpec  # noqa: F401
from jaxguard.core.encoded import ArrayPytree, Encoded, payload_bytes  # noqa: F401
from jaxguard.errors import ConfigError
from jaxguard.format import container as _container

# Proposals and decodes come from the core codec table (jaxguard.core.codecs).
_propose = _codecs.propose   # the jitted proposal of a fixed-width codec (jit_encode, nu-only)


def decode_arrays(arrays: dict, codec: str, n: int):
    """Codes -> float32 flat (m~, v~) before escapes; identical to jaxguard.format.reader.

    Args:
      arrays: an encoded form's arrays (``m_codes``, ``v_codes``, ``m_params``, ``v_params``).
      codec: its registry id.
      n: coordinates.

    Returns:
      (m~, v~) flat float32 jax arrays of length n, escapes not yet restored.
    """
    mq, vq = jnp.asarray(arrays["m_codes"]), jnp.asarray(arrays["v_codes"])
    nb = codes.num_blocks(n)
    pad = nb * codes.BLOCK - n

    def blocks(q):
        q = jnp.ravel(q)
        if pad:
            q = jnp.concatenate([q, jnp.zeros((pad,), q.dtype)])
        return q.reshape(nb, codes.BLOCK)

    mp, vp = jnp.asarray(arrays["m_params"]), jnp.asarray(arrays["v_params"])
    mt, vt = _codecs.get(codec).decode_blocks(blocks(mq), blocks(vq), mp, vp)
    return mt.reshape(-1)[:n], vt.reshape(-1)[:n]


def _check_inputs(m, v, p):
    shape = tuple(np.shape(m))
    for name, x in (("m", m), ("v", v), ("p", p)):
        if np.dtype(getattr(x, "dtype", np.asarray(x).dtype)) != np.float32:
            raise ConfigError(f"{name} has dtype {np.dtype(getattr(x, 'dtype', np.asarray(x).dtype))}; jaxguard "
                              "certifies float32 moments and parameters, cast with .astype(float32)")
        if tuple(np.shape(x)) != shape:
            raise ConfigError(f"{name} has shape {tuple(np.shape(x))} but m has {shape}; pass the moments of one parameter")
    return shape


def encode(m, v, p, config: GuardConfig, *, keep_decoded: bool = False, mu: str = "coded") -> Encoded:
    """Guarded encoding of one Adam moment pair (see the module's numerical contract): the
    one guarded encode entry (`encode_many` is its batch; ``mu="exact"`` its v-only mode,
    `encode_v_only`).

    Args:
      m, v: the parameter's Adam moments (float32, one shape).
      p: the parameter itself (float32, same shape): decoupled decay and the final
        ``p + step`` rounding enter the certificate.
      config: the `GuardConfig` of the next update (lr, step, betas, eps, weight decay,
        op model, tau, clip, codec).
      keep_decoded: also keep the certified ``(m~, v~)`` as `Encoded.decoded` (8 bytes per
        coordinate until the encoding is dropped), which the container writer then hashes
        instead of decoding the entry again.
      mu: ``"coded"`` (both moments coded) or ``"exact"``: `m` is kept exactly elsewhere
        (a bfloat16 mu) and only `v` is coded and certified (`encode_v_only`).

    Returns:
      An `Encoded` (codes, block parameters, exact escapes, stats).

    Raises:
      ConfigError: non-float32 or mismatched inputs; another `mu`.
    """
    if mu == "exact":
        return encode_v_only(m, v, p, config, keep_decoded=keep_decoded)
    if mu != "coded":
        raise ConfigError(f"mu={mu!r}; use 'coded' (m and v coded) or 'exact' (m kept exactly, v coded)")
    return encode_many([(m, v, p, config)], keep_decoded=keep_decoded)[0]


def encode_many(items, *, progress: bool = False, keep_decoded: bool = False,
                state_coordinates: int | None = None) -> list:
    """Guarded encoding of many moment pairs [(m, v, p, config), ...] in one pass.

    All tensors sharing a codec, bound and partition are laid side by side (each padded
    to whole blocks) and certified together with per-coordinate constants, so a
    checkpoint of many small tensors costs a few large jitted calls, not many small ones.

    Args:
      items: an iterable of ``(m, v, p, config)`` as for `encode`.
      progress: show a tqdm bar while certifying.
      keep_decoded: as for `encode` (`jaxguard compress` streams each slab to the writer).
      state_coordinates: the coordinates of every moment pair of the state these items are
        part of (the writer's count, `UNKNOWN_STATE` when it streams): a state of at most
        `certify.CELLS_TIERS_ABOVE` certifies without the cells tiers.  Default: the
        items' own.

    Returns:
      A list of `Encoded`, one per item, in order.

    Raises:
      ConfigError: as `encode`, naming the offending input.
    """
    items = list(items)
    shapes = [_check_inputs(m, v, p) for m, v, p, _ in items]
    if any(int(np.prod(s, dtype=np.int64)) > MAX_PIECE for s in shapes):
        return _encode_in_pieces(items, shapes, progress, keep_decoded, state_coordinates)
    groups: dict = {}
    for i, (_, _, _, cfg) in enumerate(items):
        s = cfg.spec
        groups.setdefault((s.codec, s.bound, s.partition, s.certify), []).append(i)
    out = [None] * len(items)
    if state_coordinates is None:
        state_coordinates = sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
    for (codec, bound, partition, certified), idxs in groups.items():
        encs = _encode_group([items[i] for i in idxs], [shapes[i] for i in idxs], codec, bound, partition, progress,
                             certified=certified, keep_decoded=keep_decoded, state_coordinates=state_coordinates)
        for i, e in zip(idxs, encs):
            out[i] = e
    return out


# Tensors above this many elements are encoded in pieces (a multiple of the block size,
# so blocks never straddle pieces) and reassembled with 64-bit escape indices: the
# chunked path for tensors of 2**31 elements or more.
MAX_PIECE = 1 << 28
# `encode_many`'s state size where the caller cannot count it (a streamed save): every tier runs.
UNKNOWN_STATE = 1 << 62


def _encode_in_pieces(items, shapes, progress, keep_decoded, state_coordinates):
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
        out[i].append((start, encode_many([piece], progress=progress, keep_decoded=keep_decoded,
                                          state_coordinates=state_coordinates)[0]))
    return [join_pieces(pieces, shape) for pieces, shape in zip(out, shapes)]


def join_pieces(pieces, shape):
    """One `Encoded` of a tensor from the encodings of its consecutive whole-block pieces.

    Blocks and coordinates are certified independently, so the joined codes, escapes and
    certified values are those of encoding the tensor in one piece.

    Args:
      pieces: ``[(start, Encoded)]`` in order; ``start`` is the piece's first coordinate.
        Certified values (`Encoded.decoded`) are joined when every piece has them, whole
        or sampled (a dict of ``positions``, ``m``, ``v``; positions shifted by ``start``).
      shape: the tensor's shape.

    Returns:
      The joined `Encoded` (stats summed).
    """
    if len(pieces) == 1:
        start, enc = pieces[0]
        return Encoded(enc.arrays, enc.codec, tuple(shape), enc.stats, decoded=enc.decoded)
    a = {k: np.concatenate([e.arrays[k] for _, e in pieces]) for k in
         ("m_codes", "v_codes", "m_params", "v_params", "escape_m", "escape_v", "widths") if k in pieces[0][1].arrays}
    a["escape_index"] = np.concatenate([e.arrays["escape_index"].astype(np.int64) + s for s, e in pieces])
    decoded = None
    if all(isinstance(e.decoded, dict) for _, e in pieces):   # samples of what a device encode certified
        decoded = {"positions": np.concatenate([np.asarray(e.decoded["positions"], np.int64) + s for s, e in pieces]),
                   **{k: np.concatenate([e.decoded[k] for _, e in pieces]) for k in ("m", "v")}}
    elif all(e.decoded is not None and not isinstance(e.decoded, dict) for _, e in pieces):
        # kept as pieces: the writer hashes and samples them in order, never joined
        decoded = tuple(_container.Pieces([e.decoded[k] for _, e in pieces]) for k in (0, 1))
    enc = Encoded(a, pieces[0][1].codec, tuple(shape), decoded=decoded)
    stats = {}
    for _, e in pieces:
        for k, val in e.stats.items():
            if isinstance(val, list):
                stats[k] = [x + y for x, y in zip(stats.get(k, [0] * len(val)), val)]
            elif isinstance(val, str):   # a label (the device route's "route")
                stats[k] = val
            else:
                stats[k] = stats.get(k, 0) + val
    stats["payload_bytes"] = _codecs.joined_payload(pieces, enc)
    enc.stats = stats
    return enc


def _group_constants(items, gidx, ph):
    """(K rows, row of each coordinate, |p|, per-coordinate clip) of a group laid side by
    side (`gidx`: item per coordinate).  Items with bitwise-equal rows share one row: a
    checkpoint's tensors mostly share one step, and the kernels then read one row, not a
    gather per coordinate."""
    consts = [cfg.constants() for *_, cfg in items]
    rows = [cfg.step_row() for *_, cfg in items]   # an interval lr's row certifies every rate in it
    first: dict = {}
    item_row = np.array([first.setdefault(tuple(np.float32(x).tobytes() for x in r), len(first)) for r in rows],
                        np.int32)
    rows = [rows[int(i)] for i in np.unique(item_row, return_index=True)[1]]
    if len(rows) == 1:
        K, kidx = _bound.stack_rows(rows), _constant(gidx.shape[0], np.int32, 0)
    else:
        K = _bound.stack_rows(rows + rows[:1] * (_bucket(max(16, len(rows))) - len(rows)))  # few compiled shapes
        kidx = item_row[gidx]
    pabs = np.abs(ph)
    clips = np.array([cfg.clip for *_, cfg in items], np.float32)
    if (clips == clips[0]).all():
        clip = _constant(gidx.shape[0], np.float32, clips[0])
    else:
        clip = clips[gidx]
    wd_rows = np.array([c.weight_decay if c.coupled_decay else 0.0 for c in consts], np.float32)
    if (wd_rows > 0).any():   # torch Adam's coupled decay widens the gradient range by wd*|p|
        wd_coupled = wd_rows[gidx]
        with np.errstate(invalid="ignore", over="ignore"):  # non-finite p escapes anyway
            clip = np.where(wd_coupled > 0, (clip + wd_coupled * pabs) * np.float32(1 + 2.0**-20), clip)
    return K, kidx, pabs, clip.astype(np.float32, copy=False)


def _encode_group(items, shapes, codec, bound, partition, progress=False, certified=True, keep_decoded=False, *,
                  state_coordinates):
    """Encode tensors sharing one `GuardSpec` side by side; `codec` is the entry id
    (``block8-unguarded`` decodes as block8); `state_coordinates` as `encode_many`'s."""
    t0 = time.perf_counter()
    propose_codec = GuardSpec(codec=codec).decode_codec
    ns = [int(np.prod(s, dtype=np.int64)) for s in shapes]
    nbs = [codes.num_blocks(n) for n in ns]
    offs = np.concatenate([[0], np.cumsum(nbs)]).astype(np.int64)
    nblk = _bucket(int(offs[-1])) if offs[-1] <= PROPOSE_CHUNK else -(-int(offs[-1]) // PROPOSE_CHUNK) * PROPOSE_CHUNK
    npad = nblk * codes.BLOCK
    entry = _codecs.get(propose_codec)
    staged = _staged_views(items, npad) if entry.choose is None else None
    if staged is not None:   # one tensor filling its blocks exactly (a large tensor's piece): no copies
        mh, vh, ph = staged
        in_tensor, gidx = _constant(npad, bool, True), _constant(npad, np.int32, 0)
    else:
        mh, vh, ph = (aligned_zeros(npad, np.float32) for _ in range(3))
        in_tensor = aligned_zeros(npad, bool)
        gidx = np.zeros(npad, np.int32)
        for i, ((m, v, p, _), n) in enumerate(zip(items, ns)):
            b = int(offs[i]) * codes.BLOCK
            mh[b:b + n] = np.asarray(m, np.float32).reshape(-1)
            vh[b:b + n] = np.asarray(v, np.float32).reshape(-1)
            ph[b:b + n] = np.asarray(p, np.float32).reshape(-1)
            in_tensor[b:b + n] = True
            gidx[b:b + int(nbs[i]) * codes.BLOCK] = i
    mf, vf = mh, vh
    widths = fast = K = None
    # a small group skips the tiers that exist for speed: fewer programs (certify.SPEED_TIERS_ABOVE);
    # not where the codes are chosen on the host (the rate pass's signed gate sees other rows
    # without the cells tier: 1 escape more in 1 of 24 logrel-ans encodings forced onto it,
    # bench/experiments/results/speed_tiers_escapes.md; its encode is seconds anyway)
    host_chosen = entry.choose is not None
    speed = host_chosen or int(sum(ns)) > SPEED_TIERS_ABOVE
    # and a state of at most certify.CELLS_TIERS_ABOVE coordinates skips the cells tiers
    cells = host_chosen or (speed and state_coordinates > CELLS_TIERS_ABOVE)
    prepared = _programs.Prepared()
    # log8-rel-zstd: blocks that escape much are proposed again with wider codes
    widen = _codecs.get(codec).widen if certified and not any(cfg.joint for *_, cfg in items) else None
    if host_chosen:
        valid, vpos = (np.asarray(x).reshape(-1, codes.BLOCK) for x in
                       _programs.call(_device_masks, mh, vh, ph, in_tensor))
        # codes chosen on the host (logrel-aw: per-block widths on certified escapes); the
        # assembled codes come back decoded exactly as the reader decodes them and are
        # certified again from scratch below
        K, kidx, pabs, clip = _group_constants(items, gidx, ph)

        def certify_candidates(a, b, idx, max_level=None, at_idx=False, reject_first=False):
            # a, b: decoded values of the whole group, or (at_idx) of the coordinates idx only
            if not certified:   # the guard is off: every certifiable candidate is kept
                return np.zeros(idx.shape[0], np.int8)
            if at_idx:
                return certify_pc(K, kidx[idx], mf[idx], vf[idx], a, b, pabs[idx], clip[idx], np.arange(idx.size),
                                  bound, partition, max_level=max_level, reject_first=reject_first)
            return certify_pc(K, kidx, mf, vf, a, b, pabs, clip, idx, bound, partition, max_level=max_level,
                              reject_first=reject_first)

        def classified(a, b, idx=None):
            if idx is not None:   # a, b at idx: the host classifier (the same booleans), no pass over the group
                return classify(mh[idx], vh[idx], ph[idx], a, b)
            return tuple(np.asarray(x) for x in _programs.call(_device_classify, mh, vh, ph, a, b))

        mq, vq, mp, vp, widths, mt, vt = entry.choose(mh, vh, ph, valid, vpos, in_tensor, classified,
                                                      certify_candidates, list(zip(offs[:-1].tolist(), ns)))
        exact, ok = classified(mt, vt)
    else:   # the masks, the proposal, the classification (and the closed-form tier) in one program per chunk
        tier = None
        if certified:
            K, kidx, pabs, clip = _group_constants(items, gidx, ph)
            # the tiers' programs compile on other threads while this one runs the proposal
            prepared = prepare_stages(K, kidx, mh, vh, mh, vh, pabs, clip, bound, partition, wait=False,
                                      cells_tiers=cells)
            if speed and bound == "shared" and partition == "mixed":
                tier = (K, kidx, clip)
        mq, vq, mp, vp, mt, vt, exact, ok, fast = _propose_chunked(
            *(x.reshape(-1, codes.BLOCK) for x in (mh, vh, ph, in_tensor)), propose_codec, tier)
    if not certified:
        escape = in_tensor & ~exact & ~ok
        level_of = np.full(npad, -1, np.int8)
    else:
        if K is None:
            K, kidx, pabs, clip = _group_constants(items, gidx, ph)
        cand_mask = in_tensor & ~exact & ok
        if speed and bound == "shared" and partition == "mixed":   # closed-form tier (the ablations keep their own)
            if fast is None:
                fast = cand_mask & fast_accept(K, kidx, mh, vh, mt, vt, pabs, clip, valid=cand_mask)
            # FAST_TIER where fast, else -1, in one pass (a boolean-mask store took 3 ms a 1M slab)
            level_of = np.multiply(fast.view(np.int8), np.int8(FAST_TIER + 1))
            level_of -= np.int8(1)
            cand_mask &= ~fast
        else:
            level_of = np.full(npad, -1, np.int8)
        cand = np.flatnonzero(cand_mask)
        level_of[cand] = certify_pc(K, kidx, mf, vf, mt, vt, pabs, clip, cand, bound, partition, progress,
                                    fast=False, cells_tiers=cells)
        escape = in_tensor & ~exact & (level_of < 0)
    prepared.wait()
    if widen is not None and K is not None and entry.choose is None:
        # a later save whose blocks escape more compiles nothing; this one returns before
        # they are ready (a small state seldom widens: 3 of a cold save's 15 programs)
        _programs.prepare(lambda: _adaptive.widen_calls(K, npad, closed_form=speed),
                          key=("widen", K.keep.shape[0], npad >= FAST_CHUNK, speed), background=True)
    mq, vq = mq.reshape(-1), vq.reshape(-1)
    if widen is not None:
        mq, vq, mp, vp, mt, vt, exact, ok, escape, level_of, widths = widen(
            mh, vh, ph, in_tensor, mq, vq, mp, vp, mt, vt, exact, ok, escape, level_of,
            lambda idx, a, b: certify_pc(K, kidx[idx], mf[idx], vf[idx], a, b, pabs[idx], clip[idx],
                                         np.arange(idx.size), bound, partition, fast=speed,
                                         cells_tiers=cells))
    rescued = np.zeros(npad, bool)
    if certified and any(cfg.joint for *_, cfg in items):
        joint_on = np.zeros(npad, bool)
        for i, (*_, cfg) in enumerate(items):
            if cfg.joint:
                joint_on[int(offs[i]) * codes.BLOCK:int(offs[i] + nbs[i]) * codes.BLOCK] = True
        mq, vq = np.array(mq), np.array(vq)   # _joint_search writes codes in place
        rescued = _joint_search(codec, np.flatnonzero(escape & ok & joint_on), mq, vq, mp, vp, mh, vh, pabs, clip,
                                K, kidx, bound, partition)
        escape &= ~rescued
        if rescued.any():   # the rescued coordinates decode from their new codes (as certified)
            r = np.flatnonzero(rescued)
            mt, vt = np.array(mt, np.float32), np.array(vt, np.float32)
            mt[r], vt[r] = _decode_points(codec, mq[r], vq[r], mp[r // codes.BLOCK], vp[r // codes.BLOCK])
    # what the reader will restore, as certified: the decoded codes, escapes exact
    m_dec = v_dec = None
    if keep_decoded:
        esc_all = np.flatnonzero(escape)
        m_dec, v_dec = (x if isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.writeable
                        else np.array(x, np.float32) for x in (mt, vt))   # mt, vt are not used after this
        m_dec[esc_all], v_dec[esc_all] = mh[esc_all], vh[esc_all]
    elapsed = time.perf_counter() - t0
    total = max(sum(ns), 1)
    payload_many = _codecs.get(codec).payload_many
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
        enc = Encoded(arrays, codec, tuple(shape), decoded=None if m_dec is None else (m_dec[b:b + n], v_dec[b:b + n]))
        per_level = _level_counts(level_of[b:b + n])
        ex, okk = exact[b:b + n], ok[b:b + n]
        n_exact = int(np.count_nonzero(ex))
        enc.stats = {
            "coordinates": n, "escapes": int(esc.size), "exact": n_exact,
            "uncertifiable": n - int(np.count_nonzero(ex | okk)),
            "certified_by_level": per_level[:len(_bound.LEVELS)],
            "certified_fast": per_level[-3],
            "certified_adaptive": per_level[-2],
            "certified_fast_cells": per_level[-1],
            "joint_rescued": int(rescued[b:b + n].sum()),
            "payload_bytes": payload_bytes(enc) if payload_many is None else 0, "raw_fp32_bytes": 8 * n,
            "encode_seconds": elapsed * n / total,
        }
        encs.append(enc)
    if payload_many is not None:   # logrel-ans: the sections built once, kept for the writer
        for enc, pb in zip(encs, payload_many(encs)):
            enc.stats["payload_bytes"] = pb
    return encs


def _level_counts(level_of) -> list:
    """Coordinates of each refinement level, then of `FAST_TIER`, `ADAPTIVE_TIER` and
    `FAST_CELLS_TIER`.
    One comparison a value: ``np.bincount`` first casts the int8 levels to int64, 8 fresh
    bytes a coordinate (1 GB of page faults at 124M coordinates)."""
    hit = np.empty(level_of.shape, bool)
    return [int(np.count_nonzero(np.equal(level_of, np.int8(L), out=hit)))
            for L in (*range(len(_bound.LEVELS)), FAST_TIER, ADAPTIVE_TIER, FAST_CELLS_TIER)]


JOINT_MOVES = tuple((dm, dv) for dm in (-1, 0, 1) for dv in (-1, 0, 1) if (dm, dv) != (0, 0))


def _joint_search(codec, idx, mq, vq, mp, vp, mh, vh, pabs, clip, K, gidx, bound, partition):
    """Joint code choice: for coordinates that escaped, try the 8 neighbouring (m, v) code
    pairs (block parameters fixed, so only that coordinate changes) and keep the first
    pair that certifies.  Updates mq/vq in place; returns the rescued mask."""
    rescued = np.zeros(mh.shape[0], bool)
    if idx.size == 0:
        return rescued
    if _codecs.get(codec).decode_points is None:
        joint = ", ".join(c for c, e in _codecs.TABLE.items() if e.decode_points is not None)
        raise ConfigError(f"joint=True applies to the {joint} codecs, not {codec!r}")
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
        lv = certify_pc(K, gidx[todo], mh[todo], vh[todo], mt, vt, pabs[todo], clip[todo],
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
    mt, vt = _codecs.get(codec).decode_points(jnp.asarray(qm, jnp.int32), jnp.asarray(qv, jnp.int32), mp_rows, vp_rows)
    return np.asarray(mt, np.float32), np.asarray(vt, np.float32)


PROPOSE_CHUNK = 4096     # blocks per `_propose` call once a group exceeds it (one compiled shape)


def _propose_chunked(mb, vb, pb, in_tensor, codec, tier=None):
    """`_propose_classified` over host blocks in pieces of `PROPOSE_CHUNK` blocks -> host
    arrays (codes, params, then flat m~, v~, exact, ok, fast); a group of <= PROPOSE_CHUNK
    blocks is one call.  With `tier` = ``(K, kidx, clip)`` (`_group_constants`) the
    closed-form tier runs on the proposal's device output (`_fast_tier`): ``fast`` marks
    the candidates it certifies (else None)."""
    nb = mb.shape[0]
    step = min(nb, PROPOSE_CHUNK)
    if tier is None:
        outs = [propose_blocks(mb[s:s + step], vb[s:s + step], pb[s:s + step], in_tensor[s:s + step], codec)
                for s in range(0, nb, step)]
    else:
        K, kidx, clip = tier
        K = _bound.as_step_row(K, -1).as_float32(np)
        one = K.keep.shape[0] == 1
        if one:   # one row for every coordinate: scalars, no gather
            K = _bound.StepRow(*(x[0] for x in K))
        kb, cb = (None if one else kidx.reshape(nb, codes.BLOCK)), clip.reshape(nb, codes.BLOCK)
        outs = []
        for s in range(0, nb, step):
            blocks = (mb[s:s + step], vb[s:s + step], pb[s:s + step], in_tensor[s:s + step])
            o = propose_blocks(*blocks, codec)
            outs.append((*o, _programs.call(_fast_tier, *blocks, *o[4:8], K, None if kb is None else kb[s:s + step],
                                            cb[s:s + step])))
    k = len(outs[0])
    # one chunk: zero-copy read-only views of the program's outputs (whoever writes copies first)
    res = [np.concatenate([np.asarray(o[i]) for o in outs]) if len(outs) > 1 else np.asarray(outs[0][i])
           for i in range(k)]
    mq, vq, mp, vp, mt, vt, exact, ok = res[:8]
    fast = res[8].reshape(-1) if k > 8 else None
    return mq, vq, mp, vp, mt.reshape(-1), vt.reshape(-1), exact.reshape(-1), ok.reshape(-1), fast


def propose_blocks(mb, vb, pb, in_tensor, codec):
    """The block masks, `codecs.propose` and `classify` of [nb, 256] blocks, as the guard runs
    them: one program, or three for a codec with `codecs.CoreCodec.propose_stages` (its
    first stage with the masks, its second, the classification).

    Numerical contract: the same bits as the three in one program (only XLA's fusion
    differs; tests/core/test_propose_stages.py checks every output on adversarial blocks).

    Args:
      mb, vb, pb: [nb, 256] float32 blocks of m, v and the parameter.
      in_tensor: [nb, 256] bool, True on a tensor's coordinates (False on padding).
      codec: a codec id with a `propose`.

    Returns:
      ``(mq, vq, mp, vp, m~, v~, exact, ok)`` device arrays, as `_propose_classified`.
    """
    if _codecs.get(codec).propose_stages is None:
        return _programs.call(_propose_classified, mb, vb, pb, in_tensor, codec=codec)
    valid, vpos, *carry = _programs.call(_propose_first, mb, vb, pb, in_tensor, codec=codec)
    out = _programs.call(_propose_second, mb, vb, valid, vpos, tuple(carry), codec=codec)
    return (*out, *_programs.call(_device_classify, mb, vb, pb, out[4], out[5]))


@functools.partial(jax.jit, static_argnames=("codec",))
def _propose_first(mb, vb, pb, in_tensor, codec):
    valid, vpos = device_masks(mb, vb, pb, in_tensor)
    return (valid, vpos, *_codecs.get(codec).propose_stages[0](mb, vb, valid, vpos))


@functools.partial(jax.jit, static_argnames=("codec",))
def _propose_second(mb, vb, valid, vpos, carry, codec):
    return _codecs.get(codec).propose_stages[1](mb, vb, valid, vpos, *carry)


@functools.partial(jax.jit, static_argnames=("codec",))
def _propose_classified(mb, vb, pb, in_tensor, codec):
    """The block masks, `codecs.propose` and `classify` of [nb, 256] blocks, one program:
    the host never walks the floats (the device classifier gives the same booleans)."""
    valid, vpos = device_masks(mb, vb, pb, in_tensor)
    mq, vq, mp, vp, mt, vt = _codecs.get(codec).propose(mb, vb, valid, vpos)
    exact, ok = device_classify(mb, vb, pb, mt, vt)
    return mq, vq, mp, vp, mt, vt, exact, ok


@jax.jit
def _fast_tier(mb, vb, pb, in_tensor, mt, vt, exact, ok, K, kidx, clip):
    """The closed-form tier (`fastbound.batch_fast_accept`'s test) of the candidates of
    `_propose_classified`'s output, still on the device; `K` is a `bound.StepRow` of
    scalars (kidx None) or of [G] rows gathered by `kidx`."""
    shape = mb.shape
    n = mb.size
    piece = min(n, FAST_CHUNK)   # XLA keeps the tier's intermediates of one piece in cache

    def one(xs):
        m, v, p, t, a, b_, e, o, c, k = xs
        kt = K if k is None else K.take(k)
        bnd, usable = _fastbound.fast_bound(kt, m, v, a, b_, jnp.abs(p), c)
        return t & ~e & o & usable & (bnd <= kt.threshold)

    xs = tuple(None if x is None else x.reshape(-1, piece) for x in (mb, vb, pb, in_tensor, mt, vt, exact, ok, clip, kidx))
    return jax.lax.map(one, xs).reshape(shape)


_device_masks = jax.jit(device_masks)
_device_classify = jax.jit(device_classify)


# jax hands a host buffer to an XLA CPU program without copying it (a numpy argument, a
# DLPack tensor: `torch_compat.state.encoder_view`) only when its data is aligned to this
# many bytes (jax 0.10.2 copies one 4..32 bytes off, measured).  numpy's arrays are 16-byte
# aligned, and with the copy-in `_propose_classified` took 23.8 ms per 1M coordinates on one
# core, 15.4 ms without (bench/kernel_times.py, the compress profile at commit 7563a11).
ALIGN = 64


def aligned_zeros(n: int, dtype) -> np.ndarray:
    """``np.zeros(n, dtype)`` whose data starts on an `ALIGN`-byte boundary.

    Args:
      n: elements.
      dtype: a numpy dtype.

    Returns:
      A writable, zeroed, contiguous 1-d array.
    """
    dtype = np.dtype(dtype)
    raw = np.zeros(n * dtype.itemsize + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + n * dtype.itemsize].view(dtype)


def _staged_views(items, npad):
    """``(m, v, p)`` of a one-tensor group as flat float32 views, where the tensor fills
    its `npad` coordinates exactly and each view is contiguous and `ALIGN`-ed (what jax
    hands to a program without a copy), else None: the group is copied into padded
    buffers.  The views are only read (the guard writes into copies of its inputs)."""
    if len(items) != 1:
        return None
    flat = []
    for x in items[0][:3]:
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.size != npad or not x.flags.c_contiguous \
                or x.ctypes.data % ALIGN:
            return None
        flat.append(x.reshape(-1))
    return tuple(flat)


def _constant(n: int, dtype, value) -> np.ndarray:
    """A read-only `ALIGN`-ed array of `n` copies of `value` (the all-True mask, the zero
    row index and the common clip of a group), built once a shape and bit pattern: filling
    fresh ones cost each slab a pass over 9 bytes a coordinate."""
    dtype = np.dtype(dtype)
    make = _constant_of if n <= CONSTANT_KEPT else _constant_of.__wrapped__   # a large one is not kept
    return make(n, dtype.str, np.asarray(value, dtype).tobytes())


# `_constant`'s arrays are kept up to this many coordinates (a 1M slab's mask, row index and
# clip: 9 MB; a few group sizes each); a 2**28-coordinate piece's are built afresh.
CONSTANT_KEPT = 1 << 21


@functools.lru_cache(maxsize=32)
def _constant_of(n: int, dtype: str, bits: bytes) -> np.ndarray:
    out = aligned_zeros(n, dtype)
    out.fill(np.frombuffer(bits, dtype)[0])
    out.setflags(write=False)
    return out


def _bucket(nb: int) -> int:
    return 1 << max(0, (nb - 1).bit_length())


def _pad(x, size):
    return jnp.concatenate([x, jnp.zeros((size - x.shape[0],), x.dtype)]) if size > x.shape[0] else x


def encode_v_only(m, v, p, config: GuardConfig, *, keep_decoded: bool = False) -> Encoded:
    """Guarded encoding of `v` alone: `m` is kept exactly elsewhere (e.g. a bfloat16 mu).

    Certified with ``m~ == m``: only ``v`` is coded and only its error is bounded; the
    m channel of the result is all zeros (codes and parameters) and ``escape_m`` is 0.

    Args:
      m, v, p: arrays of one shape, taken as float32 (`m` as it will be restored).
      config: a `GuardConfig` with a fixed-width codec (`codecs.propose`).
      keep_decoded: also keep what the reader restores from this entry as certified
        (`Encoded.decoded`: the all-zero m channel and the certified v~, escapes exact).
    Returns:
      An `Encoded` of `config.spec.codec`; ``stats["payload_bytes"]`` counts the v side
      and the shared block metadata only (add what stores `m`).
    Raises:
      ConfigError: mismatched shapes, a host-chosen codec (logrel-aw).
    """
    t0 = time.perf_counter()
    shape = tuple(np.shape(m))
    for name, x in (("v", v), ("p", p)):
        if tuple(np.shape(x)) != shape:
            raise ConfigError(f"{name} has shape {tuple(np.shape(x))} but m has {shape}; pass the moments of one parameter")
    spec = config.spec
    n = int(np.prod(shape, dtype=np.int64))
    nb = codes.num_blocks(n)
    npad = _bucket(nb) * codes.BLOCK
    mf, vf, pf = (_pad(jnp.asarray(x, jnp.float32).reshape(-1), npad) for x in (m, v, p))
    zf = jnp.zeros_like(vf)
    mh, vh, ph = np.asarray(mf), np.asarray(vf), np.asarray(pf)
    in_tensor = np.arange(npad) < n
    valid = (in_tensor & block_stats_valid(np.zeros_like(vh), vh, ph)).reshape(-1, codes.BLOCK)
    vpos = v_positive(vh).reshape(-1, codes.BLOCK)
    mq, vq, mp, vp, _, vtb = _propose(zf.reshape(-1, codes.BLOCK), vf.reshape(-1, codes.BLOCK), valid, vpos,
                                      spec.decode_codec)
    vt = vtb.reshape(-1)
    exact, ok = (x[:n] for x in classify(mh, vh, ph, mh, np.asarray(vt)))
    cand = np.flatnonzero(~exact & ok)
    levels: list = []
    escape = ~exact
    if spec.certify:
        c = config.constants()
        clipv = jnp.full((npad,), np.float32(config.clip), jnp.float32)
        cert = certify(config.step_row(), mf, vf, mf, vt, jnp.abs(pf), clipv, cand, spec, c.decay_in_update, levels)
        escape[cand[cert]] = False
    else:
        escape[cand] = False
    esc = np.flatnonzero(escape).astype(np.int32)
    arrays = {"m_codes": np.asarray(mq).reshape(-1)[:n], "v_codes": np.asarray(vq).reshape(-1)[:n],
              "m_params": np.asarray(mp[:nb], np.float32), "v_params": np.asarray(vp[:nb], np.float32),
              "escape_index": esc, "escape_m": np.zeros(esc.size, np.float32), "escape_v": vh[:n][esc]}
    decoded = None
    if keep_decoded:
        v_dec = np.array(vt[:n], np.float32)
        v_dec[esc] = vh[:n][esc]
        decoded = (np.zeros(n, np.float32), v_dec)
    enc = Encoded(arrays, spec.codec, shape, decoded=decoded)
    enc.stats = {"coordinates": n, "escapes": int(esc.size), "exact": int(exact.sum()),
                 "uncertifiable": int((~exact & ~ok).sum()), "certified_by_level": levels,
                 "payload_bytes": payload_bytes(enc), "raw_fp32_bytes": 8 * n,
                 "encode_seconds": time.perf_counter() - t0}
    return enc


def decode(enc: Encoded):
    """Encoded -> (m~, v~) float32 arrays of the original shape, escapes restored exactly.

    Args:
      enc: an `Encoded` from `encode` (or read back from a container).

    Returns:
      (m~, v~) float32 jax arrays, bit-identical to what the numpy reader decodes.
    """
    mt, vt = decode_arrays(enc.arrays, enc.codec, enc.n)
    idx = jnp.asarray(enc.arrays["escape_index"])
    if idx.size:
        mt = mt.at[idx].set(jnp.asarray(enc.arrays["escape_m"]))
        vt = vt.at[idx].set(jnp.asarray(enc.arrays["escape_v"]))
    return mt.reshape(enc.shape), vt.reshape(enc.shape)
