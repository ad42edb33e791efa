"""Does a cells tier (`fastbound.fast_cells_bound`, `fastbound.signed_cells_bound`), skipping
the fixed levels 0-2 after the adaptive tier (`certify.TIERED_FIRST_LEVEL`), or log8-rel's
proposal in stages (`codecs.CoreCodec.propose_stages`), or the cells tier's 8-cell ladder before
its 28 cells (`fastbound.FAST_CELLS_PARTITIONS`), move an escape?

Both tiers sit between the closed form and the adaptive cell bound in `certify.certify_pc`.
Each certifies with its own bound, so it could in principle certify a coordinate that every
later tier refuses, and so change escapes, codes and payload.  This encodes the
reproduction's torch checkpoints (bench/reproduce.py's models and fractions, trained here)
with the tier and with the tier switched off (its kernel answers +inf, so
every row goes on as before), for every guarded codec, and compares escapes, payload
bytes and the SHA-256 of every encoded array.  The signed tier runs on candidates only (the
width search's and the rate pass's, logrel-ans) and ends those it puts above
`certify.SIGNED_MARGIN` times the threshold, so there the codes may differ by design: the
payload columns say by how much.  "Rows the tier certified" counts every call (for the
signed tier: candidates, some more than once).  With ``--tier fixed_levels`` the "with" run
is the shipped one (levels from `certify.TIERED_FIRST_LEVEL` on after the adaptive tier) and
"without" walks levels 0-2 too; its rows column counts what levels 0-2 certified there (final
certificates only: the stats count those).  With ``--tier staged_propose`` "with" runs log8-rel's
proposal as the guard does (three programs) and "without" as one program; rows: 0.  With
``--tier cells_ladder`` "with" runs the cells tier on the 8-cell ladder, then the 28 cells on
what it refused (as shipped), and "without" on the 28 cells alone; rows: what the ladder
certified.  With ``--tier speed_tiers`` "with" runs every group on the full ladder (as a group
of a state above `certify.CELLS_TIERS_ABOVE` is) and "without" on a small group's ladder (no
closed form, no cells tier, the adaptive tier's 28 cells only), whatever its size; rows: what
the speed tiers certified (final certificates).

    python bench/experiments/fast_cells_escapes.py --out bench/experiments/results/fast_cells_escapes.md
    python bench/experiments/fast_cells_escapes.py --tier signed_cells --out bench/experiments/results/signed_cells_escapes.md
    python bench/experiments/fast_cells_escapes.py --tier fixed_levels --out bench/experiments/results/fixed_levels_escapes.md
    python bench/experiments/fast_cells_escapes.py --tier staged_propose --out bench/experiments/results/staged_propose_escapes.md
    python bench/experiments/fast_cells_escapes.py --tier cells_ladder --out bench/experiments/results/cells_ladder_escapes.md
    python bench/experiments/fast_cells_escapes.py --tier speed_tiers --out bench/experiments/results/speed_tiers_escapes.md
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))


def _digest(encs) -> str:
    h = hashlib.sha256()
    for enc in encs:
        for k in sorted(enc.arrays):
            h.update(k.encode() + np.ascontiguousarray(enc.arrays[k]).tobytes())
    return h.hexdigest()


def _refuse_all(k, m, *args, **kwargs):
    """A tier's kernel switched off: +inf (not usable) for every row, which go on as before it."""
    return np.full(np.shape(m), np.inf, np.float32)


@contextlib.contextmanager
def swapped(obj, name, value):
    """``obj.name`` is `value` inside the block and what it was after."""
    real = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, real)


@contextlib.contextmanager
def swapped_all(obj, values):
    """Every ``obj.name`` of `values` is ``values[name]`` inside the block."""
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(swapped(obj, name, value))
        yield


def counting(kernel, counter):
    """`kernel` that also adds to counter[0] the rows it certifies (bound <= the row's threshold)."""
    def run(k, m, *args, **kwargs):
        out = np.asarray(kernel(k, m, *args, **kwargs))
        counter[0] += int(np.count_nonzero((out >= 0) & (out <= np.asarray(k.threshold))))
        return out
    return run


def _counting_partition(kernel, counter, gammas):
    """`kernel` that counts, in counter[0], the rows it certifies on partition `gammas` only."""
    counted = counting(kernel, counter)

    def run(*args, **kwargs):
        return (counted if kwargs.get("gammas") == gammas else kernel)(*args, **kwargs)
    return run


def _encode(items):
    from jaxguard.core import guard
    t0 = time.perf_counter()
    encs = guard.encode_many(items)
    return encs, time.perf_counter() - t0


