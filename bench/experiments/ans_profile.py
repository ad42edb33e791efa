"""Where a logrel-ans encode spends its time: cProfile of `writer.to_bytes` (guard + container
writer) of one fixed torch checkpoint, grouped by stage.

    python bench/experiments/ans_profile.py CKPT.pt [--codec logrel-ans] [--top 25] [--save OUT.jg] [--move-max-level N|none]
                                [--search-max-level N|none]

CKPT.pt: a dict with ``model`` and ``optimizer`` (torch_compat.models.train's checkpoint).
One warm-up encode first (XLA compilations), then one profiled encode.  Prints each stage's
cumulative seconds and share of the profiled encode, then the top functions by own time.
The guard runs on encode threads (`jaxguard.writer`), which cProfile does not see: the
stages are timed by wrapping their functions (seconds summed over calls, nested stages
overlap), and the encode runs on one thread (``JAXGUARD_ENCODE_THREADS=1`` unless set) so
the stages add up to its wall time; the cProfile list covers the calling thread only.
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import importlib
import os
import pstats
import threading
import time

import torch

# (label, module, function names): each function is wrapped where its callers look it up
STAGES = (("rate pass (rate.optimize)", "jaxguard.core.rate", ("optimize",)),
          ("  its move certificates (rate._certified)", "jaxguard.core.rate", ("_certified",)),
          ("width search (adaptive.choose_and_certify)", "jaxguard.core.adaptive", ("choose_and_certify",)),
          ("certificates (guard certify_pc, all calls)", "jaxguard.core.guard", ("certify_pc",)),
          ("rANS encode (rans.encode_streams / _many, fit included)", "jaxguard.format.rans",
           ("encode_streams", "encode_streams_many")),
          ("rANS model fit (rans.fit_models)", "jaxguard.format.rans", ("fit_models",)),
          ("entry sections (packed.entry_sections / _many)", "jaxguard.format.packed",
           ("entry_sections", "entry_sections_many")),
          ("container write (container._write)", "jaxguard.format.container", ("_write",)),
          ("reader check (container.decoded_moments)", "jaxguard.format.container", ("decoded_moments",)),
          ("guard (guard._encode_group)", "jaxguard.core.guard", ("_encode_group",)))


def timed_stages():
    """Wrap every stage's functions; returns {label: seconds} filled as they run (any thread;
    a function that calls itself, or another of its stage, is counted once, outermost)."""
    seconds, local = collections.Counter(), threading.local()
    for label, modname, names in STAGES:
        mod = importlib.import_module(modname)
        for name in names:
            fn = getattr(mod, name, None)
            if fn is None:
                continue

            def wrapper(*a, _fn=fn, _label=label, **k):
                depth = getattr(local, _label, 0)
                setattr(local, _label, depth + 1)
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    setattr(local, _label, depth)
                    if depth == 0:
                        seconds[_label] += time.perf_counter() - t0
            setattr(mod, name, functools.wraps(fn)(wrapper))
    return seconds


def records(path, codec):
    from torch_compat.state import state_records
    ck = torch.load(path, weights_only=False)
    params = dict(ck["model"])
    from jaxguard import GuardSpec
    _, recs = state_records(ck["optimizer"], params, spec=GuardSpec(codec=codec))
    return recs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--codec", default="logrel-ans")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--save", help="write the profiled encode's container here")
    ap.add_argument("--move-max-level", default="default",
                    help="jaxguard.core.rate.MOVE_MAX_LEVEL for this run (an int, or none: every level)")
    ap.add_argument("--search-max-level", default="default", help="jaxguard.core.rate.SEARCH_MAX_LEVEL")
    args = ap.parse_args()
    os.environ.setdefault("JAXGUARD_ENCODE_THREADS", "1")
    from jaxguard import writer
    from jaxguard.core import rate
    if args.move_max_level != "default":
        rate.MOVE_MAX_LEVEL = None if args.move_max_level.lower() == "none" else int(args.move_max_level)
    if args.search_max_level != "default":
        rate.SEARCH_MAX_LEVEL = None if args.search_max_level.lower() == "none" else int(args.search_max_level)
    print(f"rate.SEARCH_MAX_LEVEL = {getattr(rate, 'SEARCH_MAX_LEVEL', 'n/a')}")
    print(f"rate.MOVE_MAX_LEVEL = {getattr(rate, 'MOVE_MAX_LEVEL', 'n/a')}")
    t0 = time.perf_counter()
    data, _ = writer.to_bytes(records(args.ckpt, args.codec), {})
    print(f"warm-up encode {time.perf_counter() - t0:.2f} s, {len(data)} bytes")
    seconds = timed_stages()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    data, summary = writer.to_bytes(records(args.ckpt, args.codec), {})
    prof.disable()
    total = time.perf_counter() - t0
    pay, raw = summary.get("payload_bytes", 0), summary.get("raw_fp32_bytes", 1)
    print(f"profiled encode {total:.2f} s, container {len(data)} bytes, payload {pay} ({100 * pay / max(raw, 1):.2f}% of FP32)")
    if args.save:
        with open(args.save, "wb") as fh:
            fh.write(data)
    print(f"encode threads: {os.environ['JAXGUARD_ENCODE_THREADS']}")
    for label, _, _ in STAGES:
        print(f"  {label:55s} {seconds[label]:8.2f} s  {100 * seconds[label] / total:5.1f}%")
    pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
