"""One optax save of a 16.8M-coordinate AdamW state, with ``tx=`` (the next update read from
the transformation by `jaxguard.optax_probe`) or with ``lr=``/``weight_decay=`` given: what
reading and checking the update costs a whole process, wall time and peak memory.

Usage (``--mode probe``: in one process, `optax_state.plan_updates` with ``tx=`` against
with ``lr=``, the first call (tracing and compiling the probes) and the median of 3 after it;
the others are whole processes to time side by side, each printing what it saved):
    PYTHONPATH=$PWD python bench/tx_probe.py --mode probe
    PYTHONPATH=$PWD python bench/tx_probe.py --mode tx  --out /tmp/p.jg
    PYTHONPATH=$PWD python bench/tx_probe.py --mode lr  --out /tmp/p.jg
    PYTHONPATH=$PWD python bench/tx_probe.py --mode none --out /tmp/p.jg   # build the state, save nothing

The state: params {"w": 4096 x 4096, "b": 4096} (16,781,312 coordinates), one AdamW update
(`optax.adamw(1e-3, weight_decay=0.01)` behind `clip_by_global_norm(1.0)`), seed 0.
Results: bench/results/tx_probe.md (the figures and the command that timed them).
"""
from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("tx", "lr", "none", "probe"), required=True)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.mode in ("tx", "lr") and args.out is None:
        ap.error(f"--mode {args.mode} saves a file: pass --out PATH")
    import jax
    import jax.numpy as jnp
    import optax
    import jaxguard as jg
    key = jax.random.PRNGKey(0)
    params = {"w": jax.random.normal(key, (4096, 4096)) * 0.02, "b": jnp.zeros(4096)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.01))
    state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.sin(p * 7.0) * 0.01, params)
    updates, state = jax.jit(tx.update)(grads, state, params)
    params = optax.apply_updates(params, updates)
    jax.block_until_ready((params, state))
    if args.mode == "none":
        print(json.dumps({"mode": "none"}))
        return
    if args.mode == "probe":
        import statistics
        import time
        from jaxguard.core.config import UpdateRequest
        from jaxguard.optax_state import plan_updates

        def timed(**kw):
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plan_updates(state, params, update=UpdateRequest(**kw))
            return time.perf_counter() - t0

        first = timed(tx=tx)
        with_tx = statistics.median(timed(tx=tx) for _ in range(3))
        first_lr = timed(lr=1e-3, weight_decay=0.01)
        with_lr = statistics.median(timed(lr=1e-3, weight_decay=0.01) for _ in range(3))
        print(json.dumps({"mode": "probe", "coordinates": 4096 * 4096 + 4096, "tx_first_s": round(first, 3),
                          "tx_median_s": round(with_tx, 3), "lr_first_s": round(first_lr, 4),
                          "lr_median_s": round(with_lr, 4)}))
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = {"tx": tx} if args.mode == "tx" else {"lr": 1e-3, "weight_decay": 0.01}
        s = jg.save(args.out, state, params, **kw)
    print(json.dumps({"mode": args.mode, "coordinates": s["coordinates"], "escapes": s["escapes"],
                      "container_bytes": s["container_bytes"]}))


if __name__ == "__main__":
    main()
