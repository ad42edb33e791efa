"""One optax save of a 16.8M-coordinate AdamW state, with ``tx=`` (the next update read from
the transformation by `jaxguard.optax_probe`) or with ``lr=``/``weight_decay=`` given: what
reading and checking the update costs a whole process, wall time and peak memory.

Usage (whole processes, side by side, on a quiet machine; each prints what it saved):
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
    ap.add_argument("--mode", choices=("tx", "lr", "none"), required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = {"tx": tx} if args.mode == "tx" else {"lr": 1e-3, "weight_decay": 0.01}
        s = jg.save(args.out, state, params, **kw)
    print(json.dumps({"mode": args.mode, "coordinates": s["coordinates"], "escapes": s["escapes"],
                      "container_bytes": s["container_bytes"]}))


if __name__ == "__main__":
    main()
