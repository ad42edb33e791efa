"""The reject before the fixed refinement levels (`bound.DENSE_PROBE_POINTS`) only skips
work: on adversarial moments (magnitudes from the subnormals to float32's max, tiny and
huge ratios m / sqrt(v)) and odd hyperparameters, the guard escapes exactly the
coordinates it escapes with that reject switched off, with the same codes, while the fixed
levels see fewer coordinates (the positive control: the reject is not a no-op)."""
import numpy as np
import pytest

from jaxguard.core import bound, guard, programs
from jaxguard.core.config import GuardConfig

CONFIGS = [
    dict(lr=1e-3, step=100),
    dict(lr=1e-3, step=3),
    dict(lr=3e-4, step=1, tau=1e-4, clip=10.0),
    dict(lr=1e-2, step=10**6, betas=(0.5, 0.99999), eps=1e-30),
    dict(lr=1.0, step=7, betas=(0.99, 0.9), eps=1e-3, weight_decay=0.1, op_model="torch-adamw"),
]


def adversarial(seed, n=24_000):
    """The moments of three Adam steps on noisy gradients (most certify; a few escape only
    after walking the fixed levels, as on a real early checkpoint) with an adversarial
    quarter: magnitudes over float32's whole range, the edges set by hand."""
    rng = np.random.default_rng(seed)
    scale, m, v = rng.lognormal(-8, 2, n), np.zeros(n), np.zeros(n)
    for _ in range(3):
        g = scale * (rng.standard_normal(n) + 0.3)
        m, v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    m, v = m.astype(np.float32), v.astype(np.float32)
    q = n // 4
    v[:q] = np.exp(rng.uniform(np.log(1e-44), np.log(3e38), q))
    m[:q] = rng.standard_normal(q) * np.sqrt(v[:q]) * 10.0 ** rng.uniform(-6, 3, q)
    v[:64] = np.float32(2.0**-149) * np.arange(1, 65)                       # subnormal v
    m[64:128] = np.float32(np.finfo(np.float32).max) * rng.uniform(-1, 1, 64)  # m near the max
    v[128:192] = np.float32(np.finfo(np.float32).max) * rng.uniform(0.5, 1, 64)
    p = rng.standard_normal(n).astype(np.float32)
    return m, v, p


def run(m, v, p, cfg, monkeypatch, reject):
    seen = []
    fixed = bound.batch_bound_pc

    def counting(k, m_, v_, *a, **s):   # distinct coordinates (a short call is padded with its first)
        seen.append(len(np.unique(np.stack([np.asarray(m_).view(np.uint32), np.asarray(v_).view(np.uint32)]), axis=1)))
        return fixed(k, m_, v_, *a, **s)
    monkeypatch.setattr(programs, "enabled", lambda: False)   # a CLI test may have enabled exported programs:
    monkeypatch.setattr(bound, "batch_bound_pc", counting)   # the kernels must be looked up, not loaded
    if not reject:
        monkeypatch.setattr(bound, "DENSE_PROBE_POINTS", bound.PROBE_POINTS)   # the first reject's: nothing more
    enc = guard.encode_many([(m, v, p, GuardConfig(**cfg))])[0]
    monkeypatch.undo()
    return enc, sum(seen)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: ",".join(f"{k}={w}" for k, w in c.items()))
def test_dense_reject_changes_no_escape(cfg, monkeypatch):
    m, v, p = adversarial(len(str(cfg)))
    with_reject, fixed_with = run(m, v, p, cfg, monkeypatch, True)
    without, fixed_without = run(m, v, p, cfg, monkeypatch, False)
    for k in ("m_codes", "v_codes", "escape_index", "escape_m", "escape_v"):
        np.testing.assert_array_equal(np.asarray(with_reject.arrays[k]), np.asarray(without.arrays[k]), err_msg=k)
    assert with_reject.stats["escapes"] == without.stats["escapes"] > 0
    assert fixed_with <= fixed_without


def test_dense_reject_skips_fixed_levels_somewhere(monkeypatch):
    skipped = 0
    for cfg in CONFIGS:
        m, v, p = adversarial(len(str(cfg)))
        skipped += run(m, v, p, cfg, monkeypatch, False)[1] - run(m, v, p, cfg, monkeypatch, True)[1]
    assert skipped > 0
