"""The guarantee at float32's edges (issue 10): the three certified counterexamples found
by an adversarial search, hyperparameters that only fail in float32, the optax learning
rate of the next update, and a derandomized property search over magnitudes from the
subnormals up to FLT_MAX, each checked against the real framework (torch.optim.Adam /
AdamW with foreach=False, the real jitted optax update).

A coordinate passes when it escaped (stored exactly) or when the real first update from
the restored state is within tau * lr of the one from the original state for every
gradient of a dense grid over [-C, C] plus the extreme gradients (+-C, one ulp inside,
the smallest normal, the subnormals).  No tolerance beyond the contract's tau.
"""
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import jaxguard as jg  # noqa: E402
import torch_compat  # noqa: E402
from jaxguard import optax_adapter as oa  # noqa: E402
from jaxguard.errors import ConfigError  # noqa: E402

TAU, C = 0.01, 0.2
FLT_MAX = float(np.finfo(np.float32).max)


def dense_grid(clip=C, n=401):
    """Linear grid over [-clip, clip], geometric down to 2**-40 clip, and the extremes."""
    c = np.float32(clip)
    lin = np.linspace(-clip, clip, n)
    logs = clip * 2.0 ** -np.linspace(0, 40, 81)
    ext = [c, np.nextafter(c, np.float32(0)), np.float32(2.0**-126), np.float32(2.0**-149), np.float32(1e-30)]
    g = np.concatenate([lin, logs, -logs, ext, -np.asarray(ext, np.float64), [0.0]])
    return np.unique(g.astype(np.float32))


# ---------------------------------------------------------------- real frameworks, batched over gradients
def torch_next_params(p, m, v, grid, *, step, lr, betas=(0.9, 0.999), eps=1e-8, wd=0.0, decoupled=False):
    """[G, n] float64: the real torch update of every coordinate for every gradient of `grid`."""
    G = grid.size
    P = torch.nn.Parameter(torch.from_numpy(np.tile(p, (G, 1))))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([P], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False, fused=False)
    opt.state[P] = {"step": torch.tensor(float(step)), "exp_avg": torch.from_numpy(np.tile(m, (G, 1))),
                    "exp_avg_sq": torch.from_numpy(np.tile(v, (G, 1)))}
    P.grad = torch.from_numpy(np.repeat(grid[:, None], p.size, 1))
    with np.errstate(all="ignore"):
        opt.step()
    return P.detach().numpy().astype(np.float64)


def gaps_over_tau(a, b, lr):
    """[n] bool: coordinates whose update differs by more than tau*lr for some gradient.
    Bitwise-equal results (both inf, say) are equal; a NaN on one side only is a failure."""
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(all="ignore"):
        gap = np.where(same, 0.0, np.nan_to_num(np.abs(a - b) / lr, nan=np.inf))
    return (gap > TAU).any(0)


def torch_roundtrip_violations(tmp_path, p, m, v, *, step, lr, betas=(0.9, 0.999), eps=1e-8, wd=0.0,
                               decoupled=False, grid=None, codec="log8-rel"):
    """torch_compat.save / load of a real optimizer, then the real update on the grid."""
    P = torch.nn.Parameter(torch.from_numpy(p.copy()))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls([P], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False, fused=False)
    opt.state[P] = {"step": torch.tensor(float(step)), "exp_avg": torch.from_numpy(m.copy()),
                    "exp_avg_sq": torch.from_numpy(v.copy())}
    s = torch_compat.save(tmp_path / "s.jg", opt, tau=TAU, clip=C, codec=codec)
    P2 = torch.nn.Parameter(torch.from_numpy(p.copy()))
    opt2 = torch_compat.load(tmp_path / "s.jg", cls([P2], lr=lr, betas=betas, eps=eps, weight_decay=wd,
                                                      foreach=False, fused=False))
    st2 = opt2.state[P2]
    mt, vt = st2["exp_avg"].numpy(), st2["exp_avg_sq"].numpy()
    grid = dense_grid() if grid is None else grid
    kw = dict(step=step, lr=lr, betas=betas, eps=eps, wd=wd, decoupled=decoupled)
    bad = gaps_over_tau(torch_next_params(p, m, v, grid, **kw), torch_next_params(p, mt, vt, grid, **kw), lr)
    exact = (m.view(np.uint32) == mt.view(np.uint32)) & (v.view(np.uint32) == vt.view(np.uint32))
    return int(bad.sum()), s, exact


