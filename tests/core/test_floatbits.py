"""The numpy and jax.numpy float32 classifiers agree on every class of float32."""
import jax
import numpy as np
import pytest

from jaxguard.core import floatbits as fb

PREDICATES = ("finite", "zero", "negative", "subnormal", "tiny", "not_tiny")


def _patterns():
    exps = np.arange(256, dtype=np.uint32) << 23
    mants = np.array([0, 1, 2, 3, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFE, 0x7FFFFF], np.uint32)
    edge = (exps[:, None] | mants[None, :]).reshape(-1)
    edge = np.concatenate([edge, edge | np.uint32(0x80000000)])
    tiny = np.float32(fb.TINY_MOMENT).view(np.uint32)
    near = np.array([tiny - 1, tiny, tiny + 1], np.uint32)
    rand = np.random.default_rng(0).integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([edge, near, near | np.uint32(0x80000000), rand])


@pytest.fixture(scope="module")
def values():
    return _patterns().view(np.float32)


@pytest.mark.parametrize("name", PREDICATES)
def test_host_equals_device(values, name):
    host = getattr(fb.host, name)(values)
    dev = np.asarray(jax.jit(getattr(fb.device, name))(values))
    assert host.dtype == bool and dev.dtype == bool
    assert np.array_equal(host, dev), np.flatnonzero(host != dev)[:5]


def test_device_with_opaque_zero_matches(values):
    z = fb.opaque_zero()
    for name in PREDICATES:
        dev = np.asarray(jax.jit(lambda x, z, f=getattr(fb.device, name): f(x, z))(values, z))
        assert np.array_equal(dev, getattr(fb.host, name)(values)), name


def test_classes_against_numpy_float_semantics(values):
    """The bit predicates against numpy's float-level classification (host, no flushing)."""
    with np.errstate(invalid="ignore"):
        a = np.abs(values.astype(np.float64))
        assert np.array_equal(fb.host.finite(values), np.isfinite(values))
        assert np.array_equal(fb.host.zero(values), values == 0)
        assert np.array_equal(fb.host.subnormal(values), np.isfinite(values) & (a > 0) & (a < 2.0**-126))
        assert np.array_equal(fb.host.negative(values), np.signbit(values) & (values != 0))
        assert np.array_equal(fb.host.tiny(values), (a > 0) & (a < fb.TINY_MOMENT))


def test_named_edge_cases():
    x = np.array([0.0, -0.0, 1e-45, -1e-45, 2.0**-80, np.nextafter(np.float32(2.0**-80), 0), np.inf, -np.inf,
                  np.nan, -1.0], np.float32)
    assert fb.host.zero(x).tolist() == [True, True] + [False] * 8
    assert fb.host.negative(x).tolist() == [False, False, False, True, False, False, False, True, False, True]
    assert fb.host.subnormal(x).tolist() == [False, False, True, True] + [False] * 6
    assert fb.host.tiny(x).tolist() == [False, False, True, True, False, True, False, False, False, False]
    assert fb.host.finite(x).tolist() == [True] * 6 + [False, False, False, True]
