"""Do XLA compile options that leave floating point alone make a cold first save cheaper?

    XDG_CACHE_HOME=$(mktemp -d) python bench/experiments/compile_options.py [--out bench/experiments/results/compile_options]

Issue 58's cold first save is CPU-bound, about half of it XLA compiling the guard's programs.
This takes the programs a cold first save of the README's 4,096-coordinate optax state
compiles (bench/first_save.py's probe, run here with the program cache empty), lowers each
once, and compiles it on this thread, one after another, under each option set of
`OPTION_SETS` (passed as ``compile(compiler_options=...)``, never global ``XLA_FLAGS``).
Per program and option set: the compile time, the median of `RUNS` calls on the save's own
arguments, and the bytes of the outputs that differ from the default compilation's on those
arguments and on `RANDOM_INPUTS` random ones (float32 leaves as random bit patterns,
NaN/inf/subnormals included, as scaled copies and as magnitudes over 60 binades).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
import time

OPTION_SETS = {
    "default": {},
    "no-expensive-llvm": {"xla_llvm_disable_expensive_passes": True},
    "split-1": {"xla_cpu_parallel_codegen_split_count": 1},
    "both": {"xla_llvm_disable_expensive_passes": True, "xla_cpu_parallel_codegen_split_count": 1},
}
RUNS = 15
RANDOM_INPUTS = 20


def _random_like(rng, x):
    import numpy as np
    x = np.asarray(x)
    if x.dtype != np.float32:
        return x
    kind = rng.integers(0, 3)
    if kind == 0:
        return rng.integers(0, 2**32, size=x.shape, dtype=np.uint64).astype(np.uint32).view(np.float32)
    if kind == 1:
        return (x * rng.uniform(0.5, 2, size=x.shape)).astype(np.float32)
    return (np.abs(rng.standard_normal(x.shape)) * 10.0 ** rng.integers(-30, 30, size=x.shape)).astype(np.float32)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax
    import numpy as np

    from jaxguard.core import programs

    captured = []
    compile_stored = programs._load_or_compile

    def capture(fn, key, leaves, tree, static):
        captured.append((fn, leaves, tree, static))
        return compile_stored(fn, key, leaves, tree, static)

    programs._load_or_compile = capture
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from first_save import PROBE   # the state and the save bench/first_save.py times
    argv, sys.argv = sys.argv, ["probe", "optax", tempfile.mkdtemp()]
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(PROBE, "first_save_probe", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = argv
    rng = np.random.default_rng(0)
    rows = []
    for fn, leaves, tree, static in captured:
        def flat(*xs, fn=fn, tree=tree, static=static):
            return fn(*jax.tree_util.tree_unflatten(tree, xs), **static)
        lowered = jax.jit(flat).lower(*programs._shapes(leaves))
        exes, compile_s, run_ms = {}, {}, {}
        for name, options in OPTION_SETS.items():
            t0 = time.perf_counter()
            exes[name] = lowered.compile(compiler_options=options)
            compile_s[name] = time.perf_counter() - t0
        for name, exe in exes.items():
            times = []
            for _ in range(RUNS):
                t0 = time.perf_counter()
                jax.block_until_ready(exe(*leaves))
                times.append(time.perf_counter() - t0)
            run_ms[name] = statistics.median(times) * 1e3
        differing = dict.fromkeys(OPTION_SETS, 0)
        for inputs in [leaves] + [[_random_like(rng, x) for x in leaves] for _ in range(RANDOM_INPUTS)]:
            ref = [np.asarray(o) for o in jax.tree_util.tree_leaves(exes["default"](*inputs))]
            for name, exe in exes.items():
                out = [np.asarray(o) for o in jax.tree_util.tree_leaves(exe(*inputs))]
                differing[name] += sum(int(np.sum(r.view(np.uint8) != q.view(np.uint8))) for r, q in zip(ref, out))
        statics = ", ".join(f"{k}={'%d values' % len(v) if isinstance(v, tuple) else v}" for k, v in static.items())
        shape = next((tuple(np.shape(x)) for x in leaves if np.ndim(x) >= 1 and np.shape(x)[0] > 1), ())
        rows.append({"program": f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}", "static": statics,
                     "shape": list(shape), "compile_s": compile_s, "run_ms": run_ms, "differing_bytes": differing})
    names = list(OPTION_SETS)
    lines = ["# XLA compile options on a cold first save's programs (`python bench/experiments/compile_options.py`)\n",
             f"The {len(rows)} programs of the README optax state's cold first save, each lowered once and compiled "
             "one after another on one thread under each option set (a shared 2-core box). Compile seconds; run: "
             f"median of {RUNS} calls on the save's arguments, ms; differing output bytes against the default "
             f"compilation on the save's arguments and {RANDOM_INPUTS} random inputs.\n",
             "Option sets: " + "; ".join(f"`{k}` {v or '(none)'}" for k, v in OPTION_SETS.items()) + ".\n",
             "| program | static | shape | " + " | ".join(f"compile {n}" for n in names) + " | "
             + " | ".join(f"run {n}" for n in names) + " | differing bytes |",
             "|---|---|---|" + "---:|" * (2 * len(names)) + "---|"]
    for r in rows:
        lines.append(f"| `{r['program']}` | {r['static']} | {tuple(r['shape'])} | "
                     + " | ".join(f"{r['compile_s'][n]:.2f}" for n in names) + " | "
                     + " | ".join(f"{r['run_ms'][n]:.3f}" for n in names) + " | "
                     + ", ".join(str(r["differing_bytes"][n]) for n in names) + " |")
    sums = {n: sum(r["compile_s"][n] for r in rows) for n in names}
    lines += ["", "Compile seconds summed: " + ", ".join(f"{n} {s:.2f} s ({s / sums['default']:.2f}x)"
                                                       for n, s in sums.items()) + ".", ""]
    print("\n".join(lines))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + ".json", "w") as fh:
            json.dump({"option_sets": OPTION_SETS, "programs": rows}, fh, indent=1)
        with open(a.out + ".md", "w") as fh:
            fh.write("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
