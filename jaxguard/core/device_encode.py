"""Guarded encoding where the moments live: jax Arrays on their device, not host buffers.

`guard.encode_many` stages every tensor in host numpy buffers, so a moment pair that
lives on a GPU (a torch CUDA tensor imported through DLPack, `torch_compat.state.
encoder_view`) would cross to the host whole.  `encode_many(items)` encodes such pairs
with the fixed-shape guard of `jit_encode.encode_traced` on the arrays' own device: the
tensors of a group (one device, one `GuardSpec`, one step's constants) are laid side by
side in a device buffer (each padded to whole 256-blocks, so blocks never straddle
tensors), guarded in one jitted program, and only the codes, block parameters, escapes,
per-block counts and the certified values at the container's sample positions come back,
by explicit ``jax.device_get``.  Nothing reads the moments on the host.

Capacity: the closed-form tier certifies elementwise; each level of the cell bound then
gathers at most its own capacity of what is left (`jit_encode.level_sizes`), and a
candidate left over would escape, which is always safe.  The program reports how many
were pending at each level and how many escaped: a level that could not take all of its
candidates, or escape buffers too small, make the group run once more with capacities
that fit (`_retry_capacities`: the counts are exact up to the first level that ran short,
so one more run always suffices).  A separate integer-only program then checks that every
nonzero moment below ``2**-80`` escaped (`jit_encode`'s contract); if one did not, the
group is encoded on the host instead (`guard.encode_many`).

Numerical contract
------------------
As `jaxguard.core.jit_encode.encode_jit`: every coordinate is restored either bit for bit
(escapes, exact codes; NaN, Inf, subnormals and moments below ``2**-80`` always) or with
a first native update (the op model of its `GuardConfig`) within ``tau * lr`` of the
original's for every ``|g| <= clip``.  The codes and escapes may differ from the host
route's (`guard.encode_many`: another certification schedule); the container writer
checks a sample of the certified values against the numpy reader either way.
"""
from __future__ import annotations

__all__ = ["device_of", "supports", "encode_many"]

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard.core import bound as _bound
from jaxguard.core import codecs as _codecs
from jaxguard.core import codes
from jaxguard.core import floatbits as _fbits
from jaxguard.core import jit_encode
from jaxguard.core.encoded import Encoded, payload_bytes
from jaxguard.errors import ConfigError

# the first run's capacities: escapes are rare after the first steps and the closed-form
# tier certifies nearly every candidate (at step 5 of a torch MLP it left 11 of 131,072),
# so the cell levels start small; a run that needed more is run again (`_retry_capacities`)
ESCAPE_FRACTION = 64                     # escape slots: 1/64 of the group
LEVEL0_FRACTION = 16                     # level 0: 1/16 of the group
LATER_CAPACITIES = (1024, 256, 256, 256)  # levels 1-4 (1,335 cells a candidate at level 4)
MIN_CAPACITY = 1024
# groups of up to this many blocks are padded to a power of two (few compiled shapes),
# larger ones to a multiple of it
BUCKET_BLOCKS = 4096


def device_of(x):
    """The one device a concrete `jax.Array` lives on, or None.

    Args:
      x: anything.

    Returns:
      A `jax.Device`, or None for a non-array, a tracer or an array over several devices.
    """
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return None
    try:
        devs = x.devices()
    except Exception:   # noqa: BLE001 - a deleted or abstract array: not ours to encode
        return None
    return next(iter(devs)) if len(devs) == 1 else None


def supports(m, v, p, config, *, force: bool = False) -> bool:
    """Whether the moment pair `(m, v)` of `p` is encoded on its device.

    True when all three are float32 `jax.Array`s of one shape on one device that is not
    the CPU (with `force`, the CPU too), and the config's codec proposes on the device
    (fixed-width codecs; not logrel-aw/-ans) without the joint search.

    Args:
      m, v, p: the moments and parameter as the writer holds them.
      config: their `GuardConfig`.
      force: also take arrays on the CPU (the tests' way to run this route without a GPU).

    Returns:
      A bool.
    """
    dev = device_of(m)
    if dev is None or device_of(v) != dev or device_of(p) != dev:
        return False
    if dev.platform == "cpu" and not force:
        return False
    if any(x.dtype != jnp.float32 or tuple(x.shape) != tuple(m.shape) for x in (v, p)) or m.dtype != jnp.float32:
        return False
    spec = config.spec
    return _codecs.get(spec.decode_codec).propose is not None and not spec.joint


