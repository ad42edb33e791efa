"""The next update a file is certified for, as optax users set it up (issue 55).

Each case is trained with real optax, saved, restored and audited by the real jitted
``tx.update`` with the real learning rate of every parameter (computed here from the
transformation's own schedule, never from what jaxguard recorded): it either refuses in
one line or restores to a first update within tau.  On the code before `tx=`, lr
prefixes and intervals existed, every test here fails (unknown keyword, or a silent
certificate at the wrong rate: `test_a_wrong_lr_certifies_silently_without_tx` measures
how far off it lands).
"""
import json
import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest

import jaxguard as jg
import jaxguard.checkpoint as jgc
from jaxguard.audit import AuditTally, gradient_grid
from jaxguard.format import container
from jaxguard.optax_state import flat_by_dotted

TAU, CLIP = 0.01, 0.2
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def init(key):
    k = jax.random.split(key, 3)
    return {"enc": {"kernel": jax.random.normal(k[0], (16, 64)) * 0.3, "bias": jnp.zeros(64)},
            "mid": {"kernel": jax.random.normal(k[1], (64, 32)) * 0.2, "bias": jnp.zeros(32)},
            "head": {"kernel": jax.random.normal(k[2], (32, 4)) * 0.2, "bias": jnp.zeros(4)}}


def train(tx, steps=25, seed=0):
    params = init(jax.random.PRNGKey(seed))
    st = tx.init(params)
    rng = np.random.default_rng(seed)

    def loss(p, x, y):
        h = jnp.tanh(x @ p["enc"]["kernel"] + p["enc"]["bias"])
        h = jnp.tanh(h @ p["mid"]["kernel"] + p["mid"]["bias"])
        return jnp.mean((h @ p["head"]["kernel"] + p["head"]["bias"] - y) ** 2)

    @jax.jit
    def step(p, st, x, y):
        u, st = tx.update(jax.grad(loss)(p, x, y), st, p)
        return optax.apply_updates(p, u), st

    for _ in range(steps):
        x = jnp.asarray(rng.normal(size=(32, 16)), jnp.float32)
        y = jnp.asarray(rng.normal(size=(32, 4)), jnp.float32)
        params, st = step(params, st, x, y)
    return params, st


def real_first_update(tx, original, restored, params, lr_of):
    """The real jitted ``tx.update`` + ``apply_updates`` from both states over a gradient
    grid and one random draw; every parameter's gap in units of its own real lr."""
    @jax.jit
    def step(state, g):
        return optax.apply_updates(params, tx.update(g, state, params)[0])

    tally = AuditTally(TAU)
    grads = [jax.tree.map(lambda p, g=g: jnp.full(p.shape, g, jnp.float32), params) for g in gradient_grid(CLIP)]
    leaves, tdef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
    grads.append(jax.tree_util.tree_unflatten(tdef, [jax.random.uniform(k, p.shape, jnp.float32, -CLIP, CLIP)
                                                     for k, p in zip(keys, leaves)]))
    for g in grads:
        a, b = flat_by_dotted(step(original, g)), flat_by_dotted(step(restored, g))
        for name in a:
            tally.add(name, a[name], b[name], lr_of(name))
    return tally.summary(len(grads))


def entry_configs(path):
    header, _, _ = container.read(str(path), verify_decoded=False)
    return {e["config"]["param"]: e["config"] for e in header["entries"] if e["kind"] == "moments"}


def one_line(exc):
    assert "\n" not in str(exc.value)
    return str(exc.value)


# ---------------------------------------------------------------- a wrong lr=
def test_a_wrong_lr_is_refused_with_tx_and_tx_alone_restores_within_tau(tmp_path):
    tx = optax.adam(1e-7)                         # a run at lr 1e-7 ...
    params, st = train(tx)
    with pytest.raises(jg.ConfigError) as exc:    # ... saved with the configured peak lr: refused, both values named
        jg.save(tmp_path / "x.jg", st, params, lr=1e-3, tx=tx)
    msg = one_line(exc)
    assert "lr=0.001" in msg and "1e-07" in msg
    assert not (tmp_path / "x.jg").exists()
    jg.save(tmp_path / "ok.jg", st, params, tx=tx)
    cfg = entry_configs(tmp_path / "ok.jg")["mid.kernel"]
    lo, hi = cfg["lr"]
    assert lo <= np.float32(1e-7) <= hi and hi / lo < 1 + 2**-12 and cfg["source"] == "tx"
    restored = jg.load(tmp_path / "ok.jg", tx.init(params), tx=tx, params=params)
    res = real_first_update(tx, st, restored, params, lambda n: float(np.float32(1e-7)))
    assert res.violations == 0, res


