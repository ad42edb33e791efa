"""Certification of candidate coordinates: the closed-form tier, then the cell levels.

`certify_pc` takes flat host arrays of original and decoded moments, the candidates'
indices and per-coordinate constants (a `bound.StepRow` of [G] arrays gathered with a
group index), and returns the level that certified each candidate: `FAST_TIER` for the
closed form (`jaxguard.core.fastbound`), 0..4 for the refinement levels of
`jaxguard.core.bound` (early accept on ten geometric cells, then the mixed partition
re-checked with 64, 256 and 1024 linear cells, after an early reject), or -1 (escape).
`classify` says which coordinates need no certificate (bitwise equal) and which can
have one at all (finite, ``v, v~ >= 0``, no nonzero moment below ``2**-80``).

Numerical contract
------------------
A coordinate gets a level >= 0 only if `jaxguard.core.bound.coordinate_bound` (or the
closed form's usable `fastbound.fast_bound`) is a number in ``[0, threshold]``: the
first native update from ``(mt, vt)`` is within ``tau * lr`` of the one from ``(m, v)``
for every ``|g| <= clip``.  Callers pass only coordinates `classify` calls certifiable.
"""
from __future__ import annotations

__all__ = ["classify", "block_stats_valid", "v_positive", "device_masks", "device_classify", "CHUNK",
           "SMALL_CHUNK", "PIECE_SIZES", "piece_sizes", "certify", "FAST_TIER", "ADAPTIVE_TIER",
           "FAST_CELLS_TIER", "SIGNED_CELLS_TIER", "SIGNED_MARGIN", "TIERED_FIRST_LEVEL", "FAST_CELLS_CHUNK",
           "FAST_CHUNK", "fast_accept", "certify_pc"]

import functools

import jax.numpy as jnp
import numpy as np

from jaxguard.core import bound as _bound
from jaxguard.core import fastbound as _fastbound
from jaxguard.core import programs as _programs
from jaxguard.core import floatbits as _fbits
from jaxguard.core.floatbits import host as _fb
from jaxguard.errors import ConfigError


def classify(m, v, p, mt, vt):
    """(exact, certifiable) masks on flat host arrays (bit tests: nothing is flushed).

    Args:
      m, v, p: original moments and parameter; mt, vt: decoded moments (float32).
    Returns:
      ``(exact, ok)``: bitwise-equal pairs, and pairs the bound may certify.
    """
    return _classify(_fb, (), m, v, p, mt, vt)


def _classify(cl, z, m, v, p, mt, vt):
    """`classify` with the `floatbits` classifier `cl` (host, or device with opaque zero z)."""
    fin = cl.finite(m, *z) & cl.finite(v, *z) & cl.finite(p, *z) & cl.finite(mt, *z) & cl.finite(vt, *z)
    nonneg = ~cl.negative(v, *z) & ~cl.negative(vt, *z)
    ok = fin & nonneg & cl.not_tiny(m, *z) & cl.not_tiny(v, *z) & cl.not_tiny(mt, *z) & cl.not_tiny(vt, *z)
    exact = (cl.bits(m, *z) == cl.bits(mt, *z)) & (cl.bits(v, *z) == cl.bits(vt, *z))
    return exact, ok


def block_stats_valid(m, v, p):
    """Coordinates whose v may set a block's code range: finite m, v, p, v >= 0, not tiny.

    Args:
      m, v, p: flat float32 host arrays (classified on their bits).

    Returns:
      bool array of the same length.
    """
    return _block_stats_valid(_fb, (), m, v, p)


def _block_stats_valid(cl, z, m, v, p):
    return cl.finite(m, *z) & cl.finite(v, *z) & cl.finite(p, *z) & ~cl.negative(v, *z) & cl.not_tiny(v, *z)


def v_positive(v):
    """Coordinates whose v is finite and > 0 (the log codes' range).

    Args:
      v: flat float32 host array (classified on its bits: a positive subnormal is > 0).

    Returns:
      bool array of the same length.
    """
    return _v_positive(_fb, (), v)


def _v_positive(cl, z, v):
    return cl.finite(v, *z) & ~cl.zero(v, *z) & ~cl.negative(v, *z)


def device_masks(m, v, p, in_tensor):
    """`block_stats_valid` (ANDed with `in_tensor`) and `v_positive` inside a jitted
    program (the device classifier of `jaxguard.core.floatbits`, the same booleans).

    Args:
      m, v, p: float32 jax or numpy arrays of one shape; in_tensor: bool, same shape.

    Returns:
      ``(valid, vpos)`` bool jax arrays of that shape.
    """
    z = _fbits.opaque_zero()
    valid = in_tensor & _block_stats_valid(_fbits.device, (z,), m, v, p)
    return valid, _fbits.device_positive_finite(v)


