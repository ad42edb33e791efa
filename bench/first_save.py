"""The first save of a fresh process, cold (an empty program cache) and warm (the cache a
first process filled), for this tree and a tree to compare with, side by side.

    python bench/first_save.py --before /tmp/main-ref [--repeats 5] [--out bench/results/first_save]
    python bench/first_save.py --before /tmp/main-ref --profile [--out bench/results/first_save_profile]

Two states, as a user meets them:

* ``optax``: the README's optax example (4,096 coordinates, 3 ``optax.adamw`` steps), then
  ``jaxguard.save``;
* ``torch``: a 1,001,500-coordinate MLP (Linear(1000, 500), ReLU, Linear(500, 1000)) after 3
  ``torch.optim.AdamW`` steps, then ``torch_compat.save``.

Each run is a fresh ``python`` process with ``PYTHONPATH`` at the tree measured and its own
``XDG_CACHE_HOME`` (where jaxguard keeps its program cache): an empty directory for a cold
run, the directory one untimed run of that tree filled for a warm one.  Inside the process
the first save call is timed after ``import jaxguard`` (or ``import torch_compat``) and the
state's set-up, so it includes what the call imports lazily; the second save of the same
state is timed too.  Whole-process wall time and peak RSS (GNU time) come from outside.
Runs are interleaved (before, after; cold, warm; optax, torch; repeat) so that load from
other jobs hits both trees alike; medians, min and max are reported.

``--profile`` runs each (tree, state) cold once more with ``PYTHONPROFILEIMPORTTIME`` and
reports where the first call's time went: jax's tracing, lowering and XLA compilation (the
spans jax logs, on a monotonic clock, summed over threads), stored programs loaded, modules imported during
the call, and the process's CPU time during the call (above its wall time when compilations
ran on several threads).

Writes JSON and Markdown next to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from codec_speed import run_child  # noqa: E402

# The two states, as code a probe runs (COORDINATES: the optax state's size; the README's is 4,096).
OPTAX_STATE = r"""
import jax, jax.numpy as jnp, optax
params = {"w": jnp.linspace(-1.0, 1.0, COORDINATES)}
tx = optax.adamw(1e-3, weight_decay=1e-2)
state = tx.init(params)
for step in range(3):
    grads = {"w": jnp.sin(params["w"] * (step + 1)) * 0.1}
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)
jax.block_until_ready(state)
"""
TORCH_STATE = r"""
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1000, 500), torch.nn.ReLU(), torch.nn.Linear(500, 1000))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
for batch in torch.randn(3, 32, 1000):   # three steps
    opt.zero_grad(), model(batch).pow(2).mean().backward(), opt.step()
"""

PROBE = r"""
import json, os, sys, time
state_kind, out_dir = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if state_kind == "optax":
    import jaxguard as jg
else:
    import torch_compat
t_import = time.perf_counter() - t0
import jax
from jax._src import dispatch
events = {}
class timed:   # jax's own tracing/lowering/compilation spans, on a monotonic clock (jax's use time.time())
    def __init__(self, fmt, fun_name, event=None):
        self.event = event
    def __enter__(self):
        self.t = time.perf_counter()
    def __exit__(self, *exc):
        if self.event is not None and self.event.startswith("/jax/core/compile/"):
            n, sec = events.get(self.event, (0, 0.0))
            events[self.event] = (n + 1, sec + time.perf_counter() - self.t)
if state_kind == "optax":
""" + textwrap.indent(OPTAX_STATE.replace("COORDINATES", "4096"), "    ") + r"""
    save = lambda path: jg.save(path, state, params, lr=1e-3, weight_decay=1e-2)
else:
""" + textwrap.indent(TORCH_STATE, "    ") + r"""
    save = lambda path: torch_compat.save(path, opt)
loads = [0, 0.0]
try:   # count the stored programs a process loads (a tree without the cache has none)
    from jaxguard.core import programs
    if hasattr(programs, "_load_executable"):
        inner = programs._load_executable
        def counted(*a, **k):
            t = time.perf_counter()
            got = inner(*a, **k)
            loads[0] += got is not None
            loads[1] += time.perf_counter() - t
            return got
        programs._load_executable = counted
