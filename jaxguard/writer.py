"""The one write path: typed records in, one container out.

Every adapter (optax file, sharded directory, orbax item, jit save hook, torch file,
DCP item, Lightning) turns its state into records and hands them here:

* `MomentJob` (`jaxguard.moments`, the one moment-pair type) -- a float32 moment pair to
  certify and encode, with its parameter and `GuardConfig` (``mu="exact"``: only ``v`` is
  coded, ``m`` is stored exactly elsewhere);
* `container.Raw` -- a leaf stored exactly;
* `container.Moments` -- a pair encoded elsewhere (the jitted save hook) that carries
  the values its program certified (`Encoded.decoded`, whole or sampled).

`container_entries` turns records into container entries in their order (moment jobs batched in
slabs through `guard.encode_many`, always keeping the certified values, so the
container's decoded hash records what was certified and its sample check compares
them with the numpy reader), summing one set of totals (`jaxguard.audit.TOTAL_KEYS`).
`to_bytes` and `to_file` build the container into memory or a file / URL (streaming,
the encoder one slab ahead of the writer in a thread).

Numerical contract
------------------
What a `MomentJob` certifies is `jaxguard.core.guard.encode`'s contract for its
`GuardConfig`; with ``mu="exact"`` it is that of its v-only mode (`encode_v_only`) with
``tau / BF16_TAU_FACTOR`` (an optax ``mu_dtype=bfloat16`` state: optax computes
``b1 * mu`` in bfloat16, ``b1`` rounds to 0.8984375, a relative change < 0.6% of the
``m'`` the bound assumes, which the 2% margin covers).  The writer never changes a code: a file holds exactly the
codes the guard certified, or nothing is written (`ContainerError`).
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import threading
import time
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from jaxguard import audit
from jaxguard.core import codecs as _codecs
from jaxguard.core import guard as _guard
from jaxguard.core.config import GuardConfig
from jaxguard.errors import ConfigError
from jaxguard.format import container
from jaxguard.format.container import Moments, Raw
from jaxguard.format.spec import BLOCK
from jaxguard.moments import MomentJob

__all__ = ["MomentJob", "Raw", "Moments", "container_entries", "to_bytes", "to_file", "prefetched",
           "new_totals", "BF16_TAU_FACTOR", "SLAB", "device_encode_setting"]

BF16_TAU_FACTOR = 1.02
# Coordinates encoded per `guard.encode_many` call: bounds the working memory (~40 bytes
# per coordinate, per encoding thread) independently of the checkpoint's size.
SLAB = 1 << 20
# Slabs encoded at once (one thread each; memory ~40 bytes per coordinate per slab): one
# core is left to the file writer (SHA-256, writes) and the caller's own work (a training
# step beside an async save), at most this many; JAXGUARD_ENCODE_THREADS overrides it.
MAX_ENCODE_THREADS = 8
# Entries the encoder may run ahead of the file writer, in coordinates.  The writer takes a
# large tensor (GPT-2's 38.6M-coordinate embedding) in one go, ~1 s of hashing and writing;
# with one slab of room the encode threads stood idle for most of it (a thread-state
# timeline of a GPT-2 compress).  16 slabs: ~10 bytes a queued coordinate, 160 MB at most;
# GPT-2 compress, 2-core AMD EPYC, 3 alternating runs: 8.70-8.94 s against 8.55-9.34 s with
# 4 slabs and 8.59-9.02 s with 40.
AHEAD = 16 * SLAB
new_totals = audit.new_totals


# Below this many coordinates to certify `container_entries` uses one thread: XLA already spreads the
# proposal over the cores, and a second thread gained 5% at 16.5M coordinates for 1.14x
# the peak memory (2-core AMD EPYC, 5 alternating runs each: 3.03 s / 602 MB with two,
# 3.19 s / 526 MB with one; 2.89 s / 429 MB for the plain torch load+save).  At 124M
# coordinates two threads take 1.25x less time (measured at commit ad7c841).
SECOND_THREAD_FROM = 1 << 25
# A coordinate of a codec whose codes are chosen on the host (logrel-aw, logrel-ans: width
# search and rate pass in numpy beside the jitted certificate) counts this many towards
# `SECOND_THREAD_FROM`: logrel-ans's compress costs ~32x log8-rel's per coordinate
# (measured at commit 456f546), and there a second thread pays from two
# slabs on: at 16.5M coordinates (2-core AMD EPYC, one run each) 113.6 s / 1,287 MiB with
# two against 135.2 s / 945 MiB with one, the same container bytes.
HOST_CHOSEN_WEIGHT = 32


def encode_threads(coordinates: int | None = None) -> int:
    """Returns: slabs `container_entries` certifies at once: ``JAXGUARD_ENCODE_THREADS`` if set, else
    1 for fewer than `SECOND_THREAD_FROM` `coordinates`, else the cores this process may
    run on (``os.sched_getaffinity``), 1 to `MAX_ENCODE_THREADS`
    (measured at commit aa7b5ff: once a large tensor's pieces were tasks of
    their own, a whole-process 124M compress on 2 cores took 29.1 s and 36.2 s with two
    threads against 31.9 s and 46.7 s with one, peak RSS +1-4%).

    Args:
      coordinates: how many coordinates the caller will certify, if known (None: many).

    Raises:
      ConfigError: ``JAXGUARD_ENCODE_THREADS`` is not a positive integer.
    """
    env = os.environ.get("JAXGUARD_ENCODE_THREADS")
    if env is not None:
        if not env.strip().isdigit() or int(env) < 1:
            raise ConfigError(f"JAXGUARD_ENCODE_THREADS={env!r} is not a positive integer; set it to 1, 2, ... "
                              "or unset it (default: one below 2**25 coordinates, else the cores, at most 8)")
        return int(env)
    if coordinates is not None and coordinates < SECOND_THREAD_FROM:
        return 1
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):   # not on Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_ENCODE_THREADS, cores))


def encode_work(records) -> int:
    """Returns: the coordinates `encode_threads` weighs for `records`: each coded
    `MomentJob`'s size, times `HOST_CHOSEN_WEIGHT` where its codec chooses its codes on
    the host.

    Args:
      records: a list or tuple of `MomentJob`, `Raw` and `Moments` (others count 0).
    """
    return sum(r.size * work_weight(r.config.codec) for r in records if isinstance(r, MomentJob))


def work_weight(codec: str) -> int:
    """Returns: what one coordinate of `codec` counts towards `SECOND_THREAD_FROM`
    (`HOST_CHOSEN_WEIGHT` where the codec chooses its codes on the host, else 1).

    Args:
      codec: a codec id.
    """
    entry = _codecs.TABLE.get(codec)
    return HOST_CHOSEN_WEIGHT if entry is not None and entry.choose is not None else 1


def device_encode_setting(device_encode=None):
    """Where coded moment pairs that are `jax.Array`s are encoded (`container_entries`'s ``device_encode``).

    Args:
      device_encode: None: ``JAXGUARD_DEVICE_ENCODE`` if set (``1``/``true``, ``0``/``false``,
        ``auto``), else auto; True, False or ``"auto"`` as given.

    Returns:
      None (auto: on the device when the arrays live on one that is not the CPU, e.g. CUDA
      tensors imported through DLPack), True (on the arrays' device, the CPU included:
      the device route without a GPU) or False (always the host route, `guard.encode_many`).

    Raises:
      ConfigError: another value, here or in ``JAXGUARD_DEVICE_ENCODE``.
    """
    where = "device_encode"
    if device_encode is None:
        device_encode = os.environ.get("JAXGUARD_DEVICE_ENCODE", "auto")
        where = "JAXGUARD_DEVICE_ENCODE"
    if isinstance(device_encode, bool):
        return device_encode
    word = str(device_encode).strip().lower()
    known = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False, "auto": None, "": None}
    if word not in known:
        raise ConfigError(f"{where}={device_encode!r}; use True/1 (encode jax arrays on their device), False/0 "
                          "(encode on the host) or auto (on the device when it is not the CPU)")
    return known[word]


def _device_route(job: MomentJob, setting) -> bool:
    if setting is False or job.mu != "coded":
        return False
    from jaxguard.core import device_encode
    return device_encode.supports(job.m, job.v, job.p, job.config, force=setting is True)


def _entry_info(job: MomentJob) -> dict:
    return {**job.config.to_json(), "mu_mode": job.mu_mode,
            **{k: v() if callable(v) else v for k, v in job.info.items()}}


def _encode_bf16_m_job(m, v, p, config: GuardConfig) -> _guard.Encoded:
    """The encoder of a `MomentJob(mu="exact")` (an optax ``mu_dtype=bfloat16`` pair): only
    `v` is coded, by `jaxguard.core.guard.encode` (``mu="exact"``) at ``tau / BF16_TAU_FACTOR``, beside
    the exact `m` (module docstring).

    Args:
      m: the first moment as float32 (stored exactly beside the codes).
      v, p: the float32 second moment and parameter.
      config: the `GuardConfig` (its tau is divided by `BF16_TAU_FACTOR`); a codec whose
        widths are chosen on the host (logrel-aw/-ans) codes v with log8-rel's codes.

    Returns:
      The `Encoded` v codes, with the certified values kept; ``stats["payload_bytes"]``
      includes 2 bytes per coordinate of the exact bfloat16 m.
    """
    cfg = dataclasses.replace(config, tau=config.tau / BF16_TAU_FACTOR)
    if _codecs.get(cfg.codec).propose is None:
        cfg = dataclasses.replace(cfg, codec="log8-rel")
    enc = _guard.encode(m, v, p, cfg, keep_decoded=True, mu="exact")
    enc.stats["payload_bytes"] += 2 * enc.n
    return enc


def _coordinates(records) -> int | None:
    """The coordinates of `records`' coded `MomentJob`s: the state `container_entries`
    certifies, when `records` is a list or tuple (else None: a stream)."""
    if not isinstance(records, (list, tuple)):
        return None
    return sum(r.size for r in records if isinstance(r, MomentJob))


def _progress_bar(total: int | None):
    """One tqdm bar over the coordinates `container_entries` certifies (stderr; `total`:
    `_coordinates`)."""
    from tqdm import tqdm
    return tqdm(total=total, desc="certify", unit="coord", unit_scale=True, leave=False, mininterval=0.5)


def _slabs(jobs, slab):
    """Consecutive jobs in slabs of at most `slab` coordinates in whole blocks (one
    compiled shape per step of the guard); a larger job is a slab of its own."""
    cap = -(-slab // BLOCK)
    cur, size = [], 0
    for job in jobs:
        nb = -(-job.size // BLOCK)
        if cur and size + nb > cap:
            yield cur
            cur, size = [], 0
        cur.append(job)
        size += nb
    if cur:
        yield cur


# A tensor over this many slabs is certified in slab-sized pieces, each a task of the
# encode threads like a slab, and joined in order (`_encode_piece`): the guard's working
# memory is ~75 bytes a coordinate of what it certifies at once (measured, 4M
# coordinates), 2.9 GB for GPT-2's 38.6M-element embedding in one piece; and the pieces of
# one embedding keep every thread busy, where one thread walked them in turn.
PIECES_OVER = 2


def _piece_starts(job: MomentJob, slab: int) -> tuple:
    """(first coordinates, length) of a large job's whole-block pieces of about `slab` coordinates."""
    step = max(BLOCK, slab - slab % BLOCK)
    return list(range(0, job.size, step)), step


def _host_piece(x, start: int, step: int) -> np.ndarray:
    """``x.reshape(-1)[start:start + step]`` on the host.  numpy and CPU JAX arrays are
    sliced as numpy views: slicing the JAX array runs an eager program per piece (4.3 s of a
    GPT-2 compress went to its embedding's pieces); an array elsewhere is sliced where it
    lives and only the piece copied."""
    from jaxguard.core.device_encode import device_of
    dev = None if isinstance(x, np.ndarray) else device_of(x)
    if isinstance(x, np.ndarray) or (dev is not None and dev.platform == "cpu"):
        return np.asarray(x).reshape(-1)[start:start + step]
    return np.asarray(x.reshape(-1)[start:start + step])


def _encode_piece(job: MomentJob, start: int, step: int, progress: bool = False, release: Callable | None = None,
                  on_device: bool = False, force: bool = False, state_coordinates: int | None = None):
    """One whole-block piece ``[start, start + step)`` of a large `MomentJob`, certified on
    its own (blocks and coordinates are certified independently, so `guard.join_pieces`
    of a job's pieces gives the codes, escapes and certified values of one piece;
    tests/core/test_writer_release.py checks the join).  The piece's inputs go to `release`
    once certified (a memory-mapped checkpoint's pages).  With `on_device` the piece is a
    slice of the device arrays, encoded there.  `state_coordinates`: as `guard.encode_many`
    (the job's own by default)."""
    if state_coordinates is None:
        state_coordinates = job.size
    if on_device:
        from jaxguard.core import device_encode
        m, v, p = (x.reshape(-1)[start:start + step] for x in (job.m, job.v, job.p))
        return device_encode.encode_many([(m, v, p, job.config)], sample_every=container.SAMPLE_EVERY, force=force,
                                         state_coordinates=state_coordinates)[0]
    part = tuple(_host_piece(x, start, step) for x in (job.m, job.v, job.p))
    enc = _guard.encode_many([(*part, job.config)], progress=progress, keep_decoded=True,
                             state_coordinates=state_coordinates)[0]
    if release is not None and job.source is not None:
        release(list(part))
    return enc


def container_entries(records: Iterable, totals: dict | None = None, *, slab: int | None = None, progress: bool = False,
           release: Callable | None = None, release_raws: bool = True, device_encode=None) -> Iterator:
    """Container entries (`Raw`, `Moments`) of `records`, in their order.

    Consecutive coded `MomentJob`s are encoded together in slabs of about `slab`
    coordinates, `encode_threads()` slabs at once (one thread each, handed on in order;
    one thread when `records` is a list or tuple of less than `SECOND_THREAD_FROM`
    coordinates of work, `encode_work`);
    every encoding keeps its certified values.  Each entry's stats are
    added to `totals` as it is produced.

    A coded job whose m, v and p are float32 `jax.Array`s on one device that is not the
    CPU (a CUDA tensor through DLPack, `torch_compat.state.encoder_view`) is encoded
    there (`jaxguard.core.device_encode`): only its codes, block parameters, escapes and
    the certified values of the container's sample blocks cross to the host.  Slabs never
    mix the two routes.

    Args:
      records: an iterable of `MomentJob`, `Raw` and `Moments`.
      totals: the dict to add the guard's stats to (`new_totals()`); None: not kept.
      slab: coordinates per `guard.encode_many` call (default `SLAB`).
      progress: show one progress bar over the coordinates certified (the total known when
        `records` is a list or tuple), not one per slab.
      release: called with a list of the `source`s (or raw arrays) of entries the
        consumer has taken, after it took them.
      release_raws: False: raw arrays are not handed to `release` (a caller whose
        consumer reads them later releases them itself, as `to_file` does).
      device_encode: where jax-array jobs are encoded (`device_encode_setting`: None reads
        ``JAXGUARD_DEVICE_ENCODE``, else auto; True also encodes CPU jax arrays on the
        device route; False: the host route for every job).

    Returns:
      An iterator of container entries.

    Raises:
      ConfigError: a bad `device_encode` (before any entry is produced).
    """
    slab = SLAB if slab is None else slab
    setting = device_encode_setting(device_encode)
    pending: list = []
    kind = {"device": False}
    counted = _coordinates(records)
    bar = _progress_bar(counted) if progress else None
    known = counted is not None
    threads = encode_threads(encode_work(records) if known else None)
    # the guard's ladder is the whole state's (`certify.CELLS_TIERS_ABOVE`), not a slab's
    state = _guard.UNKNOWN_STATE if counted is None else counted

    def add(stats):
        if totals is not None:   # the guard's stats (other keys of `totals` are the caller's)
            for k in audit.TOTAL_KEYS:
                totals[k] = totals.get(k, 0) + stats[k]

    def encode_slab(part, on_device):
        if on_device:
            from jaxguard.core import device_encode as _device
            return _device.encode_many([(j.m, j.v, j.p, j.config) for j in part], sample_every=container.SAMPLE_EVERY,
                                       force=setting is True, state_coordinates=state)
        return _guard.encode_many([(np.asarray(j.m), np.asarray(j.v), np.asarray(j.p), j.config) for j in part],
                                  keep_decoded=True, state_coordinates=state)

    def tasks(parts, on_device):
        # (part, piece start or None, last piece of the part, work): a large job's pieces
        # are tasks of their own, so the threads share one embedding
        for part in parts:
            if len(part) == 1 and part[0].size > PIECES_OVER * slab:
                starts, step = _piece_starts(part[0], slab)
                for s in starts:
                    yield part, s, s == starts[-1], functools.partial(
                        _encode_piece, part[0], s, step, False, release, on_device, setting is True, state)
            else:
                yield part, None, True, functools.partial(encode_slab, part, on_device)

    def flush():
        # XLA runs one program on one core: `workers` tasks (slabs, or pieces of a large
        # job) are encoded at once, each in its own thread, and handed on in order (each
        # task's result does not depend on the others, so the bytes are those of one thread)
        workers = threads
        pieces: list = []
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxguard-slab") as pool:
            inflight: collections.deque = collections.deque()
            try:
                for part, start, last, work in tasks(_slabs(pending, slab), kind["device"]):
                    inflight.append((part, start, last, pool.submit(work)))
                    if len(inflight) < workers + 1:   # one queued: a thread that finishes first starts the next task
                        continue
                    yield from handed(*inflight.popleft(), pieces)
                while inflight:
                    yield from handed(*inflight.popleft(), pieces)
            finally:   # a consumer that stops early waits for no more than the tasks in flight
                for *_, fut in inflight:
                    fut.cancel()
        pending.clear()

    def handed(part, start, last, fut, pieces):
        if start is None:
            encs = fut.result()
        else:   # one piece of part[0]: joined once its last piece is in
            pieces.append((start, fut.result()))
            if not last:
                return
            encs = [_guard.join_pieces(pieces, tuple(np.shape(part[0].m)))]
            pieces.clear()
        for job, enc in zip(part, encs):
            add(enc.stats)
            if bar is not None:
                bar.update(enc.n)
            yield Moments(job.name, enc, _entry_info(job))
        del encs
        if release is not None:
            release([job.source for job in part if job.source is not None])

    try:
        for r in records:
            if isinstance(r, MomentJob) and r.mu == "coded":
                dev = _device_route(r, setting)
                if pending and dev != kind["device"]:
                    yield from flush()
                kind["device"] = dev
                pending.append(r)
                continue
            yield from flush()
            if isinstance(r, MomentJob):
                enc = _encode_bf16_m_job(np.asarray(r.m, np.float32), np.asarray(r.v), np.asarray(r.p), r.config)
                add(enc.stats)
                if bar is not None:
                    bar.update(enc.n)
                yield Moments(r.name, enc, _entry_info(r))
                if release is not None and r.source is not None:
                    release([r.source])
            elif isinstance(r, Moments):   # encoded elsewhere; -1 marks a stat its encoder does not count
                add({k: max(int(r.encoded.stats.get(k, 0)), 0) for k in audit.TOTAL_KEYS})
                yield r
            else:
                yield container.checked_entry(r)
                if release is not None and release_raws:
                    release([r.array])
        yield from flush()
    finally:
        if bar is not None:
            bar.close()


class _Header(dict):
    """Header fields; those left out (or None) are filled from the first moments entry
    that passes (the header is written after the payload)."""

    GUARD_FIELDS = ("op_model", "tau", "clip", "codec", "bound", "partition")

    def watch(self, entries):
        filled = False
        for e in entries:
            if not filled and isinstance(e, Moments):
                for k in self.GUARD_FIELDS:
                    if self.get(k) is None:
                        self[k] = e.info.get(k)
                filled = True
            yield e


def _timed_summary(totals, size, t0, raw_state_bytes=None):
    totals["encode_seconds"] = time.perf_counter() - t0
    return audit.compression_summary(totals, size, raw_state_bytes)


def to_bytes(records: Iterable, meta: dict, *, extra_header: dict | None = None, progress: bool = False,
             raw_state_bytes: int | None = None, device_encode=None) -> tuple[bytes, dict]:
    """Encode `records` and build the container in memory.

    Args:
      records: `MomentJob`, `Raw` and `Moments` records (see `container_entries`).
      meta: the header's ``meta`` (the adapter's tree and framework).
      extra_header: more top-level header fields; the guard fields default to the first
        moments entry's config (`header_fields`).
      progress: show the guard's progress bars.
      raw_state_bytes: the uncompressed state's size, for the summary's ``container_ratio``.
      device_encode: where jax-array moment pairs are encoded (`container_entries`).

    Returns:
      ``(container bytes, summary)``: `jaxguard.audit.compression_summary` of the totals,
      with ``encode_seconds``.

    Raises:
      ContainerError: certified values the reader disagrees with, or a bad entry:
        nothing is returned.
    """
    t0 = time.perf_counter()
    totals = new_totals()
    header = _Header(extra_header or {})
    entries = list(header.watch(container_entries(records, totals, progress=progress, device_encode=device_encode)))
    data = container.build(entries, meta, extra_header=header)
    return data, _timed_summary(totals, len(data), t0, raw_state_bytes)


def to_file(path, records: Iterable, meta: dict, *, extra_header: dict | None = None, progress: bool = False,
            release: Callable | None = None, slab: int | None = None, raw_state_bytes: int | None = None,
            device_encode=None) -> dict:
    """Encode `records` and write the container to `path` atomically, streaming: the
    encoder runs one slab ahead of the writer in a thread and each entry is written as
    soon as it is ready, so memory holds about two slabs, never the container.

    Args:
      path: a local path (its directory must exist) or an fsspec URL.
      records, meta, extra_header, progress, raw_state_bytes, device_encode: as `to_bytes`.
      release: as `container_entries`.
      slab: as `container_entries`.

    Returns:
      The summary (as `to_bytes`); ``container_bytes`` is the file's size.

    Raises:
      ContainerError: as `to_bytes`; the target is then left as it was.
    """
    t0 = time.perf_counter()
    totals = new_totals()
    header = _Header(extra_header or {})
    sources = []
    if release is not None and isinstance(records, (list, tuple)):
        # what the caller's validation read (scalars beside the moments, whose pages map
        # their neighbours; the parameter digests come later, as their entries are produced)
        # is dropped before the stream starts, each page read back from the page cache when
        # its slab is encoded or its raw entry written
        sources = [r.source for r in records if isinstance(r, MomentJob) and r.source is not None]
        release(sources + [r.array for r in records if isinstance(r, Raw)])
    known = isinstance(records, (list, tuple))
    # a list holds its raw arrays anyway: raws queue at no cost, and the encode goes on behind
    # them while they are written (a torch checkpoint's parameters lead its records)
    stream = prefetched(container_entries(records, totals, progress=progress, release=release, slab=slab,
                               release_raws=release is None, device_encode=device_encode), raws_held=known)
    entries = stream if release is None else _release_written_raws(stream, release, sources)
    # one entry per record: a large container's payload is then written in place
    expected = len(records) if known else None
    moments = sum(isinstance(r, (MomentJob, Moments)) for r in records) if known else None
    try:
        size = container.write_stream(path, header.watch(entries), meta, extra_header=header,
                                      expected_entries=expected, expected_moments=moments)
    finally:   # a failed write stops the encode behind it (else it ran on until its queue was full)
        stream.close()
    return _timed_summary(totals, size, t0, raw_state_bytes)


RERELEASE_EVERY = 128


def _release_written_raws(entries: Iterable, release: Callable, sources=()) -> Iterator:
    """`entries`, each raw array handed to `release` once the consumer asks for the entry
    after it (the container writer has then copied it).  Released by the encoder thread,
    which runs ahead, an array of a memory-mapped checkpoint was read back in by the
    write and stayed resident: at 16.5M coordinates the whole model's pages at the end.

    Reading a small raw array (a ``step`` scalar) maps the file's pages around it too (the
    kernel's fault-around: moments already encoded and released); `release` drops only
    whole pages inside an array, so the moment `sources` are released again every
    `RERELEASE_EVERY` raw entries (1,140 step scalars held ~100 MB of them at 16.5M)."""
    k = 0
    for e in entries:
        yield e
        if isinstance(e, Raw):
            release([e.array])
            k += 1
            if sources and k % RERELEASE_EVERY == 0:
                release(sources)


def prefetched(entries: Iterable, ahead: int = AHEAD, *, raws_held: bool = False) -> Iterator:
    """Iterate `entries` produced in a background thread, at most about `ahead` coordinates
    ahead of the consumer, so that encoding (XLA, numpy) and writing (SHA-256, file I/O;
    both release the GIL) overlap.  An exception in the producer is raised in the consumer;
    a consumer that stops early stops the producer.

    Args:
      entries: an iterable of container entries (`Raw`, `Moments`).
      ahead: how many coordinates (moments) or elements (raw arrays) may wait in the queue;
        one entry always may, whatever its size.
      raws_held: raw entries cost nothing against `ahead` (their arrays are held by the
        caller anyway, e.g. a list of records over a memory-mapped checkpoint): the
        producer then queues the raws at once and encodes the moments after them while
        the consumer writes the raws.

    Returns:
      An iterator of the same entries, in order; closing it (or a consumer that stops
      early) stops the producer and closes `entries`, once the entry it is producing is done.

    Raises:
      Whatever iterating `entries` raised, once the entries before it were consumed.
    """
    cond = threading.Condition()
    box = {"queue": collections.deque(), "held": 0, "done": False, "error": None, "stop": False}

    def cost(e):
        if isinstance(e, Moments):
            return int(e.encoded.n)
        return 0 if raws_held else int(np.size(e.array))

    source = iter(entries)

    def produce():
        stopped = False
        try:
            for e in source:
                c = cost(e)
                with cond:
                    while box["queue"] and box["held"] + c > ahead and not box["stop"]:
                        cond.wait()
                    stopped = box["stop"]
                    if stopped:
                        break
                    box["queue"].append((e, c))
                    box["held"] += c
                    cond.notify_all()
            if stopped and hasattr(source, "close"):
                source.close()      # the encode's own threads (`container_entries`' slabs) stop here too
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            with cond:
                box["error"] = exc
        finally:
            with cond:
                box["done"] = True
                cond.notify_all()

    worker = threading.Thread(target=produce, name="jaxguard-encode", daemon=True)
    worker.start()
    try:
        while True:
            with cond:
                while not box["queue"] and not box["done"]:
                    cond.wait()
                if box["queue"]:
                    e, c = box["queue"].popleft()
                    box["held"] -= c
                    cond.notify_all()
                elif box["error"] is not None:
                    raise box["error"]
                else:
                    return
            yield e
    finally:
        with cond:
            box["stop"] = True
            cond.notify_all()
        worker.join()
