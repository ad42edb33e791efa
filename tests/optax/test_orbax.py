"""orbax CheckpointManager with the guarded optax handler: async save, rotation, restore."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxguard as jg
import jaxguard.checkpoint as jgc
from jaxguard.optax_adapter import audit


def test_checkpoint_manager_async_rotation_restore(tmp_path):
    params = {"w": jnp.linspace(-1, 1, 600, dtype=jnp.float32).reshape(20, 30), "b": jnp.zeros(30)}
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    st = tx.init(params)
    opts = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    saved = {}
    with ocp.CheckpointManager(tmp_path / "ckpt", options=opts) as mngr:
        for step in range(4):
            g = jax.tree_util.tree_map(lambda p: jnp.cos(p * (step + 2.0)) * 0.05, params)
            u, st = tx.update(g, st, params)
            params = optax.apply_updates(params, u)
            saved[step] = (params, st)
            mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                                    opt_state=jgc.GuardedSave(st, params=params, lr=1e-3)))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [2, 3]
        assert (tmp_path / "ckpt" / "3" / "opt_state" / jgc.FILENAME).exists()
        r = mngr.restore(3, args=ocp.args.Composite(params=ocp.args.StandardRestore(params),
                                                    opt_state=jgc.GuardedRestore(tx.init(params))))
    p3, st3 = saved[3]
    assert jax.tree_util.tree_structure(r["opt_state"]) == jax.tree_util.tree_structure(st3)
    assert int(r["opt_state"][1][0].count) == 4
    res = audit(tx, st3, r["opt_state"], p3, lr=1e-3)
    assert res["violations"] == 0, res
    for a, b in zip(jax.tree_util.tree_leaves(r["params"]), jax.tree_util.tree_leaves(p3)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_guarded_save_needs_params():
    with pytest.raises(jg.CheckpointError, match="params="):
        jgc.GuardedSave(optax.adam(1e-3).init({"w": jnp.zeros(3)}))