def test_a_wrong_lr_certifies_silently_without_tx(tmp_path):
    """The failure mode tx= removes, measured: without tx the given lr is trusted (one
    warning says so) and the real update lands far outside tau."""
    tx = optax.adam(1e-7)
    params, st = train(tx)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        jg.save(tmp_path / "x.jg", st, params, lr=1e-3)
    assert any("without tx=" in str(w.message) for w in rec)
    restored = jg.load(tmp_path / "x.jg", tx.init(params))
    res = real_first_update(tx, st, restored, params, lambda n: float(np.float32(1e-7)))
    assert res.max_gap_lr > 10 * TAU and res.violations > 0


def test_a_warmup_schedule_is_read_at_the_state_count_through_a_clipping_chain(tmp_path):
    sched = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 200)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=0.05))
    params, st = train(tx, steps=3)               # warmup, step 3: the next lr is sched(3), not the peak
    with pytest.raises(jg.ConfigError, match="disagrees"):
        jg.save(tmp_path / "peak.jg", st, params, lr=1e-3, weight_decay=0.05, tx=tx)
    jg.save(tmp_path / "w.jg", st, params, tx=tx)
    cfg = entry_configs(tmp_path / "w.jg")["enc.kernel"]
    real = float(np.asarray(sched(3)))
    assert cfg["lr"][0] <= real <= cfg["lr"][1] and cfg["op_model"] == "optax-adamw" and cfg["step"] == 3
    assert abs(cfg["weight_decay"] / 0.05 - 1) < 1e-3
    restored = jg.load(tmp_path / "w.jg", tx.init(params), tx=tx, params=params)
    res = real_first_update(tx, st, restored, params, lambda n: real)
    assert res.violations == 0, res


def test_inject_hyperparams_and_a_masked_weight_decay(tmp_path):
    sched = optax.linear_schedule(1e-3, 1e-4, 50)
    mask = lambda p: jax.tree.map(lambda x: x.ndim > 1, p)    # noqa: E731 - no decay on biases
    tx = optax.inject_hyperparams(optax.adamw, static_args=("mask",))(learning_rate=sched, weight_decay=0.1,
                                                                        mask=mask)
    params, st = train(tx, steps=12)
    jg.save(tmp_path / "i.jg", st, params, tx=tx)
    cfgs = entry_configs(tmp_path / "i.jg")
    assert cfgs["enc.kernel"]["op_model"] == "optax-adamw" and cfgs["enc.bias"]["op_model"] == "optax-adam"
    assert cfgs["enc.bias"]["weight_decay"] == 0.0
    real = float(np.asarray(sched(12)))
    restored = jg.load(tmp_path / "i.jg", tx.init(params), tx=tx, params=params)
    assert real_first_update(tx, st, restored, params, lambda n: real).violations == 0


# ---------------------------------------------------------------- per-group rates
GROUPS = {"enc": "fast", "mid": "fast", "head": "slow"}
RATES = {"fast": 1e-3, "slow": 1e-6}


def _multi():
    return optax.multi_transform({"fast": optax.adamw(RATES["fast"]), "slow": optax.adamw(RATES["slow"])},
                                 {k: v for k, v in GROUPS.items()})


def _group_lr(name):
    return float(np.float32(RATES[GROUPS[name.split(".")[0]]]))


def test_multi_transform_certifies_every_coordinate_at_its_own_groups_rate(tmp_path):
    tx = _multi()
    params, st = train(tx)
    s = jg.save(tmp_path / "m.jg", st, params, tx=tx)
    cfgs = entry_configs(tmp_path / "m.jg")
    for name, cfg in cfgs.items():
        assert cfg["lr"][0] <= _group_lr(name) <= cfg["lr"][1], (name, cfg["lr"])
    restored = jg.load(tmp_path / "m.jg", tx.init(params), tx=tx, params=params)
    res = real_first_update(tx, st, restored, params, _group_lr)
    assert res.violations == 0, res
    # the same by hand: lr= as a pytree prefix of the params, optax.adamw's default decay
    s2 = jg.save(tmp_path / "p.jg", st, params, lr={"enc": 1e-3, "mid": 1e-3, "head": 1e-6}, weight_decay=1e-4)
    assert s2["escapes"] == s["escapes"] or abs(s2["escapes"] - s["escapes"]) <= s["coordinates"] // 100
    restored = jg.load(tmp_path / "p.jg", tx.init(params))
    assert real_first_update(tx, st, restored, params, _group_lr).violations == 0