def optax_violations(tx, params, st, restored, lr, grid):
    """Real jitted tx.update + apply_updates from both states, every g of the grid."""
    @jax.jit
    def step(state, g):
        u, _ = tx.update({"w": jnp.full_like(params["w"], g)}, state, params)
        return optax.apply_updates(params, u)["w"]

    bad = np.zeros(params["w"].shape, bool)
    for g in grid:
        a = np.asarray(step(st, jnp.float32(g)), np.float64)
        b = np.asarray(step(restored, jnp.float32(g)), np.float64)
        bad |= gaps_over_tau(a[None], b[None], lr)
    return int(bad.sum())


def _with_moments(st, mu, nu):
    """Replace the (only) ScaleByAdamState's mu/nu of `st`, keeping its count."""
    def swap(x):
        if isinstance(x, optax.ScaleByAdamState):
            return x._replace(mu={"w": jnp.asarray(mu)}, nu={"w": jnp.asarray(nu)})
        return x
    return jax.tree_util.tree_map(swap, st, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))


# ---------------------------------------------------------------- counterexample 1: AdamW, lr*wd > 2
@pytest.mark.parametrize("wd", [3.0, 10.0])
def test_torch_adamw_decay_factor_above_one(tmp_path, wd):
    """torch decays first (p *= 1 - lr wd); the final p + step rounding sees |1 - lr wd| |p|
    (was certified with |p|: 1.56 tau at wd 3, 6.25 tau at wd 10)."""
    rng = np.random.default_rng(1)
    n = 512
    m = (rng.choice([-1, 1], n) * 10 ** rng.uniform(-3.3, -2.7, n)).astype(np.float32)
    v = (m.astype(np.float64) ** 2 * rng.uniform(50, 100, n)).astype(np.float32)
    p = (rng.choice([-1, 1], n) * rng.uniform(5e4, 9e4, n)).astype(np.float32)
    viol, s, exact = torch_roundtrip_violations(tmp_path, p, m, v, step=100, lr=1.0, wd=wd, decoupled=True)
    assert viol == 0, (viol, s)
    assert s["escapes"] < n    # still compresses: the fix widens one rounding term


