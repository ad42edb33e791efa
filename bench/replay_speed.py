"""Speed of the bit-exact torch Adam replay (torch_compat.replay) on 10M coordinates.

Usage:
    python bench/replay_speed.py [--n 10000000] [--repeats 7] [--out bench/results]

Times one Adam step (state step 999, lr 1e-3) of: the jitted JAX replay (kernel only,
and adam_step end to end with numpy in/out), torch.optim.Adam(foreach=False) itself,
the exact numpy model, and the textbook jnp formula (not exact). Each figure is the
median of --repeats warm runs (perf_counter after block_until_ready; one warm-up run,
which includes compilation, excluded). Writes replay_speed.json and replay_speed.md
and checks that every exact path matched torch bit for bit on the benchmark data.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import torch  # noqa: E402

from torch_compat import replay  # noqa: E402

HYPER = dict(step=999, lr=1e-3)


def data(n, seed=0):
    rng = np.random.default_rng(seed)
    g = np.clip(rng.standard_normal(n) * 0.02, -0.2, 0.2)
    g[rng.random(n) < 0.05] = 0.0
    m = rng.standard_normal(n) * 1e-3
    v = 10.0 ** rng.uniform(-16, -2, n)
    p = rng.standard_normal(n) * 0.05
    return tuple(x.astype(np.float32) for x in (p, g, m, v))


def median_seconds(fn, repeats):
    fn()  # warm-up (compilation, allocation)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    variant = replay.detect_variant()
    p, g, m, v = data(args.n)
    jp, jg, jm, jv = (jax.device_put(x) for x in (p, g, m, v))
    scalars = replay.adam_scalars(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False, **HYPER)

    def jax_kernel():
        outputs = replay.replay_flat(jp, jg, jm, jv, scalars, variant, decoupled=False, has_weight_decay=False)
        jax.block_until_ready(outputs)

    def jax_adam_step():
        replay.adam_step(p, g, m, v, variant=variant, **HYPER)

    param, grad = torch.from_numpy(p.copy()), torch.from_numpy(g)
    optimizer = torch.optim.Adam([param], lr=HYPER["lr"], foreach=False, fused=False)
    param.grad = grad
    state = {"step": torch.tensor(float(HYPER["step"])), "exp_avg": torch.from_numpy(m.copy()),
             "exp_avg_sq": torch.from_numpy(v.copy())}

    def torch_step():
        # reset state and param (copies excluded from the figure would need a second clock;
        # the reset copies are timed separately and subtracted)
        optimizer.state[param] = state
        optimizer.step()

    def torch_reset():
        param.data.copy_(torch.from_numpy(p))
        state["exp_avg"].copy_(torch.from_numpy(m))
        state["exp_avg_sq"].copy_(torch.from_numpy(v))
        state["step"].fill_(float(HYPER["step"]))

    def torch_step_with_reset():
        torch_reset()
        torch_step()

    def numpy_model():
        replay.numpy_adam_step(p, g, m, v, variant=variant, **HYPER)

    def textbook():
        replay.textbook_adam_step(p, g, m, v, **HYPER)

    medians = {
        "jax_replay_kernel": median_seconds(jax_kernel, args.repeats),
        "jax_replay_adam_step": median_seconds(jax_adam_step, args.repeats),
        "numpy_exact_model": median_seconds(numpy_model, max(3, args.repeats // 2)),
        "jnp_textbook_not_exact": median_seconds(textbook, args.repeats),
    }
    with_reset = median_seconds(torch_step_with_reset, args.repeats)
    reset_only = median_seconds(torch_reset, args.repeats)
    medians["torch_adam_foreach_false"] = max(with_reset - reset_only, 0.0)

    want = replay.torch_adam_step(p, g, m, v, **HYPER)
    exact = {
        "jax_replay_adam_step": replay.adam_step(p, g, m, v, variant=variant, **HYPER),
        "numpy_exact_model": replay.numpy_adam_step(p, g, m, v, variant=variant, **HYPER),
        "jnp_textbook_not_exact": replay.textbook_adam_step(p, g, m, v, **HYPER),
    }
    mismatches = {name: [int(np.count_nonzero(a.view(np.int32) != b.view(np.int32))) for a, b in zip(want, got)]
                  for name, got in exact.items()}

    torch_seconds = medians["torch_adam_foreach_false"]
    result = {
        "coordinates": args.n,
        "repeats": args.repeats,
        "hyperparameters": HYPER,
        "machine": {"platform": platform.platform(), "processor": variant.cpu, "cpus": os.cpu_count(),
                    "load_average_1_5_15_min_at_end": list(os.getloadavg())},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "jax": jax.__version__,
                     "numpy": np.__version__},
        "variant": variant.to_dict(),
        "median_seconds": medians,
        "ratio_to_torch": {k: (s / torch_seconds if torch_seconds else None) for k, s in medians.items()},
        "mismatches_vs_torch_pmv": mismatches,
        "timing": "median of warm runs, perf_counter after block_until_ready, warm-up excluded; "
                  "torch = (state reset + step) - (state reset)",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "replay_speed.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Replay speed: one Adam step on {args.n:,} coordinates",
        "",
        f"{variant.cpu}, {os.cpu_count()} CPUs; torch {torch.__version__}, jax {jax.__version__}; "
        f"variant sqrt={variant.sqrt}, lerp/addcmul fma={variant.lerp_fma}/{variant.addcmul_fma}. "
        f"Median of {args.repeats} warm runs; load average at the end "
        f"{os.getloadavg()[0]:.1f} (other jobs shared the CPUs when this was recorded).",
        "",
        "| path | median s | x torch | p/m/v mismatches vs torch |",
        "|---|---:|---:|---|",
    ]
    for name, seconds in medians.items():
        ratio = result["ratio_to_torch"][name]
        wrong = "/".join(map(str, mismatches[name])) if name in mismatches else "-"
        lines.append(f"| {name} | {seconds:.4f} | {ratio:.1f} | {wrong} |")
    lines.append("")
    lines.append("`jax_replay_kernel`: device arrays in and out; `jax_replay_adam_step`: numpy in and out, "
                 "padding, fallback check. Regenerate with `python bench/replay_speed.py`.")
    (args.out / "replay_speed.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
