"""Negative result (issue 25, commit 1029719): slabs certified in worker processes, not threads.

    python bench/experiments/encode_workers.py [--size 16] [--workers 2] [--repeats 3]

XLA runs most of the guard's programs on one core, so two processes should certify
twice as fast as one on two cores, where two threads gained 1.25x at 124M coordinates.
This is the prototype that was measured and not kept: `Pool` starts `n` processes
(this file with ``--serve``), each with one shared anonymous mapping (``memfd_create``)
that the main process copies a slab's m, v, p into and the worker writes its results'
arrays (codes, escapes, certified values) back into, so only a few hundred bytes of
pickle cross the pipe a slab.  The runner encodes the bench's trained state (the
ByteTransformer of bench/cert_speed.py, tiled to ``--size`` million coordinates) in
1M-coordinate slabs both ways, alternating, checks that both routes give the same bytes
(SHA-256 over every encoding's arrays), and prints coordinates/s.

Measured at commit 1029719 (2026-12-04) (2-core AMD EPYC, 15,611,904 coordinates, both routes alternating):

* this runner, ``--repeats 3``: threads 26.27 / 26.39 / 28.89, workers 28.67 / 28.90 / 27.65M
  coordinates/s (medians 26.4 and 28.7); ``--repeats 5``: threads 21.3-23.6 (median 22.3),
  workers 22.5-31.1 (median 25.2).  Same bytes both ways.
* the same pool wired into `writer.container_entries` (not kept; one run each way): 15.9-16.8M/s
  against 17.3-19.1M/s for its threads, and one whole GPT-2 `jaxguard compress` 16.1 s
  against 14.5 s (the workers' start, a JAX import each, and the copies through the mapping
  are in that figure).

So 0-13% in the encode alone, within this machine's noise, and a loss in the whole
process: nowhere near the 2x a two-process microbenchmark of commit cba292e suggested.  Each
worker spent 60-90 ms on a 1M slab, as a thread does: the kernels bound the encode
(the compress profile at commit 7563a11).
"""
from __future__ import annotations

import io
import mmap
import os
import pickle
import struct
import subprocess
import sys
import tempfile

import numpy as np

from jaxguard.errors import JaxguardError


# Arrays at least this large travel through the shared mapping, not the pipe.
SHARED_MIN_BYTES = 1 << 14
# Bytes of shared mapping a worker gets per coordinate of its largest task: m, v, p in
# (12) and the results out (codes 2, certified values 8, escapes up to 12 when every
# coordinate escapes); pages that are never touched cost nothing.
BYTES_PER_COORDINATE = 36
_ALIGN = 64
_LEN = struct.Struct("<Q")


class WorkerError(RuntimeError):
    """An encode worker process died or could not start."""


def available() -> bool:
    """Returns: whether worker processes can run here (a POSIX system: they receive their
    pipes and mapping as inherited file descriptors)."""
    return os.name == "posix"


