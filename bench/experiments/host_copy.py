"""The blocking copy of an orbax async GuardedSave: fresh arrays vs the handler's lent buffers.

    python bench/experiments/host_copy.py

An optax Adam state of 5 x 1536x1536 parameters (11.8M; m, v, p: 141 MB of CPU JAX arrays);
medians of 7 of `jaxguard.checkpoint._host_copy` into fresh arrays and of the copy into the
buffers `GuardedCheckpointHandler` lends again to the next save.
"""
import time, asyncio, os, sys, tempfile, statistics
import jax, jax.numpy as jnp, numpy as np, optax
import orbax.checkpoint as ocp
import jaxguard.checkpoint as jgc
from jaxguard import optax_state
H, L = 1536, 5
params = {f"l{i}": jnp.ones((H, H), jnp.float32) * 0.01 * (i + 1) for i in range(L)}
tx = optax.adam(1e-3); st = tx.init(params)
g = jax.tree_util.tree_map(lambda p: jnp.cos(p) * 0.01, params)
for _ in range(2):
    u, st = tx.update(g, st, params)
jax.block_until_ready(st)
h = jgc.GuardedCheckpointHandler()
args = jgc.GuardedSave(st, params=params, lr=1e-3)
def t(f, n=7):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
print("op model resolve", f"{t(lambda: h._op_model_where_it_lives(args)):.1f} ms")
print("fresh copy      ", f"{t(lambda: jax.tree_util.tree_map(jgc._host_copy, (st, params))):.1f} ms")
def pooled():
    copy, lent = h._buffers.lend(); jax.tree_util.tree_map(copy, (st, params)); h._buffers.give_back(lent)
print("pooled copy     ", f"{t(pooled):.1f} ms")
print("find_adam_states", f"{t(lambda: optax_state.find_adam_states(st)):.1f} ms")
