"""Portability matrix: the torch replay, its variant detection, the enclosure audit and
the guard's real-torch audit under every ATen/MKL kernel choice this CPU can run.

torch picks its vector kernels from ``ATEN_CPU_CAPABILITY`` and MKL picks its (sqrt among
them) from ``MKL_ENABLE_INSTRUCTIONS`` and ``MKL_CBWR``; both are read once, when the
library loads, so every cell runs in a fresh subprocess with its own environment (and its
own sqrt-table cache entry: the cache key includes those variables).

    python bench/portability.py                 # full sizes (>= 5M replayed coordinates a cell)
    python bench/portability.py --quick         # the test suite's sizes and cells
    python bench/portability.py --cell          # one cell in this process (prints JSON)

Each cell reports what torch says it runs (a request the CPU cannot honour is reported
as such, not skipped), the detected variant, bit mismatches of the replay against the
real torch by position (vector body / scalar tail), the enclosure audit and the real
``torch.optim.Adam`` audit of a guarded checkpoint. Results: bench/results/portability.{json,md}.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FACTORS = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")
VECTOR_WIDTH = 16  # AVX-512 float32 lanes; AVX2 tails (8) are a subset


def full_cells():
    """Every ATen x MKL-instruction combination, plus MKL_CBWR settings on the defaults."""
    cells = [{}]
    cells += [{"ATEN_CPU_CAPABILITY": a, "MKL_ENABLE_INSTRUCTIONS": m}
              for a, m in itertools.product(("default", "avx2", "avx512"), ("SSE4_2", "AVX2", "AVX512"))]
    cells += [{"MKL_CBWR": c} for c in ("COMPATIBLE", "AVX2", "AUTO")]
    return cells


def quick_cells():
    """One factor at a time: the suite's matrix (the defaults are what the rest of the suite runs)."""
    return [{"ATEN_CPU_CAPABILITY": "default"}, {"ATEN_CPU_CAPABILITY": "avx512"},
            {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}, {"MKL_CBWR": "COMPATIBLE"}]


SIZES = {"quick": dict(big=60_003, short=40, enclosure=2048, model_width=48),
         "full": dict(big=1_100_003, short=1500, enclosure=131_072, model_width=160)}


# ---------------------------------------------------------------------------------------
# One cell (runs inside the subprocess)

def cpu_flags() -> set:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    found = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", text, re.M)
    return set(found.group(1).split()) if found else set()


def cpu_name() -> str:
    try:
        found = re.search(r"^model name\s*:\s*(.*)$", Path("/proc/cpuinfo").read_text(), re.M)
        return found.group(1).strip() if found else platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


# CPU flags each requested kernel set needs (torch's cpuinfo checks for its AVX-512 path)
NEEDS = {("ATEN_CPU_CAPABILITY", "avx512"): {"avx512f", "avx512bw", "avx512dq", "avx512vl", "fma"},
         ("ATEN_CPU_CAPABILITY", "avx2"): {"avx2", "fma"},
         ("MKL_ENABLE_INSTRUCTIONS", "AVX512"): {"avx512f"},
         ("MKL_ENABLE_INSTRUCTIONS", "AVX2"): {"avx2"}}


def missing_flags(cell: dict, flags: set) -> list:
    """CPU flags the cell's requests need and this CPU lacks (empty: it can run)."""
    return sorted(set().union(*(NEEDS.get((k, v), set()) for k, v in cell.items())) - flags)


def unrunnable(cell: dict, returncode: int, flags: set):
    """A cell that died of SIGILL because the CPU lacks what it asked for: the reason, else None.
    torch does not fall back from ATEN_CPU_CAPABILITY=avx512 on a CPU without AVX-512: it
    executes an illegal instruction."""
    missing = missing_flags(cell, flags)
    if returncode == -signal.SIGILL and missing:
        return f"cannot run on this CPU: SIGILL (lacks {', '.join(missing)})"
    return None


def honoured(env: dict, capability: str, flags: set) -> tuple[bool, str]:
    """Can this CPU run what the cell asks for? (torch and MKL fall back silently.)"""
    notes = []
    asked = env.get("ATEN_CPU_CAPABILITY")
    if asked and asked.lower() != capability.lower():
        notes.append(f"ATEN_CPU_CAPABILITY={asked} not available, torch runs {capability}")
    mkl = env.get("MKL_ENABLE_INSTRUCTIONS", "")
    if mkl.startswith("AVX512") and "avx512f" not in flags:
        notes.append(f"MKL_ENABLE_INSTRUCTIONS={mkl}: the CPU has no avx512f, MKL runs its best lower kernel")
    return not notes, "; ".join(notes)