def _bucket_blocks(nb: int) -> int:
    if nb <= BUCKET_BLOCKS:
        return 1 << max(0, (nb - 1).bit_length())
    return -(-nb // BUCKET_BLOCKS) * BUCKET_BLOCKS


def _bucket(n: int) -> int:
    return 1 << max(0, (max(n, 1) - 1).bit_length())


@functools.partial(jax.jit, static_argnums=1)
def _zeros_beside(x, n):
    """float32 zeros[n] made on `x`'s device (``jnp.zeros(device=)`` transfers its fill value)."""
    del x
    return jnp.zeros((n,), jnp.float32)


@functools.partial(jax.jit, donate_argnums=0)
def _place(buf, x, off):
    return jax.lax.dynamic_update_slice(buf, jnp.ravel(x), (off,))


_encode = jax.jit(functools.partial(jit_encode.encode_traced, counts=True, fast=True), static_argnums=(4, 5, 6))


@jax.jit
def _missed_tiny(m, v, escape_index):
    """Coordinates with a nonzero moment below 2**-80 that did not escape (integer bit
    tests only, a program of its own: `jit_encode`'s host re-check, on the device)."""
    z = _fbits.opaque_zero()
    tiny = _fbits.device.tiny(m, z) | _fbits.device.tiny(v, z)
    escaped = jnp.zeros(m.shape, bool).at[escape_index].set(True, mode="drop")
    return jnp.sum(tiny & ~escaped, dtype=jnp.int32)


def _sample(offs, every):
    pos = [o + jit_encode.sample_positions(n, every) for o, n in offs]
    flat = np.concatenate(pos).astype(np.int32) if pos else np.zeros(0, np.int32)
    padded = np.zeros(_bucket(flat.size), np.int32)   # a few compiled lengths; the tail is position 0, unread
    padded[:flat.size] = flat
    return pos, padded


def _first_capacities(npad):
    """(per-level capacities, escape slots) of a group's first run."""
    first = min(npad, max(MIN_CAPACITY, npad // LEVEL0_FRACTION))
    later = tuple(min(npad, c) for c in LATER_CAPACITIES)
    return (first,) + later, min(npad, max(MIN_CAPACITY, npad // ESCAPE_FRACTION))


def _retry_capacities(caps, E, npad, pending, count):
    """None if the run with `caps`, `E` left no candidate unexamined and no escape out of
    its buffers, else the capacities of a run that does.

    Up to the first level that could not gather its candidates the run is what a run
    with unlimited capacity does, so that level's pending count is exact, and no later
    level (candidates only leave) nor the escapes (more capacity only certifies more)
    need more than it and the run's escape count: one more run suffices."""
    sizes = jit_encode.level_sizes(caps)
    short = [lv for lv, (c, s) in enumerate(zip(pending, sizes)) if int(c) > s]
    if int(count) <= E and not short:
        return None
    new = list(caps)
    if short:
        need = _bucket(int(pending[short[0]]))
        for lv in range(short[0], len(new)):
            new[lv] = min(npad, max(new[lv], need))
    return tuple(new), min(npad, max(E, _bucket(int(count))))


def _run_group(items, every):
    """One group (one device, spec and constants row) -> list of `Encoded`, or None when
    the host must encode it (a tiny moment the device did not escape)."""
    t0 = time.perf_counter()
    m0, _, _, cfg = items[0]
    dev = device_of(m0)
    spec = cfg.spec
    ns = [int(np.prod(m.shape, dtype=np.int64)) for m, *_ in items]
    nbs = [codes.num_blocks(n) for n in ns]
    starts = np.concatenate([[0], np.cumsum(nbs)]).astype(np.int64)
    npad = _bucket_blocks(max(int(starts[-1]), 1)) * codes.BLOCK
    offs = [(int(s) * codes.BLOCK, n) for s, n in zip(starts[:-1], ns)]
    cols = []
    for j in range(3):
        buf = _zeros_beside(items[0][j], npad)
        for (o, _), item in zip(offs, items):
            if item[j].size:
                buf = _place(buf, item[j], jax.device_put(np.int32(o), dev))
        cols.append(buf)
    k = jax.device_put(cfg.step_row().as_float32(np), dev)
    pos, sample = _sample(offs, every)
    sample_dev = jax.device_put(sample, dev)
    caps, E = _first_capacities(npad)
    je = _encode(*cols, k, spec, caps, E, sample_dev)
    retry = _retry_capacities(caps, E, npad, *jax.device_get((je.arrays["pending_counts"],
                                                              je.arrays["escape_count"])))
    if retry is not None:
        caps, E = retry
        je = _encode(*cols, k, spec, caps, E, sample_dev)
    if int(jax.device_get(_missed_tiny(cols[0], cols[1], je.arrays["escape_index"]))):
        return None
    keep = ("m_codes", "v_codes", "m_params", "v_params", "escape_index", "escape_m", "escape_v", "escape_count",
            "overflow", "block_exact", "block_uncertifiable", "sample_m", "sample_v")
    a = jax.device_get({key: je.arrays[key] for key in keep})
    if int(a["overflow"]):   # `_retry_capacities` sized the buffers from the first run's count
        raise ConfigError(f"{int(a['escape_count'])} escapes overflowed {a['escape_index'].size} slots on the "
                          "device; encode this state on the host (device_encode=False) and report it")
    count = int(a["escape_count"])
    eidx = a["escape_index"][:count].astype(np.int64)
    em, ev = a["escape_m"][:count].astype(np.float32), a["escape_v"][:count].astype(np.float32)
    elapsed, total = time.perf_counter() - t0, max(sum(ns), 1)
    out, s0 = [], 0
    for (o, n), nb, b0, p_ in zip(offs, nbs, starts[:-1], pos):
        lo, hi = np.searchsorted(eidx, [o, o + n])
        arrays = {"m_codes": a["m_codes"][o:o + n].copy(), "v_codes": a["v_codes"][o:o + n].copy(),
                  "m_params": a["m_params"][b0:b0 + nb].astype(np.float32),
                  "v_params": a["v_params"][b0:b0 + nb].astype(np.float32),
                  "escape_index": (eidx[lo:hi] - o).astype(np.int32), "escape_m": em[lo:hi], "escape_v": ev[lo:hi]}
        shape = tuple(items[len(out)][0].shape)
        enc = Encoded(arrays, spec.codec, shape)
        s1 = s0 + p_.size
        enc.decoded = {"positions": p_ - o, "m": a["sample_m"][s0:s1], "v": a["sample_v"][s0:s1]}
        s0 = s1
        pad = nb * codes.BLOCK - n    # the zeros after the tensor in its last block count as exact
        enc.stats = {"coordinates": n, "escapes": int(hi - lo),
                     "exact": int(a["block_exact"][b0:b0 + nb].sum()) - pad,
                     "uncertifiable": int(a["block_uncertifiable"][b0:b0 + nb].sum()),
                     "certified_by_level": [], "payload_bytes": payload_bytes(enc), "raw_fp32_bytes": 8 * n,
                     "encode_seconds": elapsed * n / total, "route": "device"}
        out.append(enc)
    return out


def encode_many(items, *, sample_every: int, force: bool = False, state_coordinates: int | None = None) -> list:
    """Guarded encodings of `[(m, v, p, config), ...]` on the arrays' devices.

    Items are grouped by device, `GuardSpec` and step constants (``config.step_row()``);
    each group is one jitted guard call (module docstring).  An item `supports` refuses,
    or a group the device check sends back, is encoded by `guard.encode_many`.

    Args:
      items: ``(m, v, p, config)`` tuples (`supports` says which run here).
      sample_every: the container's sample stride in blocks
        (`jaxguard.format.container.SAMPLE_EVERY`): the certified values at those blocks
        come back as each `Encoded.decoded` (a dict of ``positions``, ``m``, ``v``).
      force: as `supports` (encode CPU arrays here too).
      state_coordinates: as `guard.encode_many`, for the items it encodes.

    Returns:
      A list of `Encoded`, one per item, in order.
    """
    from jaxguard.core import guard as _guard
    items = list(items)
    out: list = [None] * len(items)
    groups: dict = {}
    host = []
    for i, (m, v, p, cfg) in enumerate(items):
        if not supports(m, v, p, cfg, force=force):
            host.append(i)
            continue
        row = tuple(np.float32(x).tobytes() for x in cfg.step_row().as_float32(np))
        groups.setdefault((device_of(m), cfg.spec, row), []).append(i)
    for idxs in groups.values():
        encs = _run_group([items[i] for i in idxs], sample_every)
        if encs is None:
            host += idxs
            continue
        for i, e in zip(idxs, encs):
            out[i] = e
    if host:
        host.sort()
        hosted = [tuple(np.asarray(x) for x in items[i][:3]) + (items[i][3],) for i in host]
        for i, e in zip(host, _guard.encode_many(hosted, keep_decoded=True, state_coordinates=state_coordinates)):
            out[i] = e
    return out
