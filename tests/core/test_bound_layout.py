"""The batched bounds (`bound.batch_bound_pc`, `batch_bound_adaptive_pc`, `batch_bound`)
lay cells on the leading axis and coordinates on the last; the reference is the
single-coordinate bound (`coordinate_bound` and `adaptive_unit_edges` called on scalars)
vmapped over coordinates.  The two must agree
bit for bit, on adversarial moments (subnormal to float32's max, decoded values from
equal to far off) and odd hyperparameters: the layout may change speed, never a bound."""
import functools

import jax
import numpy as np
import pytest

from jaxguard.core import bound
from jaxguard.core.config import GuardConfig

CONFIGS = [
    dict(lr=1e-3, step=100),
    dict(lr=3e-4, step=1, tau=1e-4, clip=10.0),
    dict(lr=1e-2, step=10**6, betas=(0.5, 0.99999), eps=1e-30),
    dict(lr=1.0, step=7, betas=(0.99, 0.9), eps=1e-3, weight_decay=0.1, op_model="torch-adamw"),
    dict(lr=1e-3, step=5, weight_decay=0.01, op_model="optax-adamw"),
]
N = 3000


def cases(seed):
    with np.errstate(over="ignore"):     # decoded values past float32's max: inf, never certified
        return _cases(seed)


def _cases(seed):
    rng = np.random.default_rng(seed)
    v = np.exp(rng.uniform(np.log(1e-44), np.log(3e38), N)).astype(np.float32)
    m = (rng.standard_normal(N) * np.sqrt(v) * 10.0 ** rng.uniform(-6, 3, N)).astype(np.float32)
    v[:64] = np.float32(2.0**-149) * np.arange(1, 65)
    m[64:128] = np.float32(np.finfo(np.float32).max) * rng.uniform(-1, 1, 64)
    v[128:192] = np.float32(np.finfo(np.float32).max) * rng.uniform(0.5, 1, 64)
    rel = 10.0 ** rng.uniform(-9, 0, N)
    mt = (m * (1 + rel * rng.standard_normal(N))).astype(np.float32)
    vt = np.abs(v * (1 + rel * rng.standard_normal(N))).astype(np.float32)
    mt[200:300], vt[250:350] = m[200:300], v[250:350]            # one or both exact
    pabs = np.abs(rng.standard_normal(N) * 10.0 ** rng.uniform(-3, 3, N)).astype(np.float32)
    clip = (10.0 ** rng.uniform(-3, 3, N)).astype(np.float32)
    return m, v, mt, vt, pabs, clip


def rows(i):
    """One group's constants per coordinate, the groups interleaved (as the guard's calls)."""
    ks = [bound.pack_constants(GuardConfig(**c).constants(), GuardConfig(**c).tau) for c in CONFIGS]
    K = bound.stack_rows(ks)
    return K.take(np.arange(N) % len(CONFIGS) if i is None else np.full(N, i))


def bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("level", range(len(bound.LEVELS)))
def test_fixed_levels_match_the_vmapped_coordinate_bound(level):
    args = cases(level)
    K = rows(None)
    edges = bound.unit_edges(level, "mixed")
    ref = jax.jit(jax.vmap(functools.partial(bound.coordinate_bound, decay_in_update=None),
                           in_axes=(0, 0, 0, 0, 0, 0, 0, None)))(K, *args, edges)
    got = bound.batch_bound_pc(K, *args, edges)
    assert np.array_equal(bits(got), bits(ref))
    fin = np.isfinite(np.asarray(ref))
    assert 0 < fin.sum() < N                                 # both finite bounds and refusals compared


@pytest.mark.parametrize("gammas", bound.ADAPTIVE_PARTITIONS, ids=lambda g: f"{len(g)}cells")
def test_adaptive_bound_matches_the_vmapped_coordinate_bound(gammas):
    args = cases(7)
    K = rows(None)

    def one(kk, m, v, mt, vt, p, c):
        return bound.coordinate_bound(kk, m, v, mt, vt, p, c, bound.adaptive_unit_edges(kk, v, vt, c, gammas),
                                      decay_in_update=None)
    ref = jax.jit(jax.vmap(one))(K, *args)
    got = bound.batch_bound_adaptive_pc(K, *args, gammas=gammas)
    assert np.array_equal(bits(got), bits(ref))
    assert 0 < np.isfinite(np.asarray(ref)).sum() < N


def test_one_row_for_all_stays_the_vmapped_bound():
    """`batch_bound` and `batch_lower` (one constants row for all; the jit save hook's)
    stay vmapped: batched, a few of these bounds came out one float32 step apart on an
    AMD EPYC (AVX-512), as did some probes of `batch_lower_pc`."""
    m, v, mt, vt, pabs, clip = cases(13)
    cfg = GuardConfig(**CONFIGS[3])
    k = bound.pack_constants(cfg.constants(), cfg.tau)
    edges = bound.unit_edges(2, "mixed")
    ref = jax.jit(jax.vmap(functools.partial(bound.coordinate_bound, decay_in_update=True),
                           in_axes=(None, 0, 0, 0, 0, 0, 0, None)))(k, m, v, mt, vt, pabs, clip, edges)
    got = bound.batch_bound(k, m, v, mt, vt, pabs, clip, edges, decay_in_update=True)
    assert np.array_equal(bits(got), bits(ref))


def test_dense_probes_include_the_first_probes():
    """certify_pc skips the PROBE_POINTS reject before the adaptive tier because the
    reject after it (DENSE_PROBE_POINTS) evaluates the same points, bit for bit: a
    coordinate the first probes would refuse is refused there, so no level sees it."""
    dense = {np.float32(x).tobytes() for x in bound.DENSE_PROBE_POINTS}
    assert all(np.float32(x).tobytes() in dense for x in bound.PROBE_POINTS)