def test_one_lr_for_a_multi_transform_is_refused_with_tx():
    tx = _multi()
    params, st = train(tx)
    from jaxguard import optax_adapter as oa
    with pytest.raises(jg.ConfigError) as exc:
        oa.to_bytes(st, params, lr=1e-3, tx=tx)
    assert "head" in one_line(exc) and "1e-06" in str(exc.value)


def test_an_lr_prefix_that_names_no_param_is_one_line():
    tx = optax.adam(1e-3)
    params, st = train(tx, steps=2)
    from jaxguard import optax_adapter as oa
    with pytest.raises(jg.ConfigError) as exc:
        oa.to_bytes(st, params, lr={"enc": 1e-3, "mid": 1e-3, "tail": 1e-3})
    assert "'head.bias'" in one_line(exc)


# ---------------------------------------------------------------- variants the op model does not cover
@pytest.mark.parametrize("make", [lambda: optax.adam(1e-3, nesterov=True), lambda: optax.adam(1e-3, eps_root=1e-8),
                                  lambda: optax.nadamw(1e-3), lambda: optax.adamax(1e-3),
                                  lambda: optax.adam(1e-3, b2=0.99)],
                         ids=["nesterov", "eps_root", "nadamw", "adamax", "other_b2"])
def test_variants_are_refused_not_certified_as_adam(tmp_path, make):
    tx = make()
    params, st = train(tx, steps=6)
    with pytest.raises(jg.UnsupportedOptimizerError) as exc:
        jg.save(tmp_path / "v.jg", st, params, tx=tx)
    assert "not optax's Adam" in one_line(exc)
    assert not (tmp_path / "v.jg").exists()


def test_load_with_another_tx_is_refused_naming_both_values(tmp_path):
    tx = optax.adam(1e-3)
    params, st = train(tx)
    jg.save(tmp_path / "a.jg", st, params, tx=tx)
    with pytest.raises(jg.ConfigError) as exc:
        jg.load(tmp_path / "a.jg", tx.init(params), tx=optax.adam(1e-2), params=params)
    msg = one_line(exc)
    assert "lr=" in msg and "0.01" in msg
    with pytest.raises(jg.ConfigError, match="params="):
        jg.load(tmp_path / "a.jg", tx.init(params), tx=tx)


# ---------------------------------------------------------------- an lr known as a range
@pytest.mark.parametrize("ratio", [10, 1000])
def test_an_lr_interval_holds_at_lo_hi_and_between_with_real_optax(tmp_path, ratio):
    hi = 1e-3
    lo = hi / ratio
    params, st = train(optax.adamw(hi, weight_decay=0.01))
    jg.save(tmp_path / "r.jg", st, params, lr=(lo, hi), weight_decay=0.01)
    assert entry_configs(tmp_path / "r.jg")["mid.kernel"]["lr"] == [lo, hi]
    restored = jg.load(tmp_path / "r.jg", optax.adamw(hi, weight_decay=0.01).init(params))
    for lr in (lo, lo * 1.7, np.sqrt(lo * hi), hi / 1.3, hi):
        tx = optax.adamw(lr, weight_decay=0.01)
        res = real_first_update(tx, st, restored, params, lambda n, lr=lr: float(np.float32(lr)))
        assert res.violations == 0, (lr, res)


def test_an_lr_interval_is_refused_where_the_bound_is_not_shown_for_it():
    params, st = train(optax.adam(1e-3), steps=2)
    from jaxguard import optax_adapter as oa
    for bad, what in (((1e-3, 2.0), "hi <= 1"), ((0.0, 1e-3), "0 < lo"), ((1e-3, 1e-4), "lo > hi")):
        with pytest.raises(jg.ConfigError, match=what):
            oa.to_bytes(st, params, lr=bad)


