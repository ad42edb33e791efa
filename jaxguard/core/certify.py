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

__all__ = ["classify", "block_stats_valid", "v_positive", "device_masks", "device_classify", "certify",
           "FAST_TIER", "ADAPTIVE_TIER", "FAST_CELLS_TIER", "SIGNED_CELLS_TIER", "SIGNED_MARGIN",
           "TIERED_FIRST_LEVEL", "FAST_CHUNK", "FAST_MIN_CHUNK", "fast_accept", "fast_accept_calls", "Stage", "stages", "stage_calls",
           "prepare_stages", "certify_pc"]

import dataclasses
import functools
from typing import Callable, Optional

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
# A group of at most this many coordinates certifies without the speed tiers (the closed
# form, the closed form on its own cells, the adaptive tier's 8- and 20-cell partitions):
# straight to the 28-cell adaptive partition, then the dense reject and the fixed levels.
# Those tiers make a large group fast (certifying most rows for a fraction of the cells);
# on a small one their five programs cost more to compile and load than they save (the first
# save of a fresh process, 4,096 coordinates: cold 5.18 -> 2.23 s, warm 0.53 -> 0.34 s; every
# group forced onto it, 262,144 coordinates warm 0.65 s against 0.44, 1M 1.44 against 0.46, a
# 16.5M compress 18.1 s against 2.2: bench/experiments/results/small_group_ladder.md).
# Refusing is always sound: a tier skipped can only leave a row to the next; forced onto this
# ladder, the 72 reproduction encodings of log8-rel, log8 and block8 kept every code
# (bench/experiments/results/speed_tiers_escapes.md; logrel-ans, which keeps every tier as
# logrel-aw does, moved 1 escape in 24), and the default's compress of 16.5M and 124M
# coordinates every escape and payload byte (small_group_ladder.md).
SPEED_TIERS_ABOVE = 1 << 16
# A state of at most this many coordinates (every moment pair a save certifies, as the writer
# counts them) certifies without the cells tiers and the adaptive tier's 8- and 20-cell
# partitions: the closed form, then the 28-cell partition.  Decided for the whole state, not
# the group: the writer certifies in slabs of ~1M coordinates, and over a large state the
# cells tiers repay their programs many times (GPT-2 small 3 steps in: a compress 6.90 s with
# them, 12.67 s without).  Over a 1M-coordinate torch AdamW state 3 steps in they do not: its
# first save cold 4.65 -> 2.50 s, warm 0.48 -> 0.24 s without them; a 16.5M state 60 steps in
# compresses in 2.05 s without them against 2.20 s (bench/experiments/results/
# small_group_ladder.md).  4M leaves a margin for states the closed form leaves more of.
CELLS_TIERS_ABOVE = 1 << 22
FAST_CHUNK = 1 << 18     # coordinates per call of the closed-form tier
FAST_MIN_CHUNK = 1 << 12  # its smallest call (a handful of candidates, e.g. the rate pass's last moves)


