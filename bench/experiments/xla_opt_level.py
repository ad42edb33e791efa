"""Can a cold first save compile the guard's kernels with less XLA effort?  Each kernel a
save prepares, compiled at XLA's default and with ``xla_backend_optimization_level=0``
(a public ``jax.stages.Lowered.compile`` option): the compile CPU of each setting, and
whether the outputs agree bit for bit on float32's awkward values (zeros, subnormals,
3e38, moments spread over 11 decades) for three rows of constants (torch Adam, torch
AdamW, optax AdamW).

    PYTHONPATH=$PWD python bench/experiments/xla_opt_level.py [--n 4096]

Measured at commit ac3cdc2 (issue 58; 2-core shared box, other work beside it):
the bound kernels (probes, 8-cell and 28-cell ladders, adaptive partitions, fixed levels)
give OTHER bits at level 0 (22 of 28 kernel runs differ; the closed form and the
proposals agree), for 0.66-0.68x the compile CPU (33.6-39.7 s -> 22.8-26.1 s over both
seeds, two runs; bench/experiments/results/xla_opt_level.md).  A
certificate is a statement about the arithmetic its kernel ran, so that option would need
the guard's audit again (and would run the 124M-scale calls unoptimised): not taken.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxguard.core import bound as B
from jaxguard.core import codecs, fastbound
from jaxguard.core.config import GuardConfig

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests"))
from test_programs import _inputs as awkward_inputs  # noqa: E402

SETTINGS = (("default", None), ("level 0", {"xla_backend_optimization_level": 0}))


def kernel_calls(n, seed):
    m, v, mt, vt, pabs, clip = awkward_inputs(n, seed)   # the programs tests' inputs
    rows = [B.pack_constants(GuardConfig(lr=1e-3, step=s, weight_decay=wd, op_model=om).constants(), 0.01)
            for s, wd, om in ((0, 0.0, "torch-adam"), (99, 0.1, "torch-adamw"), (7, 0.01, "optax-adamw"))]
    K, gidx = B.stack_rows(rows), np.arange(n, dtype=np.int32) % 3
    kc, Kj = K.take(gidx), B.as_step_row(K, -1).as_float32(jnp)
    out = [(B.batch_lower_pc, (kc, m, v, mt, vt, clip), {"points": B.PROBE_POINTS}),
           (fastbound.batch_fast_accept, (Kj, gidx, m, v, mt, vt, pabs, clip), {})]
    out += [(fastbound.batch_fast_cells_pc, (kc, m, v, mt, vt, pabs, clip), {"gammas": g})
            for g in fastbound.FAST_CELLS_PARTITIONS]
    out += [(B.batch_bound_adaptive_pc, (kc, m, v, mt, vt, pabs, clip), {"gammas": g}) for g in B.ADAPTIVE_PARTITIONS]
    out += [(B.batch_bound_pc, (kc, m, v, mt, vt, pabs, clip, jnp.asarray(B.unit_edges(L, "mixed"))),
             {"bound": "shared"}) for L in range(len(B.LEVELS))]
    blocks = [x.reshape(-1, 256) for x in (m, v)]
    valid = np.ones((n // 256, 256), bool)
    out += [(codecs.propose, (*blocks, valid, valid), {"codec": c}) for c in ("log8-rel", "log8")]
    return out


def _sizes(static):
    return " ".join(f"{k}={len(v) if isinstance(v, tuple) else v}" for k, v in static.items())


def _bits(x):
    x = np.asarray(x)
    return x.view(np.uint32) if x.dtype == np.float32 else x


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    a = ap.parse_args(argv)
    cpu = dict.fromkeys((name for name, _ in SETTINGS), 0.0)
    differ = runs = 0
    for seed in (0, 1):
        for fn, args, static in kernel_calls(a.n, seed):
            leaves, tree = jax.tree_util.tree_flatten(args)
            outs, took = {}, {}
            for name, options in SETTINGS:
                def fresh(*xs, fn=fn, tree=tree, static=static):
                    return fn(*jax.tree_util.tree_unflatten(tree, xs), **static)
                fresh.__name__ = f"kernel_{time.time_ns()}"   # no cached executable answers
                c = time.process_time()
                exe = jax.jit(fresh).lower(*leaves).compile(compiler_options=options)
                took[name] = time.process_time() - c
                cpu[name] += took[name]
                r = exe(*leaves)
                outs[name] = r if isinstance(r, tuple) else (r,)
            same = all(np.array_equal(_bits(x), _bits(y)) for x, y in zip(*outs.values()))
            differ, runs = differ + (not same), runs + 1
            print(f"seed {seed} {fn.__name__:26s} {_sizes(static):14s} {'same bits' if same else 'OTHER BITS':10s} compile "
                  + ", ".join(f"{k} {v:.2f} s" for k, v in took.items()), flush=True)
    print(f"compile CPU: " + ", ".join(f"{k} {v:.1f} s" for k, v in cpu.items())
          + f"; kernel runs with other bits: {differ} of {runs}")


if __name__ == "__main__":
    main()