def _items(ckpt, codec):
    """(m, v, p, GuardConfig) of every Adam state entry of a torch CKPT, as the CLI builds them."""
    import torch_compat.state
    from jaxguard.core.config import GuardSpec
    from jaxguard.writer import MomentJob
    _, records = torch_compat.state.state_records(ckpt["optimizer"], ckpt["model"], spec=GuardSpec(codec=codec))
    return [(np.asarray(r.m), np.asarray(r.v), np.asarray(r.p), r.config) for r in records
            if isinstance(r, MomentJob) and r.mu == "coded"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--cache", default=str(ROOT / "bench" / ".cache"))
    ap.add_argument("--seeds", type=int, default=4, help="the first N of the reproduction's seeds per model")
    ap.add_argument("--codecs", default="log8-rel,log8,block8,logrel-aw,logrel-ans")
    ap.add_argument("--tier", default="fast_cells",
                    choices=("fast_cells", "signed_cells", "fixed_levels", "staged_propose", "cells_ladder", "speed_tiers"),
                    help="the tier switched off: the closed form on the cells, the signed cells tier, (fixed_levels) "
                         "the skip of levels 0-2 after the adaptive tier, (staged_propose) log8-rel's staged proposal, "
                         "(cells_ladder) the cells tier's 8-cell ladder before its 28 cells, or (speed_tiers) every "
                         "tier a small group skips")
    args = ap.parse_args()
    import dataclasses

    import reproduce
    from jaxguard.core import certify, codecs, fastbound, guard

    levels = args.tier == "fixed_levels"
    staged = args.tier == "staged_propose"
    ladder = args.tier == "cells_ladder"
    speed = args.tier == "speed_tiers"
    kernel = "batch_fast_cells_pc" if levels or staged or ladder or speed else f"batch_{args.tier}_pc"
    real = getattr(fastbound, kernel)
    shipped_first = certify.TIERED_FIRST_LEVEL
    rows = []
    cache = pathlib.Path(args.cache)
    for kind, steps in (("transformer", 400), ("cnn", 300)):
        for seed in reproduce.SEEDS[kind][:args.seeds]:
            ckpts, _ = reproduce.checkpoints(kind, seed, steps, cache)
            for frac, ckpt in sorted(ckpts.items()):
                for codec in args.codecs.split(","):
                    items = _items(ckpt, codec)
                    count = [0]
                    if staged:
                        on, off = contextlib.nullcontext(), swapped(codecs, "TABLE", {
                            **codecs.TABLE, "log8-rel": dataclasses.replace(codecs.TABLE["log8-rel"],
                                                                            propose_stages=None)})
                    elif speed:
                        on = swapped_all(guard, {"SPEED_TIERS_ABOVE": -1, "CELLS_TIERS_ABOVE": -1})
                        off = swapped(guard, "SPEED_TIERS_ABOVE", 1 << 62)
                    elif levels:
                        on, off = contextlib.nullcontext(), swapped(certify, "TIERED_FIRST_LEVEL", 0)
                    elif ladder:
                        on = swapped(fastbound, kernel, _counting_partition(real, count,
                                                                            fastbound.FAST_CELLS_PARTITIONS[0]))
                        off = swapped(fastbound, "FAST_CELLS_PARTITIONS", (fastbound.FAST_CELLS_GAMMAS,))
                    else:
                        on = swapped(fastbound, kernel, counting(real, count))
                        off = swapped(fastbound, kernel, _refuse_all)
                    with on:
                        with_tier, t_with = _encode(items)
                    with off:
                        without, t_without = _encode(items)
                    if levels:
                        count[0] = sum(sum(e.stats["certified_by_level"][:shipped_first]) for e in without)
                    if speed:
                        count[0] = sum(e.stats["certified_fast"] + e.stats["certified_fast_cells"] for e in with_tier)
                    esc = [sum(e.stats["escapes"] for e in x) for x in (with_tier, without)]
                    cells = count[0]
                    same = _digest(with_tier) == _digest(without)
                    pay = [sum(e.stats["payload_bytes"] for e in x) for x in (with_tier, without)]
                    rows.append((kind, seed, frac, codec, sum(e.n for e in with_tier), cells, esc[0], esc[1], same,
                                 t_with, t_without, pay[0], pay[1]))
                    print(rows[-1], flush=True)
    title = {"fast_cells": "The closed-form cells tier", "signed_cells": "The signed cells tier",
             "fixed_levels": "Fixed levels 0-2 skipped after the adaptive tier",
             "staged_propose": "log8-rel's proposal in three programs",
             "cells_ladder": "The cells tier's 8-cell ladder before its 28 cells",
             "speed_tiers": "A small group's ladder (no closed form, no cells tier, 28 adaptive cells)"}[args.tier]
    flag = "" if args.tier == "fast_cells" else f" --tier {args.tier}"
    lines = [f"# {title} and the escapes", "",
             f"`python bench/experiments/fast_cells_escapes.py{flag}` (this file's command): every guarded codec on the "
             "reproduction's checkpoints (bench/reproduce.py's models and seeds, 10/50/100% of training), encoded "
             + ("with levels 0-2 skipped after the adaptive tier (as shipped) and walked. " if levels else
                "with log8-rel's proposal in three programs (as shipped) and in one. " if staged else
                "with the cells tier on the 8-cell ladder then the 28 cells (as shipped) and on the 28 cells alone. "
                if ladder else
                "on the full ladder and on a small group's ladder, every group whatever its size. " if speed else
                "with the tier and with it switched off (its kernel answering +inf). ")
             + "`same arrays`: the SHA-256 of every "
             "encoded array (codes, block parameters, escape indices and values) agrees.", "",
             "| model | seed | fraction | codec | coordinates | "
             + ("rows levels 0-2 certified when walked (final certificate)" if levels else
                "rows the speed tiers certified (final certificate)" if speed else
                "rows the tier certified (every call)") + " | escapes with | "
             "escapes without | payload bytes with / without | same arrays | encode s with / without (first uses compile) |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for kind, seed, frac, codec, n, cells, e1, e0, same, t1, t0, p1, p0 in rows:
        lines.append(f"| {kind} | {seed} | {frac} | {codec} | {n:,} | {cells:,} | {e1:,} | {e0:,} | {p1:,} / {p0:,} | "
                     f"{'yes' if same else '**no**'} | {t1:.2f} / {t0:.2f} |")
    lines += ["", f"{sum(r[8] for r in rows)} of {len(rows)} encodings identical."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