def _shared_file(size: int) -> int:
    """A file descriptor of `size` zero bytes that lives only while it is open."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("jaxguard-encode", 0)
    else:
        fd, name = tempfile.mkstemp(prefix="jaxguard-encode-")
        os.unlink(name)
    os.ftruncate(fd, size)
    return fd


class _Arena:
    """Arrays laid end to end in a shared mapping from `start`; what does not fit goes
    inline (`persistent_id` returns None)."""

    def __init__(self, buf: mmap.mmap, start: int, end: int):
        self.buf, self.at, self.end = buf, start, end

    def persistent_id(self, obj):
        if type(obj) is not np.ndarray or obj.nbytes < SHARED_MIN_BYTES or obj.dtype.hasobject:
            return None
        at = -(-self.at // _ALIGN) * _ALIGN
        if at + obj.nbytes > self.end:
            return None
        np.frombuffer(self.buf, np.uint8, obj.nbytes, at)[:] = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
        self.at = at + obj.nbytes
        return (at, obj.dtype.str, obj.shape)


def _dumps(obj, arena: _Arena) -> bytes:
    out = io.BytesIO()
    p = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    p.persistent_id = arena.persistent_id
    p.dump(obj)
    return out.getvalue()


def _loads(data: bytes, buf: mmap.mmap, copy: bool):
    def load(pid):
        at, dtype, shape = pid
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        view = np.frombuffer(buf, np.uint8, n, at).view(dtype).reshape(shape)
        return np.array(view) if copy else view

    u = pickle.Unpickler(io.BytesIO(data))
    u.persistent_load = load
    return u.load()


def _send(fd: int, data: bytes) -> None:
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _recv(fd: int) -> bytes | None:
    def exactly(n):
        parts, left = [], n
        while left:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                return None
            parts.append(chunk)
            left -= len(chunk)
        return b"".join(parts)

    head = exactly(_LEN.size)
    return None if head is None else exactly(_LEN.unpack(head)[0])


class _Worker:
    def __init__(self, capacity: int, settings: dict):
        self.size = max(1 << 20, BYTES_PER_COORDINATE * capacity)
        self.inputs_end = self.size // 3   # m, v, p: 12 of the 36 bytes a coordinate
        self.fd = _shared_file(self.size)
        self.buf = mmap.mmap(self.fd, self.size)
        to_child, self._to_worker = os.pipe()
        self._from_worker, from_child = os.pipe()
        env = dict(os.environ, JAX_PLATFORMS="cpu")   # the host route: the worker never claims an accelerator
        try:
            self.proc = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--serve", str(to_child), str(from_child), str(self.fd),
                 str(self.size)], pass_fds=(to_child, from_child, self.fd), stdin=subprocess.DEVNULL, env=env)
        except OSError as exc:
            raise WorkerError(f"could not start an encode worker ({exc})") from exc
        finally:
            os.close(to_child)
            os.close(from_child)
        _send(self._to_worker, pickle.dumps(settings))
        self.busy = False

    def submit(self, items) -> None:
        _send(self._to_worker, _dumps(items, _Arena(self.buf, 0, self.inputs_end)))
        self.busy = True

    def result(self):
        data = _recv(self._from_worker)
        self.busy = False
        if data is None:
            code = self.proc.wait()
            raise WorkerError(f"an encode worker exited with status {code} while certifying a slab")
        kind, value = _loads(data, self.buf, copy=True)
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        try:
            _send(self._to_worker, b"")
        except OSError:
            pass
        for fd in (self._to_worker, self._from_worker):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.buf.close()
        os.close(self.fd)


class EncodeWorkers:
    """`n` worker processes that certify slabs.

    Start it before loading a checkpoint: the workers import JAX and load the guard's
    programs while the caller reads its file.  Use it as a context manager (or call
    `close`); the workers exit with it.

    Args:
      n: worker processes (one slab in flight each).
      capacity: the largest task, in coordinates, whose arrays travel through the shared
        mapping (larger ones still work, pickled through the pipe).
      settings: what each worker applies before its first task: ``programs_dir`` (the
        exported-kernels directory, `jaxguard.core.programs.enable`),
        ``compilation_cache_dir`` (jax's persistent cache), ``async_dispatch`` (bool).

    Raises:
      WorkerError: a worker could not start.
    """

    def __init__(self, n: int, capacity: int, settings: dict | None = None):
        if n < 1:
            raise ValueError(f"n={n}: at least one worker")
        self.workers: list = []
        try:
            for _ in range(n):
                self.workers.append(_Worker(capacity, dict(settings or {})))
        except BaseException:
            self.close()
            raise

    def __len__(self) -> int:
        return len(self.workers)

    def submit(self, items):
        """Hand `items` (``[(m, v, p, config)]``, host arrays) to an idle worker.

        Args:
          items: as `guard.encode_many`.

        Returns:
          A handle whose ``result()`` is the list of `Encoded` (certified values kept).

        Raises:
          WorkerError: every worker is busy (collect a result first).
        """
        for w in self.workers:
            if not w.busy:
                w.submit(list(items))
                return w
        raise WorkerError("every encode worker is busy; collect a result before submitting more")

    def close(self) -> None:
        """Stop the workers (each finishes its task first) and free their mappings."""
        while self.workers:
            self.workers.pop().close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _serve(rfd: int, wfd: int, shm_fd: int, size: int) -> None:
    settings = pickle.loads(_recv(rfd) or b"\x80\x04}.")
    import jax
    if not settings.get("async_dispatch", True):
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    if settings.get("compilation_cache_dir"):
        jax.config.update("jax_compilation_cache_dir", settings["compilation_cache_dir"])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    from jaxguard.core import guard, programs
    if settings.get("programs_dir"):
        programs.enable(settings["programs_dir"])
    buf = mmap.mmap(shm_fd, size)
    while True:
        data = _recv(rfd)
        if not data:
            return
        items = _loads(data, buf, copy=False)
        try:
            reply = ("ok", guard.encode_many(items, keep_decoded=True))
        except JaxguardError as exc:   # the caller raises it as it is
            reply = ("error", exc)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, then this worker stops
            reply = ("error", WorkerError(f"an encode worker failed: {type(exc).__name__}: {exc}"))
        del items
        _send(wfd, _dumps(reply, _Arena(buf, size // 3, size)))


def _state(size_m):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import cert_speed
    import torch_compat.state as S
    from jaxguard.core.config import GuardSpec
    base = cert_speed._base()
    per = sum(st["exp_avg"].numel() for st in base["optimizer"]["state"].values())
    ck = cert_speed._tiled(base, max(1, round(size_m * 1e6 / per)))
    _, records = S.state_records(ck["optimizer"], ck["model"], spec=GuardSpec(codec="log8-rel"))
    return records


def _digest(encs, digest):
    import hashlib
    for e in encs:
        for k in sorted(e.arrays):
            digest.update(k.encode() + np.ascontiguousarray(e.arrays[k]).tobytes())
    return digest


def main(argv=None):
    import argparse
    import hashlib
    import time

    import jax
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", type=float, default=16, help="millions of coordinates")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args(argv)
    jax.config.update("jax_cpu_enable_async_dispatch", False)   # as `jaxguard compress`
    from jaxguard import writer
    from jaxguard.core import guard
    records = _state(a.size)
    jobs = [r for r in records if isinstance(r, writer.MomentJob)]
    slabs = [[(np.asarray(j.m), np.asarray(j.v), np.asarray(j.p), j.config) for j in part]
             for part in writer._slabs(jobs, writer.SLAB)]
    n = sum(j.size for j in jobs)

    def threads():
        import concurrent.futures
        digest = hashlib.sha256()
        with concurrent.futures.ThreadPoolExecutor(a.workers) as pool:
            for encs in pool.map(lambda items: guard.encode_many(items, keep_decoded=True), slabs):
                _digest(encs, digest)
        return digest.hexdigest()

    pool = EncodeWorkers(a.workers, capacity=3 * writer.SLAB, settings={"async_dispatch": False})

    def workers():
        import collections
        digest, inflight = hashlib.sha256(), collections.deque()
        for items in slabs:
            if len(inflight) == len(pool):
                _digest(inflight.popleft().result(), digest)
            inflight.append(pool.submit(items))
        while inflight:
            _digest(inflight.popleft().result(), digest)
        return digest.hexdigest()

    try:
        runs = {"threads": [], "workers": []}
        digests = set()
        for route in ("threads", "workers"):   # compiles in every process
            digests.add((route, locals()[route]()))
        for _ in range(a.repeats):
            for route, fn in (("threads", threads), ("workers", workers)):
                t = time.perf_counter()
                digests.add((route, fn()))
                runs[route].append(n / (time.perf_counter() - t) / 1e6)
    finally:
        pool.close()
    same = len({d for _, d in digests}) == 1
    print(f"{n:,} coordinates, {a.workers} threads vs {a.workers} worker processes, same bytes: {same}")
    for route, xs in runs.items():
        print(f"  {route:8s} M coordinates/s: " + ", ".join(f"{x:.2f}" for x in xs) + f" (median {np.median(xs):.2f})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        _serve(*(int(x) for x in sys.argv[2:6]))
    else:
        main()