# ---------------------------------------------------------------- counterexample 2: optax nu/bc2 overflow
@pytest.mark.parametrize("seed,lo", [(0, 1e-30), (1, 1e10)])
def test_optax_second_moment_near_overflow(tmp_path, seed, lo):
    """optax forms nu/(1 - b2**t) in float32 before the sqrt: inf above FLT_MAX*bc2, so a
    coded nu on the other side of that edge moved the update by up to 85 tau.  Blocks mix
    nu at the edge (count 0: FLT_MAX * 1e-3) with small nu, so the log codes are coarse."""
    rng = np.random.default_rng(seed)
    n = 512
    params = {"w": jnp.asarray(rng.normal(size=n), jnp.float32)}
    tx = optax.adam(1e-3)
    st0 = tx.init(params)
    nu = FLT_MAX * 1e-3 * np.exp(rng.uniform(-0.5, 0.5, n))
    nu[::2] = np.exp(rng.uniform(np.log(lo), np.log(1e35), n // 2))
    nu = nu.astype(np.float32)
    mu = (rng.choice([-1, 1], n) * np.sqrt(nu.astype(np.float64)) * rng.uniform(0.3, 5, n)).astype(np.float32)
    st = _with_moments(st0, mu, nu)
    jg.save(tmp_path / "o.jg", st, params, lr=1e-3)
    r = jg.load(tmp_path / "o.jg", like=st0)
    assert optax_violations(tx, params, st, r, 1e-3, dense_grid(n=101)) == 0


# ---------------------------------------------------------------- counterexample 3: overflow inside the bound
@pytest.mark.parametrize("codec,lo", [("log8-rel", 1e-30), ("log8", 1e-30), ("log8-rel", 1e10)])
def test_torch_adam_overflow_inside_the_bound(tmp_path, codec, lo):
    """Defaults everywhere (step 0, lr 1e-3); v > FLT_MAX * B made B*d1*d2 overflow, which
    zeroed the v-difference term (1.53 tau at m = -4.87e18, v = 9.9e37, p = -74.5).  Half
    of each block has v above FLT_MAX * B, the rest down to `lo` (coarse log codes)."""
    rng = np.random.default_rng(3)
    n = 1024
    v = np.exp(rng.uniform(np.log(lo), np.log(3e38), n))
    v[::2] = np.exp(rng.uniform(np.log(1.2e37), np.log(3e38), n // 2))
    v = v.astype(np.float32)
    m = (np.sqrt(v.astype(np.float64)) * rng.uniform(0.05, 1.0, n) * rng.choice([-1, 1], n)).astype(np.float32)
    p = rng.uniform(-100, 100, n).astype(np.float32)
    viol, s, _ = torch_roundtrip_violations(tmp_path, p, m, v, step=0, lr=1e-3, codec=codec,
                                            grid=dense_grid(n=101))
    assert viol == 0, (viol, s)


def test_jitted_encode_escapes_the_same_edge_coordinates():
    """encode_jit runs the same bound: on counterexample 3's magnitudes (and normal ones in
    the same blocks) it escapes exactly the coordinates guard.encode escapes."""
    rng = np.random.default_rng(6)
    n = 512
    v = np.exp(rng.uniform(np.log(1e-30), np.log(3e38), n))
    v[::2] = np.exp(rng.uniform(np.log(1.2e37), np.log(3e38), n // 2))
    v = v.astype(np.float32)
    m = (np.sqrt(v.astype(np.float64)) * rng.uniform(0.05, 1.0, n) * rng.choice([-1, 1], n)).astype(np.float32)
    p = rng.uniform(-100, 100, n).astype(np.float32)
    # log8-rel: the host route's log8-rel-zstd proposes escaping blocks again at wider codes,
    # which the jitted route does not (it escapes them, certified all the same)
    cfg = jg.GuardConfig(lr=1e-3, step=0, codec="log8-rel")
    host = jg.encode(m, v, p, cfg)
    from jaxguard.core import jit_encode
    je = jit_encode.to_encoded(jg.encode_jit(jnp.asarray(m), jnp.asarray(v), jnp.asarray(p), cfg, capacity=n), m, v)
    assert np.array_equal(np.asarray(je.arrays["escape_index"]), np.asarray(host.arrays["escape_index"]))
    assert host.stats["escapes"] > n // 2 - 64      # the half above FLT_MAX * B escapes


def test_ideal_stage_near_flt_max_encloses_the_exact_difference():
    """Stage 1 alone at counterexample 3's magnitudes: no longer an overflowed product
    (b2f R / (B d1 d2) is divided in turn), and >= the exact (float64) difference at 65
    gradients of every cell; an intermediate that does overflow (m - m~ here) gives +inf,
    and the whole coordinate escapes (v' above the native limit)."""
    from jaxguard.core import bound
    cfg = jg.GuardConfig(lr=1e-3, step=0)
    c = cfg.constants()
    k = jnp.asarray(bound.pack_constants(c, TAU))
    e = np.asarray(bound.unit_edges(1), np.float64)
    f32 = np.float32
    for m, v, mt, vt in [(-4.87e18, 9.9e37, -4.80e18, 8.2e37), (1e19, 3e38, 1.01e19, 2.5e38),
                         (-1e18, 1.2e37, -1e18, 2.9e38)]:
        gl, gh = C * e[:-1], C * e[1:]
        ideal = np.asarray(bound.shared_ideal(k, f32(m), f32(v), f32(mt), f32(vt), jnp.asarray(gl, jnp.float32),
                                               jnp.asarray(gh, jnp.float32)), np.float64)
        g = gl[:, None] + (gh - gl)[:, None] * np.linspace(0, 1, 65)[None]
        m, v, mt, vt = (float(f32(x)) for x in (m, v, mt, vt))

        def step(mm, vv):
            return c.S * (c.keep * mm + c.a * g) / (np.sqrt(c.b2f * vv + c.c2 * g * g) / c.B + c.eps)
        exact = np.abs(step(m, v) - step(mt, vt)).max(1)
        assert np.all(np.isfinite(ideal)) and np.all(ideal >= exact), (m, v, (exact / ideal).max())
        assert not np.isfinite(float(bound.coordinate_bound(k, f32(m), f32(v), f32(mt), f32(vt), f32(74.5), f32(C),
                                                            jnp.asarray(e, jnp.float32))))
    big = f32(3e38)
    ideal = bound.shared_ideal(k, big, f32(1.0), -big, f32(1.0), jnp.float32(0.0), jnp.float32(C))
    assert float(ideal) == np.inf


# ---------------------------------------------------------------- hyperparameters in float32
@pytest.mark.parametrize("op_model", ["optax-adam", "optax-adamw"])
@pytest.mark.parametrize("betas", [(0.9, 0.99999999), (0.999999999, 0.999)])
def test_beta_rounding_to_one_is_a_config_error(op_model, betas):
    with pytest.raises(ConfigError, match="rounds to 1.0 in float32") as e:
        jg.GuardConfig(lr=1e-3, step=0, betas=betas, op_model=op_model, weight_decay=1e-2)
    assert "\n" not in str(e.value)


def test_beta_rounding_to_one_through_save(tmp_path):
    params = {"w": jnp.ones(8, jnp.float32)}
    st = optax.adam(1e-3).init(params)
    with pytest.raises(ConfigError, match="beta2=0.99999999 rounds to 1.0"):
        jg.save(tmp_path / "b.jg", st, params, lr=1e-3, betas=(0.9, 0.99999999))
    assert not (tmp_path / "b.jg").exists()


def test_torch_beta2_rounding_to_one_is_modelled(tmp_path):
    """torch computes 1 - beta2**t in double: beta2 = 0.99999999 is legal there and certified."""
    rng = np.random.default_rng(4)
    n = 256
    m = (rng.normal(size=n) * 1e-3).astype(np.float32)
    v = (rng.uniform(0.5, 2, n) * 1e-6).astype(np.float32)
    p = rng.normal(size=n).astype(np.float32)
    viol, s, _ = torch_roundtrip_violations(tmp_path, p, m, v, step=10, lr=1e-3, betas=(0.9, 0.99999999))
    assert viol == 0, s


@pytest.mark.parametrize("field,value,match", [
    ("lr", -1e-3, "lr=-0.001 must be > 0"), ("lr", math.nan, "lr=nan is not a finite"),
    ("lr", math.inf, "lr=inf is not a finite"), ("lr", 1e39, "lr=1e+39 overflows float32"),
    ("lr", 1e-50, "lr=1e-50 must be > 0 in float32"), ("eps", 0.0, "eps=0.0 must be > 0"),
    ("eps", 1e-50, "eps=1e-50 must be > 0 in float32"), ("eps", -1e-8, "eps=-1e-08 must be > 0"),
    ("weight_decay", -0.1, "weight_decay=-0.1 must be >= 0"), ("weight_decay", math.inf, "not a finite"),
    ("weight_decay", math.nan, "not a finite"), ("clip", 1e39, "finite and nonzero in float32"),
    ("tau", 1e-50, "finite and nonzero in float32"),
])
@pytest.mark.parametrize("op_model", ["torch-adamw", "optax-adamw"])
def test_bad_hyperparameters_are_one_line_errors(field, value, match, op_model):
    kw = dict(lr=1e-3, step=3, weight_decay=1e-2, op_model=op_model)
    kw[field] = value
    with pytest.raises(ConfigError, match=re.escape(match)) as e:
        jg.GuardConfig(**kw)
    assert "\n" not in str(e.value)


def test_torch_optimizer_with_float32_zero_eps_is_refused(tmp_path):
    """torch accepts eps=1e-50 but adds it in float32, where it is 0."""
    P = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.Adam([P], lr=1e-3, eps=1e-50)
    P.grad = torch.ones(4)
    opt.step()
    with pytest.raises(ConfigError, match="eps=1e-50 must be > 0 in float32"):
        torch_compat.save(tmp_path / "e.jg", opt)
    assert not (tmp_path / "e.jg").exists()


# ---------------------------------------------------------------- optax: the next update's lr
def _inject_run(tx, params, steps):
    st = tx.init(params)
    for i in range(steps):
        u, st = tx.update({"w": jnp.sin(params["w"] * (i + 2.0)) * 0.05}, st, params)
        params = optax.apply_updates(params, u)
    return params, st


def test_inject_hyperparams_needs_the_next_lr(tmp_path):
    """The state carries the *last* update's lr; a decaying schedule then certified the
    next update against the wrong rate (3.8 tau).  Now: one-line error without lr=, and
    lr=schedule is evaluated at the state's count (what the next update uses)."""
    sched = optax.exponential_decay(1e-2, transition_steps=1, decay_rate=0.3)
    tx = optax.inject_hyperparams(optax.adam)(learning_rate=sched)
    params0 = {"w": jnp.asarray(np.random.default_rng(5).normal(size=2048), jnp.float32)}
    params, st = _inject_run(tx, params0, 4)
    with pytest.raises(ConfigError, match=r"pass lr= \(the next update's learning rate") as e:
        jg.save(tmp_path / "x.jg", st, params)
    assert "\n" not in str(e.value)
    cfg = oa.site_config(oa.find_adam_states(st)[0], lr=sched)
    assert cfg.lr == pytest.approx(float(sched(4))) and cfg.lr < 0.5 * float(st.hyperparams["learning_rate"])
    jg.save(tmp_path / "s.jg", st, params, lr=sched)
    r = jg.load(tmp_path / "s.jg", like=tx.init(params))
    res = oa.audit(tx, st, r, params, lr=float(sched(4)))
    assert res["violations"] == 0, res
    # a constant rate given explicitly still works
    txc = optax.inject_hyperparams(optax.adam)(learning_rate=1e-3)
    params, st = _inject_run(txc, params0, 3)
    jg.save(tmp_path / "c.jg", st, params, lr=1e-3)
    r = jg.load(tmp_path / "c.jg", like=txc.init(params))
    assert oa.audit(txc, st, r, params, lr=1e-3)["violations"] == 0


# ---------------------------------------------------------------- property search, torch and optax
def _magnitudes(draw, n, lo_exp, hi_exp):
    """n float32 magnitudes mixing one 'block scale' with log-uniform outliers, from
    subnormals (2**-149) to FLT_MAX."""
    center = draw(st.floats(lo_exp, hi_exp))
    spread = draw(st.sampled_from([0.5, 4.0, 40.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    e = np.clip(center + rng.uniform(-spread, spread, n), -149, 127.99)
    x = np.exp2(e)
    special = rng.random(n)
    x = np.where(special < 0.03, FLT_MAX * rng.uniform(0.5, 1.0, n), x)
    x = np.where((special >= 0.03) & (special < 0.05), 2.0**-149 * rng.integers(1, 1000, n), x)
    x = np.where((special >= 0.05) & (special < 0.08), 0.0, x)
    with np.errstate(over="ignore"):
        return x.astype(np.float32), rng


def _moments_and_params(draw, n=256):
    """Signed m, nonnegative v and signed p (float32 [n]) across float32's whole range."""
    m, rng = _magnitudes(draw, n, -60, 127)
    m = (m * rng.choice([-1, 1], n)).astype(np.float32)
    v, _ = _magnitudes(draw, n, -120, 127)
    p, _ = _magnitudes(draw, n, -30, 127)
    p = (p * rng.choice([-1, 1], n)).astype(np.float32)
    return m, v, p


@st.composite
def torch_cases(draw):
    m, v, p = _moments_and_params(draw)
    return dict(m=m, v=v, p=p, step=draw(st.sampled_from([0, 1, 7, 100, 5000])),
                lr=draw(st.sampled_from([1e-4, 1e-3, 0.1, 1.0, 4.0])),
                wd=draw(st.sampled_from([0.0, 1e-2, 0.5, 3.0])), decoupled=draw(st.booleans()),
                betas=draw(st.sampled_from([(0.9, 0.999), (0.5, 0.9), (0.0, 0.99999999)])),
                codec=draw(st.sampled_from(["log8-rel", "log8", "bf16", "block8"])))


@settings(max_examples=15, deadline=None)
@given(torch_cases())
def test_property_torch_edges(case):
    cfg = jg.GuardConfig(lr=case["lr"], step=case["step"], tau=TAU, clip=C, betas=case["betas"],
                         weight_decay=case["wd"], op_model="torch-adamw" if case["decoupled"] else "torch-adam",
                         codec=case["codec"])
    enc = jg.encode(case["m"], case["v"], case["p"], cfg)
    mt, vt = (np.asarray(x) for x in jg.decode(enc))
    grid = dense_grid(n=33)
    kw = dict(step=case["step"], lr=case["lr"], betas=case["betas"], wd=case["wd"], decoupled=case["decoupled"])
    a = torch_next_params(case["p"], case["m"], case["v"], grid, **kw)
    b = torch_next_params(case["p"], mt, vt, grid, **kw)
    bad = gaps_over_tau(a, b, case["lr"])
    assert not bad.any(), {k: (case[k] if np.ndim(case[k]) == 0 else case[k][bad][:3]) for k in case}


_OPTAX_TX = {}


def _optax_tx(betas):
    """inject_hyperparams with lr and weight decay as state (one trace per betas), betas
    static: the same float32 ops as optax.adamw(lr, b1, b2, weight_decay=wd)."""
    if betas not in _OPTAX_TX:
        tx = optax.inject_hyperparams(optax.adamw, static_args=("b1", "b2", "eps", "mu_dtype", "nesterov"))(
            learning_rate=1e-3, b1=betas[0], b2=betas[1], weight_decay=0.0)

        @jax.jit
        def step(state, params, g):
            u, _ = tx.update({"w": jnp.broadcast_to(g[:, None], params["w"].shape)}, state, params)
            return optax.apply_updates(params, u)["w"]
        _OPTAX_TX[betas] = (tx, step)
    return _OPTAX_TX[betas]


@st.composite
def optax_cases(draw):
    m, v, p = _moments_and_params(draw)
    return dict(m=m, v=v, p=p, count=draw(st.sampled_from([0, 1, 7, 100, 5000])),
                lr=draw(st.sampled_from([1e-4, 1e-3, 0.1, 1.0, 4.0])), wd=draw(st.sampled_from([0.0, 1e-2, 3.0])),
                betas=draw(st.sampled_from([(0.9, 0.999), (0.5, 0.9)])))


@settings(max_examples=15, deadline=None)
@given(optax_cases())
def test_property_optax_edges(tmp_path_factory, case):
    tx, step = _optax_tx(case["betas"])
    params = {"w": jnp.asarray(case["p"])}
    st0 = tx.init(params)
    hp = dict(st0.hyperparams, learning_rate=jnp.float32(case["lr"]), weight_decay=jnp.float32(case["wd"]))
    adam = st0.inner_state[0]._replace(count=jnp.int32(case["count"]), mu={"w": jnp.asarray(case["m"])},
                                       nu={"w": jnp.asarray(case["v"])})
    stt = st0._replace(hyperparams=hp, inner_state=(adam,) + tuple(st0.inner_state[1:]))
    path = tmp_path_factory.mktemp("o") / "o.jg"
    jg.save(path, stt, params, lr=case["lr"], betas=case["betas"])   # static betas: not in the state
    r = jg.load(path, like=stt)
    grid = jnp.asarray(dense_grid(n=33))
    P = {"w": jnp.broadcast_to(params["w"], (grid.size, params["w"].size))}
    st_b = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (grid.size,) + x.shape) if x.ndim == 1 else x, stt)
    r_b = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (grid.size,) + x.shape) if x.ndim == 1 else x, r)
    a = np.asarray(step(st_b, P, grid), np.float64)
    b = np.asarray(step(r_b, P, grid), np.float64)
    bad = gaps_over_tau(a, b, case["lr"])
    assert not bad.any(), {k: (case[k] if np.ndim(case[k]) == 0 else case[k][bad][:3]) for k in case}
