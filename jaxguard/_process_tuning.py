"""How the ``jaxguard`` console script tunes its own process (never a library caller's).

Each knob, and the public mechanism behind it where one exists:

* glibc's heap (`reuse_freed_memory`): ``mallopt(M_MMAP_THRESHOLD)`` and
  ``mallopt(M_TRIM_THRESHOLD)`` through ctypes.  ``mallopt(3)`` is glibc's public C API,
  but Python has no binding for it; glibc's own environment settings
  (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``, ``GLIBC_TUNABLES``) are read only
  when the process starts, so a console script cannot set them for itself.  No effect
  off glibc.
* numpy's transparent huge pages (`no_numpy_huge_pages`): the public mechanism is the
  ``NUMPY_MADVISE_HUGEPAGE=0`` environment variable, read only when numpy is imported
  (before the script's first line runs); there is no public switch at run time, so the
  private ``numpy._core.multiarray._set_madvise_hugepage`` is called, and a numpy without
  it keeps its own default.
* jax's dispatch (`synchronous_cpu_dispatch`): public, ``jax.config.update(
  "jax_cpu_enable_async_dispatch", False)``.
* XLA's CPU intra-op pool (`start_cpu_backend_one_thread_pool`): jax has no public
  option for its size; it follows the CPUs the starting thread may run on, which the
  public ``os.sched_setaffinity`` narrows while the backend starts.  Whether a backend has
  started is read from the private ``jax._src.xla_bridge.backends_are_initialized``: jax
  has no public query (``jax.devices()`` and ``jax.extend.backend.backends()`` start one).

Every knob changes time and memory only: the same programs run and give the same results.
This module imports neither numpy nor jax until a knob is turned (restore never imports jax).
"""
from __future__ import annotations

import os

__all__ = ["reuse_freed_memory", "no_numpy_huge_pages", "synchronous_cpu_dispatch",
           "start_cpu_backend_one_thread_pool"]


def reuse_freed_memory() -> None:
    """glibc, for compress and restore: keep freed buffers of up to 32 MiB (a slab's
    guard temporaries, restore's decode chunks of `jaxguard.format.torchzip_writer.CHUNK`
    coordinates) in the heap for the next slab instead of returning them and page-faulting
    fresh ones, and return the heap's free top only beyond 256 MiB (no effect elsewhere).  Compress used
    to mmap every buffer from 1 MiB for a smaller heap: 13.0M page faults and 58 s of
    system time at 124M coordinates (measured at commit da48a3f)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)    # M_MMAP_THRESHOLD (its maximum on 64-bit)
        libc.mallopt(-1, 256 << 20)   # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def no_numpy_huge_pages() -> None:
    """Compress and restore: numpy's large arrays are not marked for transparent huge pages.

    numpy asks the kernel for huge pages on every array of 4 MiB or more (``madvise``), and
    with the kernel's default ``defrag=madvise`` a first touch of such memory compacts
    memory on the spot whenever no free 2 MiB page is at hand, as on a machine whose page
    cache holds the checkpoints just written.  There a fresh 154 MB array took 196-325 ms
    to fill against 70-75 ms without (12.5 ms when free huge pages happen to be ready),
    and a GPT-2-sized restore 3.74-4.41 s against 2.49-2.86 s (system time 2.8-3.6 s
    against 0.8-1.2 s; 2-core AMD EPYC, 4 interleaved pairs).  ``NUMPY_MADVISE_HUGEPAGE``
    does the same, but only when set before numpy is imported."""
    try:
        import numpy as np
        core = getattr(np, "_core", None) or np.core
        core.multiarray._set_madvise_hugepage(False)
    except (AttributeError, ImportError):   # a numpy without the switch: its own default
        pass


def synchronous_cpu_dispatch() -> None:
    """Compress's programs run on the calling thread, not handed to a dispatch thread: the
    guard calls thousands of small kernels and reads each result at once, so the hand-off
    (a cross-core wake-up per call) was pure cost.  GPT-2 compress (124M coordinates,
    alternating runs, 2-core AMD EPYC): encode 17.77/15.43 s against 20.15/19.14 s.
    Same programs, same results.  jax reads the option when its backend starts, so it
    only takes effect in a process whose first program is the verb's (a library
    caller's process is never touched)."""
    try:
        import jax
        jax.config.update("jax_cpu_enable_async_dispatch", False)
    except Exception:  # noqa: BLE001 - an older jax without the option: dispatch as it does
        pass


def start_cpu_backend_one_thread_pool() -> bool:
    """Start jax's CPU backend with an intra-op pool of one thread, so that each thread
    that runs programs (compress's encode threads) runs them on its own core.

    XLA sizes that pool by the CPUs the starting thread may run on and splits large
    fusions over it.  With an encode thread per core the splits only contend: a
    60M-coordinate in-process encode on 2 cores took 1.99-2.19 s and 3.2-3.7 s of CPU with
    that pool, 1.71-1.80 s and 2.8-3.0 s of CPU with one thread in it (one core: 2.5 s;
    bench/experiments/results/encode_cores.md).  The backend starts while this thread may
    run on one CPU, then every thread gets back the CPUs the process had.  Same programs,
    same results.  For a process that is about to run the guard on several threads, before
    anything else starts jax's backend.

    Returns:
      True if the backend started so; False on one CPU, off Linux, or when something had
      started it already (then nothing changed).
    """
    try:
        import jax
        from jax._src import xla_bridge
        if xla_bridge.backends_are_initialized():
            return False
        cpus = os.sched_getaffinity(0)
        if len(cpus) < 2:
            return False
        before = set(os.listdir("/proc/self/task"))
    except (AttributeError, OSError, ImportError):
        return False
    try:
        os.sched_setaffinity(0, {min(cpus)})
        jax.devices()
    except Exception:  # noqa: BLE001 - the backend's own errors surface at its first use
        return False
    finally:
        os.sched_setaffinity(0, cpus)
        for tid in set(os.listdir("/proc/self/task")) - before:   # the pool's threads
            try:
                os.sched_setaffinity(int(tid), cpus)
            except (OSError, ValueError):
                pass
    return True