def fast_accept(K, gidx, m, v, mt, vt, pabs, clip, valid=None):
    """The closed-form tier (`jaxguard.core.fastbound`) over whole flat arrays, in chunks of
    one size (`FAST_MIN_CHUNK` below `FAST_CHUNK` coordinates, else `FAST_CHUNK`; the last
    one padded): the shape changes with the candidates' count only across `FAST_CHUNK`.

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
    size = FAST_CHUNK if n >= FAST_CHUNK else FAST_MIN_CHUNK
    for s in range(0, n, size):
        e = min(n, s + size)
        if valid is not None and not valid[s:e].any():
            continue   # padding only
        part = [x[s:e] for x in arrays] + [gidx[s:e]]
        if e - s < size:   # pad with zeros (certifiable, never read back)
            part = [np.concatenate([x, np.zeros(size - (e - s), x.dtype)]) for x in part]
        mm, vv, mmt, vvt, pp, cc, gg = part
        out[s:e] = np.asarray(_programs.call(_fastbound.batch_fast_accept, K, gg, mm, vv, mmt, vvt, pp, cc))[:e - s]
    return out


def fast_accept_calls(K, coordinates=None):
    """The ``(fn, args, static)`` of `fast_accept`'s program at each call size it may use
    (`programs.prepare`).

    Args:
      K: the group's constants, a `bound.StepRow` of [G] arrays.
      coordinates: the most coordinates a call of `fast_accept` will get (None: any).
        Below `FAST_CHUNK` it only ever runs at `FAST_MIN_CHUNK`, and the larger program
        is left out (a 4,096-coordinate state compiled it at its first save, 1-3 s of a
        core, for calls it can never make).
    """
    K = _bound.as_step_row(K, -1).as_float32(jnp)
    calls = []
    big = coordinates is None or coordinates >= FAST_CHUNK
    for size in (FAST_MIN_CHUNK, FAST_CHUNK) if big else (FAST_MIN_CHUNK,):
        z, g = np.zeros(size, np.float32), np.zeros(size, np.int32)
        calls.append((_fastbound.batch_fast_accept, (K, g, z, z, z, z, z, z), {}))
    return calls


@functools.lru_cache(maxsize=None)
def _level_edges(level, partition):
    # host edges, built once: an eager jnp.asarray per slab and level cost 0.2 s of a GPT-2 compress
    e = _bound.unit_edges(level, partition)
    e.setflags(write=False)
    return e


@dataclasses.dataclass(frozen=True)
class Stage:
    """One step of `certify_pc` after the closed form: a kernel over the pending rows, run
    in calls of `rows` rows whatever their count (the last call padded), so a state's
    later saves reuse the programs of its first whatever they leave to each tier.

    Attributes:
      kernel: a jitted bound or probe kernel of `bound` / `fastbound` (per-coordinate rows).
      rows: rows per call.
      static: its static arguments, as sorted ``(name, value)`` pairs.
      tier: the ``level_of`` value of the rows it certifies; None: a reject (rows whose
        lower bound exceeds the threshold leave, the rest go on).
      level: a fixed refinement level (`bound.LEVELS`): its edges are the last argument.
      signed: the signed cells tier: rows far over the threshold leave (`SIGNED_MARGIN`).
    """

    kernel: Callable
    rows: int
    static: tuple = ()
    tier: Optional[int] = None
    level: Optional[int] = None
    signed: bool = False

    @property
    def probes(self) -> bool:
        """A probe kernel (`bound.batch_lower_pc`) takes no ``|p|``."""
        return self.kernel is _bound.batch_lower_pc


# Rows per call of each stage.  A stage's calls hold every pending row whatever their count,
# so the programs a state needs are fixed by its settings alone (none by how many rows reach
# a tier); each size holds a call's padding to about 0.1-0.3 ms of a core (the measured cost
# of a row: the 8-cell ladder 33 ns, the 28 cells 71 ns, the adaptive partitions 167-420 ns,
# the fixed levels tens of microseconds) while a 1M-coordinate slab's rows of each tier fit a
# call or a few (GPT-2: ~5K rows a slab reach the cells tier, hundreds the adaptive one,
# tens the fixed levels).  Every bound gives a row the same bits at each size, and a probe's
# reject at any size is a row no bound certifies (tests/core/test_certify_pieces.py): the sizes
# move work, never a certificate.
PROBE_ROWS = 1 << 12                      # the rate pass's reject (`reject_first`)
CELLS_ROWS = (1 << 13, 1 << 10)           # the 8-cell ladder, then the 28 cells (`FAST_CELLS_PARTITIONS`)
SIGNED_ROWS = 1 << 10
ADAPTIVE_ROWS = 1 << 8
DENSE_REJECT_ROWS = 1 << 8
LEVEL_ROWS = 1 << 6                       # the fixed levels after the adaptive tier
# The ablations (no adaptive tier: the separate bound, the linear partition) walk the probes
# and every fixed level with most of their rows: calls as large as a level's work allows.
ABLATION_ROWS = {"probes": 1 << 16, 0: 1 << 16, 1: 1 << 13, 2: 1 << 12, 3: 1 << 11, 4: 1 << 10}


def stages(bound, partition, adaptive=True, max_level=None, reject_first=False, cells_tiers=True) -> tuple:
    """The stages `certify_pc` runs after the closed form, in order (its docstring).

    Args:
      bound, partition, adaptive, max_level, reject_first, cells_tiers: as `certify_pc`.

    Returns:
      A tuple of `Stage`.
    """
    tiered = adaptive and bound == "shared" and partition == "mixed"
    out = []
    if not tiered or reject_first:
        out.append(Stage(_bound.batch_lower_pc, PROBE_ROWS if tiered else ABLATION_ROWS["probes"],
                         (("points", _bound.PROBE_POINTS),)))
    if tiered:
        if cells_tiers:
            out += [Stage(_fastbound.batch_fast_cells_pc, rows, (("gammas", g),), FAST_CELLS_TIER)
                    for g, rows in zip(_fastbound.FAST_CELLS_PARTITIONS, CELLS_ROWS)]
        if max_level == -1:
            out.append(Stage(_fastbound.batch_signed_cells_pc, SIGNED_ROWS, (), SIGNED_CELLS_TIER, signed=True))
        out += [Stage(_bound.batch_bound_adaptive_pc, ADAPTIVE_ROWS, (("gammas", g),), ADAPTIVE_TIER)
                for g in (_bound.ADAPTIVE_PARTITIONS if cells_tiers else _bound.ADAPTIVE_PARTITIONS[-1:])]
        if max_level != -1:   # a denser reject: only the few left walk the fixed levels
            out.append(Stage(_bound.batch_lower_pc, DENSE_REJECT_ROWS, (("points", _bound.DENSE_PROBE_POINTS),)))
    last = len(_bound.LEVELS) if max_level is None else min(max_level + 1, len(_bound.LEVELS))
    out += [Stage(_bound.batch_bound_pc, LEVEL_ROWS if tiered else ABLATION_ROWS[level], (("bound", bound),), level,
                  level) for level in range(TIERED_FIRST_LEVEL if tiered else 0, last)]
    return tuple(out)


def _stage_args(stage, partition, kc, m, v, mt, vt, pabs, clip):
    head = (kc, m, v, mt, vt) + (() if stage.probes else (pabs,)) + (clip,)
    return head + (() if stage.level is None else (_level_edges(stage.level, partition),))


def stage_calls(K, gidx, m, v, mt, vt, pabs, clip, bound, partition, **settings) -> list:
    """One call of each of `stages`'s kernels at its size (row 0 repeated), for
    `programs.prepare`: the programs `certify_pc` may run on this group, whichever tiers
    its rows reach.

    Args:
      K, gidx, m, v, mt, vt, pabs, clip, bound, partition: as `certify_pc` (at least one row).
      **settings: `stages`'s other arguments (adaptive, max_level, reject_first, cells_tiers).

    Returns:
      A list of ``(kernel, args, static)``.
    """
    K = _bound.as_step_row(K, -1).as_float32(np)
    out = []
    for st in stages(bound, partition, **settings):
        take = np.zeros(st.rows, np.int64)
        kc = K.take(np.asarray(gidx)[take])
        arrays = (np.asarray(x, np.float32)[take] for x in (m, v, mt, vt, pabs, clip))
        out.append((st.kernel, _stage_args(st, partition, kc, *arrays), dict(st.static)))
    return out


def prepare_stages(K, gidx, m, v, mt, vt, pabs, clip, bound, partition, *, wait=True, **settings):
    """Make `stages`'s programs ready (`programs.prepare` of `stage_calls`), once a process
    for each setting: a later save never compiles because its rows reached another tier.

    Args:
      K, gidx, m, v, mt, vt, pabs, clip, bound, partition: as `certify_pc` (values unused
        but for the stored programs' round-trip check; no rows: nothing to do).
      wait: False: compile on other threads while the caller goes on (`programs.prepare`).
      **settings: `stages`'s other arguments (adaptive, max_level, reject_first, cells_tiers).

    Returns:
      A `programs.Prepared` (wait on it before the work that asked for it ends).
    """
    if not np.shape(m)[0]:
        return _programs.Prepared()
    return _programs.prepare(lambda: stage_calls(K, gidx, m, v, mt, vt, pabs, clip, bound, partition, **settings),
                             key=("certify", partition, stages(bound, partition, **settings)), wait=wait)


def certify_pc(K, gidx, m, v, mt, vt, pabs, clip, idx, bound, partition, progress=False, fast=True,
               max_level=None, adaptive=True, reject_first=False, cells_tiers=True):
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
    is still certified), from `TIERED_FIRST_LEVEL` on after the adaptive tier.  The steps
    after the closed form are `stages`; their programs are prepared (`programs.prepare`)
    on the first call, whether or not rows reach them.

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
      cells_tiers: False: no cells tiers and only the adaptive tier's finest partition
        (`CELLS_TIERS_ABOVE`, `SPEED_TIERS_ABOVE`: fewer programs).

    Returns:
      int8 array over `idx`: the refinement level (0..4) that certified it, `FAST_TIER`
      for the closed form, `FAST_CELLS_TIER` for the closed form on the coordinate's own
      cells, `SIGNED_CELLS_TIER` for the signed cells tier (with ``max_level=-1``),
      `ADAPTIVE_TIER` for the adaptive tier, or -1 (escape).
    """
    level_of = np.full(idx.shape[0], -1, np.int8)
    settings = dict(adaptive=adaptive, max_level=max_level, reject_first=reject_first, cells_tiers=cells_tiers)
    prepare_stages(K, gidx, m, v, mt, vt, pabs, clip, bound, partition, **settings)
    if idx.size == 0:
        return level_of
    K = _bound.as_step_row(K, -1).as_float32(np)
    m, v, mt, vt, pabs, clip = (np.asarray(x, np.float32) for x in (m, v, mt, vt, pabs, clip))
    if fast and bound == "shared" and partition == "mixed":
        ok = fast_accept(K, gidx[idx], m[idx], v[idx], mt[idx], vt[idx], pabs[idx], clip[idx])
        level_of[ok] = FAST_TIER
        rest = np.flatnonzero(~ok)
        level_of[rest] = certify_pc(K, gidx, m, v, mt, vt, pabs, clip, idx[rest], bound, partition, progress,
                                    fast=False, **settings)
        return level_of
    thr = K.threshold[gidx[idx]]
    uniform = {}   # (group, rows) -> that group's row repeated: most calls hold one group

    def rows(take):
        g = gidx[take]
        if K.keep.shape[0] > 1 and not (g == g[0]).all():
            return K.take(g)
        key = (int(g[0]), take.size)
        if key not in uniform:   # the same values the gather gives, built once
            uniform[key] = K.take(np.full(take.size, g[0], g.dtype))
        return uniform[key]

    def over(sel, stage):
        # the stage's kernel over coordinates sel, in calls of stage.rows (gathers on the
        # host: eager jnp indexing costs more than the bound itself)
        out = np.empty(sel.shape[0], np.float32)
        for s in range(0, sel.shape[0], stage.rows):
            part = sel[s:s + stage.rows]
            take = np.concatenate([part, np.full(stage.rows - part.size, part[0])]) if part.size < stage.rows else part
            args = _stage_args(stage, partition, rows(take), m[take], v[take], mt[take], vt[take], pabs[take],
                               clip[take])
            out[s:s + part.size] = np.asarray(_programs.call(stage.kernel, *args, **dict(stage.static)))[:part.size]
        return out

    from tqdm import tqdm
    bar = tqdm(total=idx.size, desc="certify", unit="coord", unit_scale=True, leave=False,
               disable=not progress)
    pending = np.arange(idx.size)
    for stage in stages(bound, partition, **settings):
        if pending.size == 0:
            break
        if stage.level is not None:
            bar.set_postfix(level=stage.level)
        out = over(idx[pending], stage)
        if stage.tier is None:   # a reject
            leave = out > thr[pending]
        else:
            ok = (out >= 0) & (out <= thr[pending])   # NaN, -inf and +inf (not usable) never certify
            level_of[pending[ok]] = stage.tier
            leave = ok | (np.isfinite(out) & (out > thr[pending] * SIGNED_MARGIN)) if stage.signed else ok
            # signed: far over the threshold (not usable, +inf: on to the partitions)
        bar.update(int(leave.sum()))
        pending = pending[~leave]
    bar.update(pending.size)
    bar.close()
    return level_of