# ---------------------------------------------------------------- next lr 0 and orbax
def test_warmup_from_zero_is_stored_exactly_and_orbax_async_leaves_no_tmp(tmp_path):
    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 1e-3, 5, 100), weight_decay=0.1)
    params = init(jax.random.PRNGKey(1))
    st = tx.init(params)
    opts = ocp.CheckpointManagerOptions(max_to_keep=5, enable_async_checkpointing=True)
    states = {}
    with ocp.CheckpointManager(tmp_path / "ck", options=opts) as mngr:
        for step in range(3):
            states[step] = st
            mngr.save(step, args=ocp.args.Composite(opt_state=jgc.GuardedSave(st, params=params, tx=tx)))
            g = jax.tree.map(lambda p: jnp.cos(p * (step + 1.0)) * 0.05, params)
            u, st = tx.update(g, st, params)
        with pytest.raises(jg.ConfigError):   # a refusal raises at its own step, before orbax starts it
            mngr.save(3, args=ocp.args.Composite(opt_state=jgc.GuardedSave(st, params=params, lr=1.0, tx=tx)))
        mngr.wait_until_finished()
        assert mngr.all_steps() == [0, 1, 2]
        r0 = mngr.restore(0, args=ocp.args.Composite(opt_state=jgc.GuardedRestore(tx.init(params))))
    assert not [n for n in os.listdir(tmp_path / "ck") if "tmp" in n]
    for a, b in zip(jax.tree_util.tree_leaves(r0["opt_state"]), jax.tree_util.tree_leaves(states[0])):
        assert np.array_equal(np.asarray(a), np.asarray(b))     # next lr 0: stored exactly
    header, _, _ = container.read(str(tmp_path / "ck" / "0" / "opt_state" / jgc.FILENAME))
    whys = [leaf for leaf in header["meta"]["state"]["leaves"] if leaf.get("why")]
    assert len(whys) == 2 * len(jax.tree_util.tree_leaves(params))
    out = subprocess.run([sys.executable, "-m", "jaxguard", "inspect", str(tmp_path / "ck" / "0" / "opt_state" /
                                                                             jgc.FILENAME), "--json"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert len(info["stored_exactly"]) == len(jax.tree_util.tree_leaves(params))


def test_a_failed_background_write_leaves_no_tmp_directory(tmp_path, monkeypatch):
    tx = optax.adam(1e-3)
    params, st = train(tx, steps=2)
    real = jgc.container.atomic_write

    def full_disk(path, data, *a, **k):
        if os.sep + "1." in str(path):
            raise OSError(28, "No space left on device")
        return real(path, data, *a, **k)

    monkeypatch.setattr(jgc.container, "atomic_write", full_disk)
    for enable_async in (False, True):
        d = tmp_path / f"async{enable_async}"
        opts = ocp.CheckpointManagerOptions(max_to_keep=5, enable_async_checkpointing=enable_async)
        raised = 0
        with ocp.CheckpointManager(d, options=opts) as mngr:
            for step in range(3):
                try:
                    mngr.save(step, args=ocp.args.Composite(opt_state=jgc.GuardedSave(st, params=params, tx=tx)))
                except OSError:
                    raised += 1
            try:
                mngr.wait_until_finished()
            except OSError:
                raised += 1
        assert raised == 1
        assert not [n for n in os.listdir(d) if "tmp" in n], os.listdir(d)
        assert "1" not in os.listdir(d) and "0" in os.listdir(d)


# ---------------------------------------------------------------- what the file says
def test_inspect_shows_what_each_group_was_certified_for(tmp_path):
    tx = _multi()
    params, st = train(tx)
    jg.save(tmp_path / "m.jg", st, params, tx=tx)
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-m", "jaxguard", "inspect", str(tmp_path / "m.jg"), "--json"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    groups = json.loads(out.stdout)["certified_for"]
    assert len(groups) == 2 and sorted(g["tensors"] for g in groups) == [2, 4]
    slow = next(g for g in groups if g["lr"][1] < 1e-5)
    assert slow["params"] == ["head.bias", "head.kernel"] and slow["source"] == "tx"
    assert slow["op_model"] == "optax-adamw" and slow["betas"] == [0.9, 0.999] and slow["step"] == 25
    text = subprocess.run([sys.executable, "-m", "jaxguard", "inspect", str(tmp_path / "m.jg")],
                          capture_output=True, text=True, timeout=300, env=env).stdout
    assert "certified_for: 2 updates" in text and "from tx" in text and "lr [9.99" in text


def test_sharded_and_jitted_saves_take_tx_per_group(tmp_path):
    tx = _multi()
    params, st = train(tx)
    jg.save(tmp_path / "dir", st, params, tx=tx, sharded=True)
    restored = jg.load(tmp_path / "dir", tx.init(params), tx=tx, params=params)
    assert real_first_update(tx, st, restored, params, _group_lr).violations == 0
    k = jg.state_constants(st, params, tx=tx)
    assert len(k.k) == 2                                 # one constants row per group rate
    enc = jax.jit(lambda s, p, k: jg.encode_state_jit(s, p, k))(st, params, k)
    jg.write(tmp_path / "jit", enc, k)
    restored = jg.load(tmp_path / "jit", tx.init(params), tx=tx, params=params)
    assert real_first_update(tx, st, restored, params, _group_lr).violations == 0