def parity_problem(rng, big, short):
    """Realistic Adam state plus the edges: subnormal g/m/v, v in float32's top binade
    (its sqrt has a table of its own on some CPUs), zeros; one big tensor (vector body)
    and many short ones (scalar tails)."""
    import numpy as np

    lengths = [big, *rng.integers(1, 301, short)]
    tensors = []
    for n in lengths:
        n = int(n)
        g = np.clip(rng.standard_normal(n) * 0.02, -0.2, 0.2)
        m = rng.standard_normal(n) * 1e-3
        v = 10.0 ** rng.uniform(-16, -2, n)
        p = rng.standard_normal(n) * 0.05
        kind = rng.random(n)
        g[kind < 0.05] = 0.0
        sub = (kind >= 0.05) & (kind < 0.07)  # subnormal g, m and v
        g[sub] = 10.0 ** rng.uniform(-45, -38, sub.sum()) * np.sign(rng.standard_normal(sub.sum()))
        m[sub] = 10.0 ** rng.uniform(-45, -38, sub.sum())
        v[sub] = 10.0 ** rng.uniform(-45, -38, sub.sum())
        huge = (kind >= 0.07) & (kind < 0.08)  # v near FLT_MAX, m large
        v[huge] = rng.uniform(1.7e38, 3.4e38, huge.sum())
        m[huge] = rng.standard_normal(huge.sum()) * 1e18
        zero = (kind >= 0.08) & (kind < 0.09)
        m[zero], v[zero] = 0.0, 0.0
        tensors.append(tuple(x.astype(np.float32) for x in (p, g, m, v)))
    tail = np.concatenate([np.arange(n) >= n - n % VECTOR_WIDTH for n in lengths])
    return tensors, tail


PARITY_CONFIGS = (
    dict(step=0, lr=1e-3),
    dict(step=9, lr=1e-3, eps=0.0),
    dict(step=999, lr=6e-4, weight_decay=0.01, decoupled=True),
    dict(step=31249, lr=1e-3, weight_decay=0.01),
)


def run_parity(variant, sizes, seed=5):
    import numpy as np

    from torch_compat.replay import adam_step, count_numpy_fallback, torch_adam_step_many

    rng = np.random.default_rng(seed)
    tensors, tail = parity_problem(rng, sizes["big"], sizes["short"])
    flat = [np.concatenate(x) for x in zip(*tensors)]
    out = {"coordinates": 0, "fallback": 0, "mismatches": {k: {"body": 0, "tail": 0} for k in "pmv"}, "configs": []}
    for hyper in PARITY_CONFIGS:
        want = [np.concatenate(x) for x in torch_adam_step_many(*zip(*tensors), **hyper)]
        got = adam_step(*flat, variant=variant, **hyper)
        row = {"hyper": hyper}
        for name, a, b in zip("pmv", want, got):
            differ = (a.view(np.int32) != b.view(np.int32)) & ~(np.isnan(a) & np.isnan(b))
            for where, mask in (("body", ~tail), ("tail", tail)):
                out["mismatches"][name][where] += int(np.count_nonzero(differ & mask))
            row[name] = int(np.count_nonzero(differ))
        out["configs"].append(row)
        out["coordinates"] += flat[0].size
        out["fallback"] += count_numpy_fallback(*flat, variant=variant, **hyper)
    out["total_mismatches"] = sum(n for w in out["mismatches"].values() for n in w.values())
    return out


def run_guard_audit(width, seed=0, steps=25):
    """Train a small MLP with the real torch Adam, compress its checkpoint with the guard,
    restore it, and audit the first update with the real torch Adam on a gradient grid."""
    import torch

    import torch_compat

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.GELU(), torch.nn.Linear(width, 64))
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3, foreach=False)
    x = torch.randn(256, 64)
    y = torch.randn(256, 64)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    data, summary = torch_compat.compress_checkpoint(ckpt)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.jg")
        with open(path, "wb") as f:
            f.write(data)
        restored, _ = torch_compat.restore_tree(path)
    audit = torch_compat.audit(ckpt, restored)
    return {"coordinates": summary["coordinates"], "escapes": summary["escapes"],
            "payload_ratio": round(summary["payload_ratio"], 5), "violations": audit["violations"],
            "max_gap_lr": audit["max_gap_lr"], "gradients": audit["gradients"]}


def run_cell(mode: str) -> dict:
    started = time.perf_counter()
    import jax
    import torch

    # cells share XLA executables (the flags that change code are not in this matrix)
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxguard", "xla")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)

    from torch_compat.enclosure import audit_enclosure
    from torch_compat.variant_cache import variant_record

    sizes = SIZES[mode]
    env = {k: os.environ[k] for k in FACTORS if k in os.environ}
    capability = torch.backends.cpu.get_cpu_capability()
    ok, note = honoured(env, capability, cpu_flags())
    t0 = time.perf_counter()
    record = variant_record()
    detect_seconds = time.perf_counter() - t0
    from torch_compat.replay import AdamVariant

    variant = AdamVariant(**record)
    parity = run_parity(variant, sizes)
    enclosure = audit_enclosure(sizes["enclosure"], seed=1, variant=variant)
    guard = run_guard_audit(sizes["model_width"])
    from torch_compat.variant import torch_sqrt_table

    table = torch_sqrt_table()
    return {
        "env": env, "honoured": ok, "note": note, "torch_capability": capability,
        "variant": {k: record.get(k) for k in ("lerp_fma", "addcmul_fma", "add_alpha_fma", "sqrt", "matched",
                                                "sqrt_ulps_below", "sqrt_ulps_above", "detail")},
        "sqrt_own_binades": list(table.own_binades), "detect_seconds": round(detect_seconds, 2),
        "parity": parity,
        "enclosure": {k: enclosure[k] for k in ("cases", "failures", "max_ratio", "nan_bounds")},
        "guard_audit": guard, "seconds": round(time.perf_counter() - started, 1),
    }


