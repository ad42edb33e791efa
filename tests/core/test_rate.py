"""The rate pass of logrel-ans (jaxguard.core.rate): certified codes of fewer coded bits.

It moves codes away from the nearest grid value, so the tests hold it against the real
jitted optax update: the payload shrinks, the audit stays within tau*lr, and (negative
control) the same moves without the certificate break the contract."""
import numpy as np
import pytest

import jaxguard.core.guard as G
from jaxguard.core import rate
from jaxguard.format import container, reader

TAU, LR, CLIP, STEP = 0.01, 1e-3, 0.2, 40


def _adam_moments(n, steps=STEP, seed=11):
    """m, v of `steps` Adam updates of per-coordinate gradient streams (mean and noise
    scales spread over 3 binades, as in a trained layer), and params."""
    rng = np.random.default_rng(seed)
    mean = rng.normal(0, 1, n) * 10.0 ** rng.uniform(-4, -2, n)
    noise = 10.0 ** rng.uniform(-3.5, -1.5, n)
    m = np.zeros(n)
    v = np.zeros(n)
    for _ in range(steps):
        g = mean + noise * rng.normal(0, 1, n)
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
    return m.astype(np.float32), v.astype(np.float32), rng.normal(0, 0.05, n).astype(np.float32)


def _optax_audit(m, v, p, mt, vt):
    import jax.numpy as jnp
    import optax
    from jaxguard import optax_adapter as oa
    tx = optax.adam(LR)

    def state(a, b):
        st = tx.init({"w": jnp.asarray(p)})
        adam = st[0]._replace(count=jnp.asarray(STEP, jnp.int32), mu={"w": jnp.asarray(a)}, nu={"w": jnp.asarray(b)})
        return (adam,) + tuple(st[1:])

    return oa.audit(tx, state(m, v), state(mt, vt), {"w": jnp.asarray(p)}, lr=LR, tau=TAU, clip=CLIP)


def _config(**kw):
    return G.GuardConfig(codec="logrel-ans", lr=LR, tau=TAU, clip=CLIP, step=STEP, op_model="optax-adam", **kw)


@pytest.fixture(scope="module")
def moments():
    return _adam_moments(256 * 12 + 41)


@pytest.fixture(scope="module")
def with_and_without(moments):
    m, v, p = moments
    on = G.encode(m, v, p, _config())
    rounds = rate.ROUNDS
    rate.ROUNDS = 0
    try:
        off = G.encode(m, v, p, _config())
    finally:
        rate.ROUNDS = rounds
    return on, off


def test_rate_pass_shrinks_the_payload_and_the_real_optax_audit_holds(moments, with_and_without):
    m, v, p = moments
    on, off = with_and_without
    assert on.stats["payload_bytes"] < 0.97 * off.stats["payload_bytes"], (on.stats, off.stats)
    assert on.stats["escapes"] <= off.stats["escapes"]
    moved = (on.arrays["m_codes"] != off.arrays["m_codes"]) | (on.arrays["v_codes"] != off.arrays["v_codes"])
    assert moved.mean() > 0.2                           # the pass did move codes off the nearest value
    mt, vt = G.decode(on)
    res = _optax_audit(m, v, p, mt, vt)
    assert res["violations"] == 0 and res["max_gap_lr"] <= TAU, res


def test_rate_pass_container_reads_back_what_was_certified(moments, with_and_without):
    on, _ = with_and_without
    m, v, p = moments
    enc = G.encode(m, v, p, _config(), keep_decoded=True)
    data = container.build([container.Moments("w", enc, {})], {})
    header, payload = reader.parse(data)
    rm, rv = reader.read_moments(header["entries"][0], payload, {})
    dm, dv = enc.decoded
    assert np.array_equal(rm.view(np.uint32), dm.view(np.uint32)) and np.array_equal(rv.view(np.uint32), dv.view(np.uint32))
    assert enc.stats["payload_bytes"] == on.stats["payload_bytes"]      # deterministic


def test_negative_control_the_same_moves_uncertified_break_the_contract(moments):
    """certify=False: the pass accepts every cheaper pair; the real optax update then
    moves by more than tau*lr.  The certificate, not the move list, keeps the pass safe."""
    m, v, p = moments
    free = G.encode(m, v, p, _config(certify=False))
    mt, vt = G.decode(free)
    res = _optax_audit(m, v, p, mt, vt)
    assert res["violations"] > 0.01 * m.size and res["max_gap_lr"] > 2 * TAU, res


def test_escapes_take_free_codes_and_exact_coordinates_keep_theirs():
    """A coordinate no pair certifies is stored exactly; its codes are set to its models'
    cheapest (the reader overwrites them).  m = v = 0 stays code 0 (exact)."""
    m, v, p = _adam_moments(600, seed=3)
    m[:50], v[:50] = 0.0, 0.0
    m[50:60] = np.float32(3e38)          # non-certifiable magnitudes: exact escapes
    enc = G.encode(m, v, p, _config())
    a = enc.arrays
    assert (a["m_codes"][:50] == 0).all() and (a["v_codes"][:50] == 0).all()
    assert set(range(50, 60)) <= set(a["escape_index"].tolist())
    mt, vt = G.decode(enc)
    assert np.array_equal(mt[50:60], m[50:60])


def test_capped_certificate_is_the_full_one_stopped_early(moments):
    """`certify_pc(max_level=L)` (the rate pass's and the width search's cheap answer)
    certifies a subset of what the full certificate does, at the same levels, and refuses
    what needs a finer level than L: a cap can cost payload, never the guarantee."""
    from jaxguard.core import bound, certify
    m, v, p = moments
    n = m.size
    cfg = _config()
    K = bound.stack_rows([bound.pack_constants(cfg.constants(), cfg.tau)])
    gidx = np.zeros(n, np.int32)
    rng = np.random.default_rng(5)
    # decoded values a few relative steps off: many need the refinement levels
    mt = (m * (1 + rng.choice([-1, 1], n) * 10.0 ** rng.uniform(-3, -1.3, n))).astype(np.float32)
    vt = (v * (1 + rng.choice([-1, 1], n) * 10.0 ** rng.uniform(-3, -1.3, n))).astype(np.float32)
    clip = np.full(n, CLIP, np.float32)
    idx = np.arange(n)
    full = certify.certify_pc(K, gidx, m, v, mt, vt, np.abs(p), clip, idx, "shared", "mixed")
    assert ((full >= 0) & (full < certify.FAST_TIER)).any() and (full < 0).any()
    deep = int(full[(full >= 0) & (full < certify.FAST_TIER)].max())
    assert deep >= 1, np.bincount(full[(full >= 0) & (full < 100)])
    cap = deep - 1
    capped = certify.certify_pc(K, gidx, m, v, mt, vt, np.abs(p), clip, idx, "shared", "mixed", max_level=cap)
    kept = capped >= 0
    assert (full[kept] >= 0).all() and (capped[kept] == full[kept]).all()
    assert (capped[(full > cap) & (full < certify.FAST_TIER)] == -1).all()
    assert (capped[(full <= cap) | (full == certify.FAST_TIER)] == full[(full <= cap) | (full == certify.FAST_TIER)]).all()
