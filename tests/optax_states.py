"""Small trained optax states shared by the JAX-side tests and bench/fuzz/fuzz_manifest.py's
seed (imports JAX and optax only: the suite's torch-blocked run uses it too)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def trained_adamw(shape, *, steps: int):
    """An ``optax.adamw(1e-3, weight_decay=1e-2)`` state after `steps` updates of a weight
    ``w`` (`shape`, a linspace over [-1, 1]) and a bias ``b`` (zeros, ``shape[1]``) by
    cosine gradients, deterministic.

    Args:
      shape: ``(rows, cols)`` of ``w``.
      steps: the updates.

    Returns:
      ``(tx, params, state)`` after the updates.
    """
    rows, cols = shape
    params = {"w": jnp.linspace(-1, 1, rows * cols, dtype=jnp.float32).reshape(rows, cols), "b": jnp.zeros(cols)}
    tx = optax.adamw(1e-3, weight_decay=1e-2)
    st = tx.init(params)
    for i in range(steps):
        g = jax.tree_util.tree_map(lambda p, i=i: jnp.cos(p * (i + 2.0)) * 0.05, params)
        u, st = tx.update(g, st, params)
        params = optax.apply_updates(params, u)
    return tx, params, st