except ImportError:
    pass
dispatch.log_elapsed_time = timed
print("FIRST-SAVE-STARTS", file=sys.stderr, flush=True)
c0, t = time.process_time(), time.perf_counter()
save(os.path.join(out_dir, "first.jg"))
first, first_cpu = time.perf_counter() - t, time.process_time() - c0
print("FIRST-SAVE-ENDS", file=sys.stderr, flush=True)
t = time.perf_counter()
save(os.path.join(out_dir, "second.jg"))
second = time.perf_counter() - t
print(json.dumps({"import_s": t_import, "first_s": first, "first_cpu_s": first_cpu, "second_s": second,
                  "loads": loads[0], "load_s": loads[1],
                  "events": {k.rsplit("/", 1)[-1]: v for k, v in events.items()}}))
"""

STATES = ("optax", "torch")
EVENTS = (("jaxpr_trace_duration", "tracing"), ("jaxpr_to_mlir_module_duration", "lowering"),
          ("backend_compile_duration", "XLA compilation"))


def one_run(tree, state, home, work, profile=False):
    env = dict(os.environ, PYTHONPATH=tree, XDG_CACHE_HOME=home)
    env.pop("JAXGUARD_PROGRAM_CACHE_MB", None)
    if profile:
        env["PYTHONPROFILEIMPORTTIME"] = "1"
    # in the scratch directory: ``python -c`` puts its working directory first on sys.path, and
    # run from a checkout every probe imported that checkout's jaxguard, whatever PYTHONPATH said
    wall, peak, out, err = run_child([sys.executable, "-c", PROBE, state, work], env, cwd=work)
    res = json.loads(out.strip().splitlines()[-1])
    res.update(wall_s=wall, peak_rss=peak)
    if profile:
        res["lazy_imports"] = _lazy_imports(err)
    return res


def _lazy_imports(stderr):
    """(seconds, modules) of the imports between the probe's two markers (-X importtime:
    the outermost entries' cumulative times)."""
    lines = stderr.splitlines()
    try:
        a, b = lines.index("FIRST-SAVE-STARTS"), lines.index("FIRST-SAVE-ENDS")
    except ValueError:
        return [0.0, 0]
    total, count = 0, 0
    for ln in lines[a + 1:b]:
        if not ln.startswith("import time:") or "|" not in ln:
            continue
        parts = ln.split("|")
        name = parts[2]
        count += 1
        if len(name) - len(name.lstrip()) <= 1:   # outermost: its cumulative time counts once
            try:
                total += int(parts[1])
            except ValueError:
                pass
    return [total / 1e6, count]


def _commit(tree):
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=tree).stdout.strip()


def _stats(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="a checkout to compare with (e.g. git worktree add DIR main)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="one cold run each, with where the time went")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    out = a.out or os.path.join(ROOT, "bench", "results", "first_save_profile" if a.profile else "first_save")
    trees = {"before": os.path.abspath(a.before), "after": ROOT}
    scratch = tempfile.mkdtemp(prefix="first_save_")
    runs = {(t, s, mode): [] for t in trees for s in STATES for mode in ("cold", "warm")}
    try:
        warm_home = {}
        if not a.profile:
            for t, tree in trees.items():   # the warm runs' cache: filled by one untimed run of that tree
                warm_home[t] = os.path.join(scratch, f"warm-{t}")
                for s in STATES:
                    one_run(tree, s, warm_home[t], _fresh(scratch))
        for r in range(1 if a.profile else a.repeats):
            for s in STATES:
                for mode in (("cold",) if a.profile else ("cold", "warm")):
                    for t, tree in trees.items():
                        home = _fresh(scratch) if mode == "cold" else warm_home[t]
                        res = one_run(tree, s, home, _fresh(scratch), profile=a.profile)
                        runs[(t, s, mode)].append(res)
                        print(f"{r} {s:5s} {mode} {t:6s} first {res['first_s']:6.2f} s  process {res['wall_s']:6.2f} s",
                              flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
              "before": {"path": trees["before"], "commit": _commit(trees["before"])},
              "after": {"commit": _commit(ROOT)}, "repeats": a.repeats, "profile": a.profile,
              "runs": {"|".join(k): v for k, v in runs.items() if v}}
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out + ".json", "w") as fh:
        json.dump(result, fh, indent=1)
    with open(out + ".md", "w") as fh:
        fh.write(profile_md(result, runs) if a.profile else table_md(result, runs))
    print(f"wrote {out}.md and {out}.json")


