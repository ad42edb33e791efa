"""Where one `jaxguard compress` process goes: the CLI run in this process with timers around
its phases (imports, reading the torch file, walking the state, the stream of entries, the
trailer's re-read with the early fsync, each fsync and the rename), and the thread time of the
guard's encode calls, the parameters' digests and the payload's writes summed.  Printed on
stderr; the CLI's own output as usual.  Time it through the box's quiet lock.

    python bench/experiments/compress_phases.py compress CKPT -o OUT --json
    JAXGUARD_ENCODE_THREADS=1 python bench/experiments/compress_phases.py compress CKPT -o OUT --json

Results: bench/experiments/results/compress_phases.md.
"""
from __future__ import annotations

import collections
import importlib
import os
import sys
import threading
import time

T0 = time.perf_counter()
MARKS: list = []
SUMS: collections.Counter = collections.Counter()


def mark(what):
    MARKS.append((what, time.perf_counter() - T0))


def timed(owner, name, label, summed=False):
    """Replace ``owner.name`` by the same function with a timer (a mark at its start and end,
    or its seconds summed over every call and thread)."""
    fn = getattr(owner, name)

    def run(*a, **k):
        t = time.perf_counter()
        if not summed:
            mark(label + " start")
        try:
            return fn(*a, **k)
        finally:
            if summed:
                SUMS[label] += time.perf_counter() - t
            else:
                mark(label + " end")
    setattr(owner, name, run)


def main(argv):
    cli = importlib.import_module("jaxguard.cli.main")
    mark("cli imported")
    from jaxguard import writer
    from jaxguard.core import guard
    from jaxguard.format import container, torchzip
    import torch_compat.state.checkpoint as checkpoint
    mark("modules imported")
    timed(torchzip, "load", "torchzip.load")
    timed(checkpoint, "_checkpoint_records", "records")
    timed(writer, "to_file", "writer.to_file")
    timed(container._InPlace, "finish", "trailer + early fsync")
    timed(guard, "encode_many", "guard.encode_many (thread s)", summed=True)
    timed(writer, "_entry_info", "entry info: parameter SHA-256 (thread s)", summed=True)
    timed(container.PayloadSink, "write", "payload write + hash, main thread (s)", summed=True)
    fsync, replace = os.fsync, os.replace

    def timed_fsync(fd):
        t = time.perf_counter()
        fsync(fd)
        mark(f"fsync took {time.perf_counter() - t:.3f} s ({threading.current_thread().name})")

    def timed_replace(a, b):
        t = time.perf_counter()
        replace(a, b)
        mark(f"rename took {time.perf_counter() - t:.3f} s")
    os.fsync, os.replace = timed_fsync, timed_replace
    rc = cli.main(argv)
    mark("end")
    for what, t in MARKS:
        print(f"{t:8.3f} {what}", file=sys.stderr)
    for what, s in SUMS.items():
        print(f"   sum {s:8.3f} {what}", file=sys.stderr)
    cpu = os.times()
    print(f"cpu user {cpu.user:.2f} s, system {cpu.system:.2f} s", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
