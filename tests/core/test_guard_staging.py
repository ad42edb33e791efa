"""A one-tensor group that fills its blocks exactly and is aligned to `guard.ALIGN` bytes is
certified from views of its inputs, every other group from padded copies: both give the
same encoding, bit for bit, and the views are never written (they are read-only here, as a
memory-mapped checkpoint's pages are).  An all-False tensor mask in the view path fails
every case."""
import numpy as np
import pytest

from jaxguard.core import codes, guard
from jaxguard.core.config import GuardConfig


def _moments(n, seed):
    rng = np.random.default_rng(seed)
    m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    v = (rng.random(n) * 1e-6).astype(np.float32) ** 2
    p = rng.standard_normal(n).astype(np.float32)
    # adversarial coordinates: float32 max, subnormals, zeros, NaN and Inf
    m[:8] = [np.finfo(np.float32).max, -np.finfo(np.float32).max, 1e-45, -1e-45, 0, 0, np.nan, np.inf]
    v[8:16] = [np.finfo(np.float32).max, 1e-45, 0, 0, np.inf, np.nan, 1e-38, 3e-39]
    p[16:20] = [np.nan, np.inf, 0, -0.0]
    return m, v, p


def _aligned(x):
    out = guard.aligned_zeros(x.size, x.dtype)
    out[:] = x
    out.setflags(write=False)   # a memory-mapped checkpoint's pages: writing one raises
    return out


def _misaligned(x):
    raw = np.zeros(x.size + 1, x.dtype)
    out = raw[1:] if raw.ctypes.data % guard.ALIGN == 0 else raw[:-1]   # either way off ALIGN
    out[:] = x
    return out


@pytest.mark.parametrize("codec", ["log8-rel-zstd", "log8-rel", "block8"])
def test_views_and_copies_encode_the_same(codec):
    n = 64 * codes.BLOCK       # a power of two of whole blocks: the group is exactly its padding
    m, v, p = _moments(n, 0)
    cfg = GuardConfig(lr=1e-3, step=3, codec=codec)
    views = [_aligned(x) for x in (m, v, p)]
    copies = [_misaligned(x) for x in (m, v, p)]
    assert all(x.ctypes.data % guard.ALIGN == 0 for x in views)
    assert all(x.ctypes.data % guard.ALIGN for x in copies)
    a = guard.encode_many([(*views, cfg)], keep_decoded=True)[0]
    b = guard.encode_many([(*copies, cfg)], keep_decoded=True)[0]
    assert a.arrays.keys() == b.arrays.keys()
    for k in a.arrays:
        assert a.arrays[k].dtype == b.arrays[k].dtype and a.arrays[k].tobytes() == b.arrays[k].tobytes(), k
    for x, y in zip(a.decoded, b.decoded):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    drop = ("encode_seconds",)
    assert {k: val for k, val in a.stats.items() if k not in drop} == {k: val for k, val in b.stats.items() if k not in drop}
    assert a.stats["escapes"] > 0   # the adversarial rows (at least) escape
    for x, y in zip(views, (m, v, p)):
        assert x.tobytes() == y.tobytes()

