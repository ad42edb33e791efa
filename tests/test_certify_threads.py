"""The cell levels run their chunks on several threads; the answer does not depend on it.

`certify.certify_pc` hands each level's chunks to `certify.certify_threads()` threads
(XLA:CPU releases the GIL while a program runs); every chunk writes its own slice, so the
levels, escapes and bytes are those of one thread.
"""
from __future__ import annotations

import numpy as np
import pytest

from jaxguard.core import certify, guard
from jaxguard.errors import ConfigError


def _hard_state(n=3 * certify.CHUNK[0] + 1234, seed=0):
    """Moments the closed form leaves much of to the cell levels (early-training v: tiny,
    comparable to eps**2), with every edge class mixed in."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n).astype(np.float32) * np.float32(3e-4)
    m = (np.float32(0.1) * g).astype(np.float32)
    v = (np.float32(1e-3) * g * g).astype(np.float32)
    p = (rng.standard_normal(n) * 0.02).astype(np.float32)
    m[:40] = [np.nan, np.inf, -np.inf, 2.0**-149, 3.4e38, 0.0] * 6 + [1e-30] * 4
    v[40:60] = [0.0, 2.0**-149, 1e-45, 3.4e38, np.inf] * 4
    return m, v, p


@pytest.fixture(scope="module")
def encodings():
    m, v, p = _hard_state()
    cfg = guard.GuardConfig(lr=3e-4, step=3, weight_decay=0.01, op_model="torch-adamw")
    out = {}
    mp = pytest.MonkeyPatch()
    try:
        for threads in ("1", "3"):
            mp.setenv("JAXGUARD_CERTIFY_THREADS", threads)
            assert certify.certify_threads() == int(threads)
            out[threads] = guard.encode(m, v, p, cfg, keep_decoded=True)
    finally:
        mp.undo()
    return out


def test_levels_do_not_depend_on_the_thread_count(encodings):
    one, three = encodings["1"], encodings["3"]
    levels = one.stats["certified_by_level"]
    assert sum(levels[1:]) > 1000            # the refinement levels did real work here
    assert one.stats == {**three.stats, "encode_seconds": one.stats["encode_seconds"]}
    for k in one.arrays:
        a, b = (np.ascontiguousarray(x[k]).view(np.uint8) for x in (one.arrays, three.arrays))
        assert np.array_equal(a, b), k            # bit for bit (NaN escapes included)
    for a, b in zip(one.decoded, three.decoded):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("bad", ("0", "two", "-1", ""))
def test_a_bad_thread_count_is_one_line(monkeypatch, bad):
    monkeypatch.setenv("JAXGUARD_CERTIFY_THREADS", bad)
    with pytest.raises(ConfigError, match="JAXGUARD_CERTIFY_THREADS=.*positive integer"):
        certify.certify_threads()
