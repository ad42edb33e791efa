"""Bit-exact replay of torch's foreach=True and fused=True CPU Adam/AdamW, and the
enclosure audit against each (issue 16).

Usage:
    python bench/replay_impls.py [--configs 5] [--long 1000003] [--short 1500]
                                 [--cases 131072] [--out bench/results]

Parity: for each implementation and each of ``--configs`` (step, lr, weight decay, Adam or
AdamW) settings, one long tensor plus ``--short`` tensors of 1..300 elements (so that
scalar tails occur) are stepped by the real ``torch.optim.Adam/AdamW(foreach=True)`` or
``(fused=True)`` on CPU, and by ``torch_compat.replay.adam_step(implementation=...)``
with the variant detected at run time; mismatching float32 bit patterns of p, m and v are
counted by position (vector body / scalar tail of the fused kernel's width). 0.1% of the
coordinates carry extreme values (subnormal, tiny, huge) that take the numpy path. The
single-tensor replay on the same data is the negative control.

Enclosure: ``torch_compat.enclosure.audit_enclosure(--cases, op_model=...)`` for every
``torch-adam[w]-foreach/-fused`` op model, and once with ``no_radius`` (must fail).
Writes replay_impls.json and replay_impls.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from torch_compat.enclosure import audit_enclosure  # noqa: E402
from torch_compat import replay  # noqa: E402
from torch_compat.replay import detect_implementation_variant  # noqa: E402
from torch_compat.variant import environment_fingerprint  # noqa: E402

CONFIGS = (
    dict(step=0, lr=6e-4, weight_decay=0.01, decoupled=False),
    dict(step=9, lr=1e-3, weight_decay=0.0, decoupled=False),
    dict(step=999, lr=1e-3, weight_decay=0.1, decoupled=True),
    dict(step=31250, lr=6e-4, weight_decay=0.0, decoupled=True),
    dict(step=99, lr=3e-4, weight_decay=0.05, decoupled=False),
)


def tensors(rng, long_n, n_short):
    lengths = [long_n] + list(rng.integers(1, 301, n_short))
    out = []
    for n in lengths:
        g = np.clip(rng.standard_normal(n) * 0.02, -0.2, 0.2)
        g[rng.random(n) < 0.05] = 0.0
        m = rng.standard_normal(n) * 1e-3
        v = 10.0 ** rng.uniform(-16, -2, n)
        p = rng.standard_normal(n) * 0.05
        extreme = rng.random(n) < 0.001
        k = int(extreme.sum())
        if k:
            m[extreme] = rng.choice([1e-42, 3e-39, 1e-25, 1e25], k) * rng.choice([-1, 1], k)
            v[extreme] = rng.choice([1e-44, 2e-39, 1e-30, 1e30], k)
            g[extreme] = rng.choice([1e-41, 1e-20, 0.1], k)
        out.append(tuple(x.astype(np.float32) for x in (p, g, m, v)))
    return out


def tail_mask(lengths, width):
    return np.concatenate([np.arange(n) >= n - n % width for n in lengths])


def parity(implementation, args):
    variant = detect_implementation_variant(implementation)
    width = variant.vector_width if implementation == "fused" else 8
    rng = np.random.default_rng(16)
    rows = []
    for kw in CONFIGS[: args.configs]:
        ts = tensors(rng, args.long, args.short)
        lengths = [t[0].size for t in ts]
        tail = tail_mask(lengths, width)
        t0 = time.perf_counter()
        want = [np.concatenate(x) for x in replay.torch_adam_step_many(*zip(*ts), implementation=implementation, **kw)]
        t_torch = time.perf_counter() - t0
        flat = [np.concatenate(x) for x in zip(*ts)]
        t0 = time.perf_counter()
        extra = dict(tail_mask=tail) if implementation == "fused" else {}
        got = replay.adam_step(*flat, implementation=implementation, variant=variant, **kw, **extra)
        t_replay = time.perf_counter() - t0
        control = replay.adam_step(*flat, implementation="single", **kw)
        row = dict(config=kw, coordinates=int(tail.size), body=int((~tail).sum()), tail=int(tail.sum()),
                   torch_seconds=round(t_torch, 3), replay_seconds=round(t_replay, 3))
        for name, w, g_, c in zip("pmv", want, got, control):
            bad = w.view(np.int32) != g_.view(np.int32)
            ctl = w.view(np.int32) != c.view(np.int32)
            row[f"{name}_mismatch_body"] = int(bad[~tail].sum())
            row[f"{name}_mismatch_tail"] = int(bad[tail].sum())
            row[f"{name}_single_model_mismatch"] = int(ctl.sum())
        rows.append(row)
        print(implementation, json.dumps(row), flush=True)
    total = {k: sum(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], int)}
    return dict(implementation=implementation, variant=variant.to_dict(), configs=rows, total=total)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", type=int, default=5)
    parser.add_argument("--long", type=int, default=1_000_003)
    parser.add_argument("--short", type=int, default=1500)
    parser.add_argument("--cases", type=int, default=131072)
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    started = time.perf_counter()
    result = dict(machine=dict(environment_fingerprint(), platform=platform.platform(), cores=os.cpu_count(),
                               note="shared machine: 2 cores used by 5 engineers at once (timings contended)"),
                  args=vars(args), parity=[], enclosure=[])
    for implementation in ("foreach", "fused"):
        result["parity"].append(parity(implementation, args))
    for op_model in ("torch-adam-foreach", "torch-adamw-foreach", "torch-adam-fused", "torch-adamw-fused"):
        rep = audit_enclosure(args.cases, op_model=op_model, seed=16, keep_failures=5)
        rep.pop("variant")
        result["enclosure"].append(rep)
        print(op_model, rep["cases"], "cases", rep["failures"], "failures", rep["max_ratio"], rep["seconds"], "s",
              flush=True)
    rep = audit_enclosure(min(args.cases, 16384), op_model="torch-adam-fused", seed=16, no_radius=True,
                          keep_failures=1)
    rep.pop("variant")
    result["enclosure"].append(rep)
    print("no-radius", rep["failures"], flush=True)
    result["seconds"] = round(time.perf_counter() - started, 1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay_impls.json").write_text(json.dumps(result, indent=1))
    (out / "replay_impls.md").write_text(markdown(result))
    print(markdown(result))


def markdown(r):
    m = r["machine"]
    lines = ["# foreach / fused torch Adam: replay parity and enclosure (bench/replay_impls.py)", "",
             f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']} (ATen {m['aten_cpu_capability']}, "
             f"MKL {m['mkl']}); {m['note']}. Total {r['seconds']} s.", "",
             "## Parity (mismatching float32 bit patterns; body / tail of the fused kernel's width)", "",
             "| implementation | coordinates | body | tail | p body | p tail | m body | m tail | v body | v tail | "
             "single-tensor model (p, m, v) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in r["parity"]:
        t = p["total"]
        lines.append(f"| {p['implementation']} | {t['coordinates']:,} | {t['body']:,} | {t['tail']:,} | "
                     f"{t['p_mismatch_body']} | {t['p_mismatch_tail']} | {t['m_mismatch_body']} | "
                     f"{t['m_mismatch_tail']} | {t['v_mismatch_body']} | {t['v_mismatch_tail']} | "
                     f"{t['p_single_model_mismatch']:,}, {t['m_single_model_mismatch']:,}, "
                     f"{t['v_single_model_mismatch']:,} |")
    for p in r["parity"]:
        v = p["variant"]
        lines.append("")
        lines.append(f"Variant detected for {p['implementation']}: `{json.dumps(_short(v))}`")
    lines += ["", "## Enclosure audit", "",
              "| op model | cases | points/case | tail cases | failures | max actual/bound | seconds |",
              "|---|---|---|---|---|---|---|"]
    for e in r["enclosure"]:
        lines.append(f"| {e['op_model']}{' (no radius)' if e['no_radius'] else ''} | {e['cases']:,} | "
                     f"{e['points_per_case']} | {e['tail_cases']:,} | {e['failures']:,} | {e['max_ratio']:.6g} | "
                     f"{e['seconds']} |")
    return "\n".join(lines) + "\n"


def _short(v):
    keys = ("lerp_fma", "addcmul_fma", "add_alpha_fma", "v_decay_fma", "sqrt", "matched")
    if "body" in v:
        return {"vector_width": v["vector_width"], "matched": v["matched"],
                "body": {k: v["body"][k] for k in keys}, "tail": {k: v["tail"][k] for k in keys}}
    return {k: v[k] for k in keys}


if __name__ == "__main__":
    main()