_n = [0]


def _fresh(scratch):
    _n[0] += 1
    path = os.path.join(scratch, f"d{_n[0]}")
    os.makedirs(path)
    return path


def _head(result):
    return (f"Machine: {result['machine']}; before = {result['before']['commit']} ({result['before']['path']}), "
            f"after = {result['after']['commit']}.  Whole processes, interleaved; medians [min, max].\n\n")


def table_md(result, runs):
    lines = ["# The first save of a fresh process (`python bench/first_save.py`)\n", _head(result),
             "| state | cache | first save, before | first save, after | after / before | second save, after "
             "| process, before | process, after | peak RSS after / before |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in STATES:
        for mode in ("cold", "warm"):
            b, f = runs[("before", s, mode)], runs[("after", s, mode)]
            fb, ff = _stats([x["first_s"] for x in b]), _stats([x["first_s"] for x in f])
            wb, wf = _stats([x["wall_s"] for x in b]), _stats([x["wall_s"] for x in f])
            ratio = statistics.median([y["first_s"] / x["first_s"] for x, y in zip(b, f)])
            rss = statistics.median([y["peak_rss"] / x["peak_rss"] for x, y in zip(b, f)])
            lines.append(f"| {s} | {mode} | {_fmt(fb)} | {_fmt(ff)} | **{ratio:.2f}x** | "
                         f"{statistics.median(x['second_s'] for x in f):.3f} s | {_fmt(wb)} | {_fmt(wf)} | {rss:.2f}x |")
    lines += ["", "The ratio is the median of the per-repeat ratios (each pair ran side by side). The before "
              "tree's library path keeps no programs across processes: its warm runs compile as its cold ones do.",
              "", "optax: the README's state (4,096 coordinates), `jaxguard.save`; torch: 1,001,500-coordinate "
              "AdamW, `torch_compat.save`. The first save is timed after the import and the state's set-up, "
              "lazy imports included.", ""]
    return "\n".join(lines)


def _fmt(st):
    return f"{st['median']:.2f} s [{st['min']:.2f}, {st['max']:.2f}]"


def profile_md(result, runs):
    lines = ["# Where a cold first save goes (`python bench/first_save.py --profile`)\n", _head(result),
             "One cold run each (an empty program cache). Tracing, lowering and XLA compilation are the spans "
             "jax logs (timed here on a monotonic clock), summed over every thread (several compile at once after this change, so they "
             "can add up to more than the call's wall time); CPU is the process's user+system time during the "
             "call.\n",
             "| state | tree | first save (wall) | CPU | tracing | lowering | XLA compilation | programs compiled "
             "| stored programs loaded | lazy imports |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for s in STATES:
        for t in ("before", "after"):
            (x,) = runs[(t, s, "cold")]
            ev = x["events"]
            cols = [f"{ev.get(k, [0, 0.0])[1]:.2f} s" for k, _ in EVENTS]
            n = ev.get("backend_compile_duration", [0, 0.0])[0]
            li = x.get("lazy_imports", [0.0, 0])
            lines.append(f"| {s} | {t} | {x['first_s']:.2f} s | {x['first_cpu_s']:.2f} s | {' | '.join(cols)} | {n} | "
                         f"{x['loads']} ({x['load_s']:.2f} s) | {li[0]:.2f} s ({li[1]} modules) |")
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
