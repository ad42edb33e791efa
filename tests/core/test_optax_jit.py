"""encode_jit: fixed shapes, same result as guard.encode, subnormals escape exactly,
usable in a jitted save hook without recompiling."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxguard as jg
from jaxguard.format import container
from jaxguard.core import guard, jit_encode

CFG = jg.GuardConfig(lr=1e-3, step=10, op_model="optax-adam", codec="log8")


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def _moments(n=2000, seed=0):
    rng = np.random.default_rng(seed)
    m = (rng.normal(size=n) * 1e-3).astype(np.float32)
    v = (rng.normal(size=n) ** 2 * 1e-6).astype(np.float32)
    p = rng.normal(size=n).astype(np.float32)
    m[:200] = 0
    v[:200] = 0
    sub = np.float32(1e-42)                       # subnormal
    m[200:210] = sub
    v[210:220] = sub
    m[220:230] = -sub
    v[220:230] = np.float32(2.0**-100)            # normal but below 2**-80
    m[230], v[231], p[232] = np.nan, -1.0, np.inf
    return m, v, p


def test_matches_eager_guard_and_subnormals_escape():
    m, v, p = _moments()
    je = jg.encode_jit(jnp.asarray(m), jnp.asarray(v), jnp.asarray(p), CFG, capacity=2048)
    enc = jit_encode.to_encoded(je)
    ref = guard.encode(m, v, p, CFG)
    a, b = guard.decode(enc), guard.decode(ref)
    for k in ("m_codes", "v_codes", "m_params", "v_params", "escape_index"):   # the same file, not just the same values
        assert np.array_equal(np.asarray(enc.arrays[k]), np.asarray(ref.arrays[k])), k
    assert np.array_equal(_bits(a[0]), _bits(b[0])) and np.array_equal(_bits(a[1]), _bits(b[1]))
    mj, vj = jit_encode.decode_jit(je)
    assert np.array_equal(_bits(mj), _bits(a[0])) and np.array_equal(_bits(vj), _bits(a[1]))
    # tiny / subnormal / non-finite coordinates come back bit for bit; q == 0 <=> v == 0
    assert np.array_equal(_bits(mj)[200:233], _bits(m)[200:233])
    assert np.array_equal(_bits(vj)[200:233], _bits(v)[200:233])
    assert np.array_equal(np.asarray(vj) == 0, v == 0)
    # the container accepts it and the numpy reader reproduces the decoded values
    data = container.build([container.Moments("x", enc, CFG.to_json())], {"framework": "test"})
    assert len(data) > 0


def test_capacity_overflow_escapes_and_small_escape_buffer_raises():
    m, v, p = _moments()
    je = jg.encode_jit(jnp.asarray(m), jnp.asarray(v), jnp.asarray(p), CFG, capacity=64)
    enc = jit_encode.to_encoded(je, m, v)
    mt, vt = guard.decode(enc)
    cert = ~((_bits(mt) == _bits(m)) & (_bits(vt) == _bits(v)))
    assert cert.sum() <= 64 * 1  # at most `capacity` coordinates are certified (not exact)
    small = jg.encode_jit(jnp.asarray(m), jnp.asarray(v), jnp.asarray(p), CFG, capacity=64, escape_capacity=10)
    try:
        jit_encode.to_encoded(small)
    except jg.ConfigError as exc:
        assert "escape_capacity" in str(exc)
    else:
        raise AssertionError("overflow not reported")


def test_jitted_save_hook_does_not_recompile(tmp_path):
    """The docs/optax.md example: encode inside the training step's jit, write on the host."""
    traces = []
    params = {"w": jnp.linspace(-1, 1, 1000, dtype=jnp.float32)}
    tx = optax.adam(1e-3)
    state = tx.init(params)
    cfg = jg.GuardConfig(lr=1e-3, step=0, op_model="optax-adam", codec="log8")

    @jax.jit
    def train_and_encode(params, state, g, k):
        traces.append(1)
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
        adam = state[0]
        enc = jg.encode_jit(adam.mu["w"], adam.nu["w"], params["w"], cfg, capacity=1024, constants=k)
        return params, state, enc

    for i in range(3):
        g = {"w": jnp.sin(params["w"] * (i + 1)) * 0.1}
        # the state after this step has count i + 1: certify the update that follows it
        k = jit_encode.constants(cfg.__class__(**{**cfg.to_json(), "betas": cfg.betas, "step": i + 1}))
        params, state, je = train_and_encode(params, state, g, k)
        enc = jit_encode.to_encoded(je)
        assert enc.stats["escapes"] < 1000
        # the certificate holds against the real optax update
        restored = (state[0]._replace(mu={"w": guard.decode(enc)[0]}, nu={"w": guard.decode(enc)[1]}),) + state[1:]
        from jaxguard.optax_adapter import audit
        res = audit(tx, state, restored, params, lr=1e-3, grid=[-0.2, -1e-5, 0.0, 1e-5, 0.2])
        assert res["violations"] == 0, res
    assert len(traces) == 1