def device_classify(m, v, p, mt, vt):
    """`classify` inside a jitted program (the device classifier: the same booleans).

    Args:
      m, v, p, mt, vt: float32 jax or numpy arrays of one shape.

    Returns:
      ``(exact, ok)`` bool jax arrays of that shape.
    """
    z = _fbits.opaque_zero()
    # the decoded values pass the barrier: XLA cannot fuse their rounding into the bit tests
    mt, vt = _fbits.barrier(mt, z), _fbits.barrier(vt, z)
    return _classify(_fbits.device, (z,), m, v, p, mt, vt)


CHUNK = {0: 1 << 16, 1: 1 << 13, 2: 1 << 12, 3: 1 << 11, 4: 1 << 10}
SMALL_CHUNK = 1 << 10
# The tiers after the closed form see few coordinates: a 1M-coordinate slab sends 12-60 to
# the fixed levels (1,335 cells each at level 4) and a few hundred to the 20-cell adaptive
# partition.  They run in pieces of these sizes (and the kernel's full chunk), so a
# handful of coordinates is not padded to 256 or 1,024 rows.  Every cell bound gives a row
# the same bits at each size; the probes' rejects do not (XLA's max over them treats a NaN
# by vector layout), but a row rejected at any size is one no bound certifies, so only the
# work moves (tests/test_certify_pieces.py).
PIECE_SIZES = (1 << 6, 1 << 8, SMALL_CHUNK)


