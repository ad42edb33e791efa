"""Two saves of one state write the same bytes: a container's header records what was
saved, never how long it took, so a checkpoint can be hashed, deduplicated and compared
byte for byte (``cmp``, content-addressed stores, a CI cache)."""
import jax.numpy as jnp
import optax
import pytest

import jaxguard


def _optax_state():
    params = {"w": jnp.linspace(-1.0, 1.0, 4096), "b": jnp.linspace(0.5, -0.5, 64)}
    tx = optax.adamw(1e-3, weight_decay=1e-2)
    state = tx.init(params)
    for step in range(3):
        grads = {k: jnp.sin(v * (step + 1)) * 0.1 for k, v in params.items()}
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    return tx, state, params


def test_two_optax_saves_of_one_state_are_byte_identical(tmp_path):
    tx, state, params = _optax_state()
    paths = [tmp_path / f"opt{i}.jg" for i in range(2)]
    for p in paths:
        jaxguard.save(str(p), state, params, tx=tx)
    assert paths[0].read_bytes() == paths[1].read_bytes()


def test_two_torch_saves_of_one_optimizer_are_byte_identical(tmp_path):
    pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
    import torch_compat
    from helpers import adam_run
    _, opt = adam_run((64, 32, 4), steps=3, batch=16)
    paths = [tmp_path / f"opt{i}.jg" for i in range(2)]
    for p in paths:
        torch_compat.save(str(p), opt)
    assert paths[0].read_bytes() == paths[1].read_bytes()