# ---------------------------------------------------------------------------------------
# The matrix (parent process)

def run_matrix(cells, mode, timeout=1200, progress=True):
    rows = []
    for i, cell in enumerate(cells):
        env = {k: v for k, v in os.environ.items() if k not in FACTORS}
        env.update(cell)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        label = ", ".join(f"{k}={v}" for k, v in cell.items()) or "(defaults)"
        if progress:
            print(f"[{i + 1}/{len(cells)}] {label}", file=sys.stderr, flush=True)
        done = subprocess.run([sys.executable, __file__, "--cell", "--mode", mode], env=env, capture_output=True,
                              text=True, timeout=timeout)
        if done.returncode != 0:
            reason = unrunnable(cell, done.returncode, cpu_flags())
            if reason:
                rows.append({"env": cell, "runnable": False, "reason": reason})
            else:
                rows.append({"env": cell, "error": done.stderr.strip().splitlines()[-1:] or
                             [f"(no output, exit {done.returncode})"]})
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return rows


def cell_passed(row) -> bool:
    if row.get("runnable") is False:
        return True  # reported as such; nothing this CPU can check
    return ("error" not in row and row["variant"]["matched"] and row["parity"]["total_mismatches"] == 0
            and row["enclosure"]["failures"] == 0 and row["guard_audit"]["violations"] == 0)


def markdown(rows, meta) -> str:
    lines = [f"# Portability matrix ({meta['mode']})", "",
             f"CPU: {meta['cpu']}; torch {meta['torch']}; jax {meta['jax']}; {meta['date']}; "
             f"{meta['seconds']:.0f} s. Command: `{meta['command']}`.", "",
             "| cell | torch runs | honoured | variant (lerp/addcmul fused, sqrt) | matched | replayed | mismatches "
             "(body/tail) | enclosure cases / failures / max ratio | guard audit: coords / escapes / over tau / worst "
             "(lr) | pass |", "|---|---|---|---|---|---:|---|---|---|---|"]
    for r in rows:
        label = ", ".join(f"{k}={v}" for k, v in r["env"].items()) or "(defaults)"
        if "error" in r:
            lines.append(f"| {label} | | | error: {r['error'][0][:120]} | | | | | | FAIL |")
            continue
        if r.get("runnable") is False:
            lines.append(f"| {label} | | no: {r['reason']} | | | | | | | not runnable |")
            continue
        v, p, e, g = r["variant"], r["parity"], r["enclosure"], r["guard_audit"]
        body = sum(x["body"] for x in p["mismatches"].values())
        tail = sum(x["tail"] for x in p["mismatches"].values())
        sqrt = v["sqrt"] + (f" (own binades {r['sqrt_own_binades']})" if r["sqrt_own_binades"] else "")
        lines.append(
            f"| {label} | {r['torch_capability']} | {'yes' if r['honoured'] else 'no: ' + r['note']} | "
            f"{'y' if v['lerp_fma'] else 'n'}/{'y' if v['addcmul_fma'] else 'n'}, {sqrt} | {v['matched']} | "
            f"{p['coordinates']:,} | {body}/{tail} | {e['cases']:,} / {e['failures']} / {e['max_ratio']:.5f} | "
            f"{g['coordinates']:,} / {g['escapes']} / {g['violations']} / {g['max_gap_lr']:.6f} | "
            f"{'pass' if cell_passed(r) else 'FAIL'} |")
    lines += ["", "A cell whose request the CPU cannot honour still runs (torch and MKL fall back to the best "
              "kernel they have) and is marked `no` in *honoured*; its figures are those of the fallback."]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the suite's sizes and cells")
    ap.add_argument("--cell", action="store_true", help="run one cell in this process and print JSON")
    ap.add_argument("--mode", choices=sorted(SIZES), default=None)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "portability"))
    a = ap.parse_args(argv)
    mode = a.mode or ("quick" if a.quick else "full")
    if a.cell:
        print(json.dumps(run_cell(mode)))
        return 0
    import jax
    import torch

    started = time.perf_counter()
    rows = run_matrix(quick_cells() if mode == "quick" else full_cells(), mode)
    flags = cpu_flags()
    vector = ", ".join(f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "asimd", "sve") if f in flags)
    meta = {"mode": mode, "cpu": f"{cpu_name()} ({platform.machine()}; vector flags: {vector or 'none'})",
            "machine": platform.machine(), "torch": torch.__version__,
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "seconds": time.perf_counter() - started,
            "command": "python bench/portability.py" + (" --quick" if mode == "quick" else "")}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out + ".json").write_text(json.dumps({"meta": meta, "cells": rows}, indent=1))
    Path(a.out + ".md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))
    return 0 if all(cell_passed(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