def piece_sizes(count: int, chunk: int) -> list:
    """The padded sizes of the pieces `count` coordinates run in: full `chunk`s, then what is
    left in the sizes of `PIECE_SIZES` (and `chunk`) of fewest rows, a call counted as
    `PIECE_SIZES`[0] rows more (a deep level's call costs about that many rows' work).

    Args:
      count: the coordinates to certify.
      chunk: the kernel's largest call (`CHUNK`, `ADAPTIVE_CHUNK`).

    Returns:
      A list of piece sizes, each one of `PIECE_SIZES` or `chunk`, summing to at least
      `count` (the last piece padded).
    """
    ladder = tuple(sorted({s for s in PIECE_SIZES if s < chunk} | {chunk}))
    full = count // chunk
    return [chunk] * full + list(_remainder_pieces(-(-(count - chunk * full) // ladder[0]), ladder))


@functools.lru_cache(maxsize=4096)
def _remainder_pieces(units: int, ladder: tuple) -> tuple:
    steps = [s // ladder[0] for s in ladder]
    cost, last = [0] * (units + 1), [0] * (units + 1)
    for u in range(1, units + 1):    # cost[u]: fewest rows + calls for u units, last[u]: its last piece
        cost[u], last[u] = min((k + 1 + cost[max(0, u - k)], k) for k in steps)
    out = []
    while units > 0:
        out.append(last[units] * ladder[0])
        units = max(0, units - last[units])
    return tuple(out)


def certify(k, m, v, mt, vt, pabs, clip, idx, cfg, decay_in_update=None, level_counts=None):
    """Indices `idx` (host int array) -> boolean array, True where certified, for one
    constants row `k` (a `bound.StepRow` from `bound.pack_constants`, which carries the
    adamw decay flag; `decay_in_update` is accepted for compatibility and must agree).

    Args:
      k: the `bound.StepRow` of the step; m, v, mt, vt: original and decoded moments
        (flat float32); pabs: ``|p|``; clip: per-coordinate gradient bound; idx: the
        candidates; cfg: a `GuardConfig` or `GuardSpec` (its bound and partition).
      level_counts: a list, extended with the coordinates certified per level.
    Returns:
      A bool array over `idx`.
    Raises:
      ConfigError: `decay_in_update` disagrees with `k`.
    """
    K = _bound.StepRow(*(np.asarray(x, np.float32)[None] for x in _bound.as_step_row(k)))
    if decay_in_update is not None and bool(K.decay_in_update[0]) != bool(decay_in_update):
        raise ConfigError("decay_in_update disagrees with the constants row; build k with bound.pack_constants")
    level_of = certify_pc(K, np.zeros(np.shape(m)[0], np.int32), m, v, mt, vt, pabs, clip, idx, cfg.bound,
                          cfg.partition)
    if level_counts is not None:
        level_counts.extend(int((level_of == L).sum()) for L in range(len(_bound.LEVELS)))
    return level_of >= 0


FAST_TIER = 100          # level_of value of coordinates certified by the closed form
ADAPTIVE_TIER = 101      # level_of value of those certified on their own partition (`bound.adaptive_unit_edges`)
FAST_CELLS_TIER = 102    # level_of value of those certified by the closed form on their own cells
SIGNED_CELLS_TIER = 103  # level_of value of those certified by the signed cells tier (`fastbound.signed_cells_bound`)
# max_level -1 (the width search's and the rate pass's candidates): after the signed cells
# tier, only rows whose bound is within this factor of the threshold go on to the adaptive
# partitions.  Of a logrel-ans encode's 201,897 moves the cells tier refused, every one the
# adaptive bound certified and the signed tier did not was within 1.0032x
# (bench/experiments/results/signed_cells.md); refusing is always sound.
SIGNED_MARGIN = 1.01
# After the adaptive tier the fixed levels start here (refusing is always sound: a level
# skipped can only leave a coordinate to the next).  On GPT-2's 124M coordinates levels 0-2
# saw the 39,887 rows the partitions and the dense reject left, certified 11 (0 / 0 / 11),
# and took 0.4 s of a 10.2 s one-thread compress; without them the payload and decoded
# SHA-256 are unchanged (levels 3-4 certify those 11 too), and so are 120 of 120
# reproduction encodings (bench/experiments/results/fixed_levels_escapes.md).
TIERED_FIRST_LEVEL = 3
FAST_CELLS_CHUNK = 1 << 14  # coordinates per call of that tier (16K: 58 ns a row, 4K: 72 ns)
ADAPTIVE_CHUNK = 1 << 12  # coordinates per call of the adaptive tier (28 cells a sign each)
FAST_CHUNK = 1 << 18     # coordinates per call of the closed-form tier
FAST_MIN_CHUNK = 1 << 12  # its smallest call (a handful of candidates, e.g. the rate pass's last moves)


def fast_accept(K, gidx, m, v, mt, vt, pabs, clip, valid=None):
    """The closed-form tier (`jaxguard.core.fastbound`) over whole flat arrays, in fixed-size
    chunks (four compiled shapes for any checkpoint: `FAST_CHUNK` and 1/4, 1/16, 1/64 of it
    for the last, smaller part).

    Args:
      K: the group's constants, a `bound.StepRow` of [G] arrays (`bound.stack_rows`).
      gidx: [n] int32, the row of `K` of each coordinate.
      m, v: [n] float32 original moments. mt, vt: [n] float32 decoded moments.
      pabs: [n] float32 ``|p|``. clip: [n] float32 gradient bound per coordinate.
      valid: optional [n] bool; chunks with no valid coordinate are skipped.

    Returns:
      [n] host bool mask, True where the closed form certifies; callers AND it with their
      candidate mask.
    """
    n = np.shape(m)[0]
    out = np.zeros(n, bool)
    K = _bound.as_step_row(K, -1).as_float32(jnp)
    arrays = [np.asarray(x, np.float32) for x in (m, v, mt, vt, pabs, clip)]
    gidx = np.asarray(gidx, np.int32)
    for s in range(0, n, FAST_CHUNK):
        e = min(n, s + FAST_CHUNK)
        if valid is not None and not valid[s:e].any():
            continue   # padding only
        part = [x[s:e] for x in arrays] + [gidx[s:e]]
        size = FAST_CHUNK
        while size > FAST_MIN_CHUNK and size // 4 >= e - s:   # few candidates: a smaller shape (4 in all)
            size //= 4
        if e - s < size:   # pad with zeros (certifiable, never read back)
            part = [np.concatenate([x, np.zeros(size - (e - s), x.dtype)]) for x in part]
        mm, vv, mmt, vvt, pp, cc, gg = part
        out[s:e] = np.asarray(_programs.call(_fastbound.batch_fast_accept, K, gg, mm, vv, mmt, vvt, pp, cc))[:e - s]
    return out


@functools.lru_cache(maxsize=None)
def _level_edges(level, partition):
    # host edges, built once: an eager jnp.asarray per slab and level cost 0.2 s of a GPT-2 compress
    e = _bound.unit_edges(level, partition)
    e.setflags(write=False)
    return e


def certify_pc(K, gidx, m, v, mt, vt, pabs, clip, idx, bound, partition, progress=False, fast=True,
               max_level=None, adaptive=True, reject_first=False):
    """Certify with per-coordinate constants: row ``gidx[i]`` of ``K`` (a `bound.StepRow`
    of [G] arrays, `bound.stack_rows`).

    With `fast` (the shared bound, mixed partition: the ablations keep their own
    certificate), the closed-form tier (`jaxguard.core.fastbound`)
    goes first, then the closed form on the coordinate's own cells
    (`fastbound.FAST_CELLS_PARTITIONS`, each partition on what the previous refused).  Then
    the adaptive tier (shared bound, mixed partition): the cell bound on
    each coordinate's own partition placed on its gradient scale
    (`bound.adaptive_unit_edges`), 8 cells a sign, then 20 and 28 on what those leave
    (`bound.ADAPTIVE_PARTITIONS`), which certifies about what the fixed level 3 does at a
    fraction of the cells.  What it leaves gets an early reject of the coordinates whose
    ideal difference at one of `bound.DENSE_PROBE_POINTS` already exceeds the threshold
    (half of the coordinates that would escape after walking every level, on GPT-2; the
    ablations, without the tier, reject at `bound.PROBE_POINTS` first).  Then the fixed
    refinement levels run on what is left, each level on what the previous one could not
    certify: all five for the ablations (every coordinate the levels alone would certify
    is still certified), from `TIERED_FIRST_LEVEL` on after the adaptive tier.

    Args:
      K, gidx, m, v, mt, vt, pabs, clip: as for `fast_accept` (whole flat arrays).
      idx: host int array, the coordinates to certify.
      bound: ``"shared"`` (the difference form) or ``"separate"`` (the ablation).
      partition: ``"mixed"`` or ``"linear"`` cell edges.
      progress: show a tqdm bar.
      fast: try the closed-form tier first (shared bound, mixed partition only).
      max_level: stop after this refinement level (default: all; -1: none, the closed
        form, the cells tiers and the adaptive tier only, the latter only on what the
        signed cells tier puts within `SIGNED_MARGIN` of the threshold); what is not
        certified by then is -1 (a cheaper, more conservative answer).
      adaptive: run the adaptive tier before the fixed levels (shared bound, mixed
        partition only).
      reject_first: reject at `bound.PROBE_POINTS` before the adaptive tier too, for
        candidates most of which are refused (the rate pass's moves: there the probes
        cost less than the three partitions that each refused row would walk).

    Returns:
      int8 array over `idx`: the refinement level (0..4) that certified it, `FAST_TIER`
      for the closed form, `FAST_CELLS_TIER` for the closed form on the coordinate's own
      cells, `SIGNED_CELLS_TIER` for the signed cells tier (with ``max_level=-1``),
      `ADAPTIVE_TIER` for the adaptive tier, or -1 (escape).
    """
    level_of = np.full(idx.shape[0], -1, np.int8)
    if idx.size == 0:
        return level_of
    K = _bound.as_step_row(K, -1).as_float32(np)
    m, v, mt, vt, pabs, clip = (np.asarray(x, np.float32) for x in (m, v, mt, vt, pabs, clip))
    if fast and bound == "shared" and partition == "mixed":
        ok = fast_accept(K, gidx[idx], m[idx], v[idx], mt[idx], vt[idx], pabs[idx], clip[idx])
        level_of[ok] = FAST_TIER
        rest = np.flatnonzero(~ok)
        level_of[rest] = certify_pc(K, gidx, m, v, mt, vt, pabs, clip, idx[rest], bound, partition, progress,
                                    fast=False, max_level=max_level, adaptive=adaptive, reject_first=reject_first)
        return level_of
    thr = K.threshold[gidx[idx]]
    uniform = {}   # (group, chunk) -> that group's row repeated: most chunks hold one group

    def rows(take):
        g = gidx[take]
        if K.keep.shape[0] > 1 and not (g == g[0]).all():
            return K.take(g)
        key = (int(g[0]), take.size)
        if key not in uniform:   # the same values the gather gives, built once
            uniform[key] = K.take(np.full(take.size, g[0], g.dtype))
        return uniform[key]

    def padded(sel, chunk):
        # gathers on the host: eager jnp indexing costs more than the bound itself.  Few
        # candidates (the closed form took the bulk) run in small pieces (`piece_sizes`):
        # four compiled shapes per kernel, and no 4-16x padding of a handful of coordinates.
        s = 0
        for size in piece_sizes(sel.shape[0], chunk):
            part = sel[s:s + size]
            take = np.concatenate([part, np.full(size - part.size, part[0])]) if part.size < size else part
            yield s, part.size, take, rows(take)
            s += part.size

    def over(sel, chunk, kernel, *extra, probes=False, **static):
        # kernel(k, m, v, mt, vt, pabs, clip, *extra) over coordinates sel, in padded chunks
        # (the probes, batch_lower_pc, take no pabs)
        out = np.empty(sel.shape[0], np.float32)
        for s, cnt, take, kc in padded(sel, chunk):
            args = (m[take], v[take], mt[take], vt[take]) + (() if probes else (pabs[take],))
            out[s:s + cnt] = np.asarray(_programs.call(kernel, kc, *args, clip[take], *extra, **static))[:cnt]
        return out

    from tqdm import tqdm
    bar = tqdm(total=idx.size, desc="certify", unit="coord", unit_scale=True, leave=False,
               disable=not progress)
    tiered = adaptive and bound == "shared" and partition == "mixed"
    if tiered and not reject_first:   # the dense reject below runs PROBE_POINTS too: here they cost 68 ns a row to
        # spare the adaptive tier 0.19% of its rows (GPT-2: 26,169 of 13.8M)
        pending = np.arange(idx.size)
    else:
        pending = np.flatnonzero(~(over(idx, CHUNK[0], _bound.batch_lower_pc, probes=True) > thr))
        bar.update(idx.size - pending.size)
    for gammas in _fastbound.FAST_CELLS_PARTITIONS if tiered else ():   # the closed form on the coordinate's
        # own cells, 8 then 28 a sign: on GPT-2's leftovers 90.9% then 98.7% in all, ~40 ns a row (the 8-cell
        # adaptive partition: 94-97.5% at ~120 ns)
        if pending.size == 0:
            break
        out = over(idx[pending], FAST_CELLS_CHUNK, _fastbound.batch_fast_cells_pc, gammas=gammas)
        ok = (out >= 0) & (out <= thr[pending])   # +inf (not usable) and NaN never certify
        level_of[pending[ok]] = FAST_CELLS_TIER
        bar.update(int(ok.sum()))
        pending = pending[~ok]
    if tiered and pending.size and max_level == -1:   # candidates (the width search's, the rate pass's moves):
        # the same cells, signs kept (no triangle inequality): ~145 ns a row, and it certifies 97.7% of what
        # the three adaptive partitions do (~920 ns a refused row).  Not on the final certificate, where it
        # certified what the partitions certify (120 of 120 encodings identical) and cost a compile.
        out = over(idx[pending], FAST_CELLS_CHUNK, _fastbound.batch_signed_cells_pc)
        ok = (out >= 0) & (out <= thr[pending])
        level_of[pending[ok]] = SIGNED_CELLS_TIER
        bar.update(int(ok.sum()))
        far = np.isfinite(out) & (out > thr[pending] * SIGNED_MARGIN)   # not usable (+inf): on to the partitions
        bar.update(int(far.sum()))
        pending = pending[~(ok | far)]
    for gammas in _bound.ADAPTIVE_PARTITIONS if tiered else ():   # 8, 20, then 28 cells a sign
        if pending.size == 0:
            break
        out = over(idx[pending], ADAPTIVE_CHUNK, _bound.batch_bound_adaptive_pc, gammas=gammas)
        ok = (out >= 0) & (out <= thr[pending])   # NaN and -inf never certify
        level_of[pending[ok]] = ADAPTIVE_TIER
        bar.update(int(ok.sum()))
        pending = pending[~ok]
    if tiered and pending.size and max_level != -1:   # a denser reject: only the few left walk the fixed levels
        hopeless = over(idx[pending], ADAPTIVE_CHUNK, _bound.batch_lower_pc, probes=True,
                        points=_bound.DENSE_PROBE_POINTS) > thr[pending]
        bar.update(int(hopeless.sum()))
        pending = pending[~hopeless]
    for level in range(TIERED_FIRST_LEVEL if tiered else 0,
                       len(_bound.LEVELS) if max_level is None else min(max_level + 1, len(_bound.LEVELS))):
        if pending.size == 0:
            break
        bar.set_postfix(level=level)
        out = over(idx[pending], CHUNK[level], _bound.batch_bound_pc, _level_edges(level, partition), bound=bound)
        ok = (out >= 0) & (out <= thr[pending])   # NaN and -inf never certify
        level_of[pending[ok]] = level
        bar.update(int(ok.sum()) if level < len(_bound.LEVELS) - 1 else pending.size)
        pending = pending[~ok]
    bar.close()
    return level_of
