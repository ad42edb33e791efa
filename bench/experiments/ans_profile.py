"""Where a logrel-ans encode spends its time: cProfile of `writer.to_bytes` (guard + container
writer) of one fixed torch checkpoint, grouped by stage.

    python bench/experiments/ans_profile.py CKPT.pt [--codec logrel-ans] [--top 25] [--save OUT.jg] [--move-max-level N|none]
                                [--search-max-level N|none]

CKPT.pt: a dict with ``model`` and ``optimizer`` (torch_compat.models.train's checkpoint).
One warm-up encode first (XLA compilations), then one profiled encode.  Prints each stage's
cumulative seconds and share of the profiled encode, then the top functions by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch

STAGES = (("rate pass (rate.optimize)", "rate.py", "optimize"),
          ("width search (adaptive.choose_and_certify)", "adaptive.py", "choose_and_certify"),
          ("final certificate (guard certify_pc, all calls)", "certify.py", "certify_pc"),
          ("rANS encode (rans.encode / encode_many, fit included)", "rans.py", ("encode", "encode_many")),
          ("rANS model fit (rans.fit_models)", "rans.py", "fit_models"),
          ("entry sections (packed.entry_sections / _many)", "packed.py", ("entry_sections", "entry_sections_many")),
          ("container write (container._write)", "container.py", "_write"),
          ("reader check (container._decoded_moments)", "container.py", "_decoded_moments"),
          ("guard (guard._encode_group)", "guard.py", "_encode_group"))


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
    st = pstats.Stats(prof)
    for label, fname, func in STAGES:
        funcs = (func,) if isinstance(func, str) else func
        # the outermost of the named functions only (encode calls encode_many)
        cum = max((sum(v[3] for k, v in st.stats.items() if k[0].endswith(fname) and k[2] == f) for f in funcs),
                  default=0.0)
        print(f"  {label:55s} {cum:8.2f} s  {100 * cum / total:5.1f}%")
    st.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
