"""Which programs a cold first save compiles, and what each costs (issue 58's attribution).

    XDG_CACHE_HOME=$(mktemp -d) python bench/experiments/first_save_programs.py [--out bench/experiments/results/first_save_programs]

One fresh process, an empty program cache, the README's 4,096-coordinate optax state and its
first ``jaxguard.save``, as bench/first_save.py's probe runs them (its code, run here).  Every program `jaxguard.core.programs` compiles is lowered and
compiled here instead of in `programs._fresh_executable` (the same ``jax.jit(...).lower(shapes)
.compile()``, nothing stored), and timed: tracing with lowering, then XLA's compilation, each
on the thread that ran it (several compile at once, on 2 cores each takes longer than alone),
with the kernel, its static arguments, its first array argument's shape, the lowered module's
lines, the compiled module's fusions and how many times the probe's two saves called it
(`programs.call`; 0: prepared ahead, never run on this state).  After the save each program
is traced, lowered and compiled once more on this thread alone, jax's caches cleared first
(``jax.clear_caches``): its cost without other threads contending for the 2 cores and the
interpreter lock.  The saved container is the one a normal save writes
(its size is printed; tests/core/test_write_paths.py checks the bytes).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import threading
import time


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from jaxguard.core import programs

    rows, lock, calls = [], threading.Lock(), {}
    direct_call = programs.call

    def counted_call(fn, *args, **static):
        key = programs._fast_key(fn, args, static)[0]
        with lock:
            calls[key] = calls.get(key, 0) + 1
        return direct_call(fn, *args, **static)

    def timed_load_or_compile(fn, key, leaves, tree, static):
        def flat(*xs):
            return fn(*jax.tree_util.tree_unflatten(tree, xs), **static)
        t0 = time.perf_counter()
        lowered = jax.jit(flat).lower(*programs._shapes(leaves))
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
        name = f"{fn.__module__.rsplit('.', 1)[-1]}.{getattr(fn, '__qualname__', fn.__name__)}"
        statics = ", ".join(f"{k}={'%d values' % len(v) if isinstance(v, tuple) else v}" for k, v in static.items())
        shape = next((tuple(jnp.shape(x)) for x in leaves if jnp.ndim(x) >= 1 and jnp.shape(x)[0] > 1), ())
        with lock:
            rows.append({"key": key, "call": (fn, leaves, tree, static), "program": name, "static": statics, "shape": list(shape), "trace_lower_s": t1 - t0,
                         "compile_s": t2 - t1, "lines": lowered.as_text().count("\n"),
                         "fusions": (compiled.as_text() or "").count(" fusion("),
                         "thread": threading.current_thread().name})
        return compiled

    programs._load_or_compile = timed_load_or_compile
    programs.call = counted_call   # the core's modules call it through the module: every call is seen
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from first_save import PROBE   # the state and the save bench/first_save.py times
    work = tempfile.mkdtemp()
    argv, sys.argv = sys.argv, ["probe", "optax", work]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(PROBE, "first_save_probe", "exec"), {"__name__": "__main__"})
    finally:
        sys.argv = argv
    probe = json.loads(out.getvalue().strip().splitlines()[-1])
    wall, cpu, path = probe["first_s"], probe["first_cpu_s"], os.path.join(work, "first.jg")
    for r in rows:
        r["calls"] = calls.get(r.pop("key"), 0)
        fn, leaves, tree, static = r.pop("call")

        def flat(*xs, fn=fn, tree=tree, static=static):
            return fn(*jax.tree_util.tree_unflatten(tree, xs), **static)
        jax.clear_caches()
        t0 = time.perf_counter()
        lowered = jax.jit(flat).lower(*programs._shapes(leaves))
        t1 = time.perf_counter()
        lowered.compile()
        r["alone_trace_lower_s"], r["alone_compile_s"] = t1 - t0, time.perf_counter() - t1
    rows.sort(key=lambda r: -(r["trace_lower_s"] + r["compile_s"]))
    result = {"first_save_s": wall, "cpu_s": cpu, "bytes": os.path.getsize(path), "programs": rows}
    lines = ["# The programs of a cold first save (`python bench/experiments/first_save_programs.py`)\n",
             f"The README's optax state (4,096 coordinates), an empty program cache: first save {wall:.2f} s wall, "
             f"{cpu:.2f} s CPU, {len(rows)} programs, {result['bytes']:,} bytes written. Tracing+lowering and XLA "
             "compilation per program, on the thread that ran it (several at once on a shared 2-core box: "
             "each takes longer than alone).\n",
             "| program | static | shape | trace+lower | XLA compile | alone: trace+lower | alone: compile | lowered lines "
             "| fusions | calls | thread |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| `{r['program']}` | {r['static']} | {tuple(r['shape'])} | {r['trace_lower_s']:.2f} s | "
                     f"{r['compile_s']:.2f} s | {r['alone_trace_lower_s']:.2f} s | {r['alone_compile_s']:.2f} s | "
                     f"{r['lines']:,} | {r['fusions']} | {r['calls']} | {r['thread']} |")
    unused = [r for r in rows if not r["calls"]]
    lines += ["", f"Sums: tracing+lowering {sum(r['trace_lower_s'] for r in rows):.2f} s, XLA compilation "
              f"{sum(r['compile_s'] for r in rows):.2f} s (over threads); the {len(unused)} programs never called "
              f"(prepared ahead for a later save) {sum(r['trace_lower_s'] + r['compile_s'] for r in unused):.2f} s of it. "
              f"Alone, one after another: tracing+lowering {sum(r['alone_trace_lower_s'] for r in rows):.2f} s, "
              f"XLA compilation {sum(r['alone_compile_s'] for r in rows):.2f} s; the programs never called "
              f"{sum(r['alone_trace_lower_s'] + r['alone_compile_s'] for r in unused):.2f} s of it.", ""]
    print("\n".join(lines))
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out + ".json", "w") as fh:
            json.dump(result, fh, indent=1)
        with open(a.out + ".md", "w") as fh:
            fh.write("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
