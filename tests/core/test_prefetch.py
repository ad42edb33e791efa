"""`jaxguard.writer.prefetched`: the encoder runs ahead of the container writer in a
thread; order, errors and early stops behave as with the plain iterator."""
import threading
import time

import numpy as np
import pytest

from jaxguard.format import container
from jaxguard.writer import prefetched


def _raws(k, size=10):
    for i in range(k):
        yield container.Raw(f"x{i}", np.full(size, i, np.float32), None)


def test_order_and_values_are_kept():
    got = list(prefetched(_raws(50), ahead=25))
    assert [e.name for e in got] == [f"x{i}" for i in range(50)]
    assert all(float(e.array[0]) == i for i, e in enumerate(got))


def test_producer_stays_within_its_budget():
    made = []

    def entries():
        for e in _raws(40):
            made.append(e.name)
            yield e

    it = prefetched(entries(), ahead=30)          # three entries of 10 elements
    first = next(it)
    time.sleep(0.3)
    assert first.name == "x0"
    assert len(made) <= 1 + 3 + 1, made           # the one taken, three queued, one waiting to be queued
    rest = list(it)
    assert len(rest) == 39


def test_producer_error_reaches_the_consumer_after_the_entries_before_it():
    def entries():
        yield from _raws(3)
        raise ValueError("bad tensor x3")

    got = []
    with pytest.raises(ValueError, match="bad tensor x3"):
        for e in prefetched(entries()):
            got.append(e.name)
    assert got == ["x0", "x1", "x2"]


def test_consumer_stopping_early_stops_the_producer():
    made = []

    def entries():
        for e in _raws(10_000):
            made.append(e.name)
            yield e

    before = threading.active_count()
    it = prefetched(entries(), ahead=100)
    for _ in range(5):
        next(it)
    it.close()                                    # joins the producer thread
    assert threading.active_count() == before
    assert len(made) < 10_000


def test_encode_threads_default_to_the_cores_and_the_environment_overrides_it(monkeypatch):
    import os
    from jaxguard import writer
    from jaxguard.errors import ConfigError
    monkeypatch.delenv("JAXGUARD_ENCODE_THREADS", raising=False)
    cores = max(1, min(writer.MAX_ENCODE_THREADS, len(os.sched_getaffinity(0))))
    assert writer.encode_threads() == cores
    assert writer.encode_threads(writer.SECOND_THREAD_FROM) == cores
    assert writer.encode_threads(writer.SECOND_THREAD_FROM - 1) == 1   # a small checkpoint: one thread
    monkeypatch.setenv("JAXGUARD_ENCODE_THREADS", "3")
    assert writer.encode_threads() == 3
    assert writer.encode_threads(1000) == 3   # the environment decides
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("JAXGUARD_ENCODE_THREADS", bad)
        with pytest.raises(ConfigError, match="JAXGUARD_ENCODE_THREADS"):
            writer.encode_threads()


def test_codecs_choosing_codes_on_the_host_weigh_more_towards_a_second_thread():
    """logrel-ans (width search and rate pass on the host) costs ~32x log8-rel a coordinate:
    a 2-slab logrel-ans checkpoint is enough work for the cores, the same one in log8-rel not."""
    from jaxguard import writer
    from jaxguard.core.config import GuardConfig
    n = 2 * writer.SLAB
    z = np.zeros(n, np.float32)
    job = lambda codec: writer.MomentJob("s", z, z, z, GuardConfig(lr=1e-3, step=1, codec=codec))  # noqa: E731
    raw = writer.Raw("p", z)
    assert writer.encode_work([job("log8-rel"), raw]) == n
    assert writer.encode_work([job("logrel-ans"), raw]) == n * writer.HOST_CHOSEN_WEIGHT
    assert writer.encode_work([job("logrel-aw")]) == n * writer.HOST_CHOSEN_WEIGHT
    assert writer.encode_work([job("log8-rel")]) < writer.SECOND_THREAD_FROM <= writer.encode_work([job("logrel-ans")])


def test_slabs_encoded_on_several_threads_give_the_entries_of_one_thread(monkeypatch):
    """writer.container_entries hands slabs on in order whatever the thread count (the suite's 2-core
    machine runs one encode thread by default, so the threaded path is forced here)."""
    import numpy as np
    from jaxguard import writer
    from jaxguard.core.config import GuardConfig
    rng = np.random.default_rng(3)
    jobs = []
    for i in range(7):
        n = 700 + 300 * i
        v = rng.lognormal(-14, 2, n).astype(np.float32)
        m = (rng.normal(0, 1, n) * np.sqrt(v) * 0.3).astype(np.float32)
        jobs.append(writer.MomentJob(f"t{i}", m, v, rng.normal(0, .05, n).astype(np.float32),
                                     GuardConfig(lr=1e-3, step=10 + i), {}))
    out = {}
    for threads in ("1", "3"):
        monkeypatch.setenv("JAXGUARD_ENCODE_THREADS", threads)
        totals = writer.new_totals()
        out[threads] = ([(e.name, *(np.asarray(e.encoded.arrays[k]).tobytes() for k in sorted(e.encoded.arrays)))
                         for e in writer.container_entries(jobs, totals, slab=2048)], totals)
    assert [e[0] for e in out["3"][0]] == [f"t{i}" for i in range(7)]
    assert out["1"] == out["3"]


def test_encode_shows_one_progress_bar_over_all_coordinates(capsys):
    """`progress=True` is one bar over the coordinates of every slab, not one per slab and
    refinement level (a 16.5M-coordinate compress printed one per slab)."""
    import numpy as np
    from jaxguard import writer
    from jaxguard.core.config import GuardConfig
    rng = np.random.default_rng(5)
    jobs = []
    for i in range(5):
        n = 1500 + 100 * i
        v = rng.lognormal(-14, 2, n).astype(np.float32)
        m = (rng.normal(0, 1, n) * np.sqrt(v)).astype(np.float32)
        jobs.append(writer.MomentJob(f"t{i}", m, v, rng.normal(0, .05, n).astype(np.float32),
                                     GuardConfig(lr=1e-3, step=3), {}))
    total = sum(j.size for j in jobs)
    entries = list(writer.container_entries(jobs, writer.new_totals(), slab=2048, progress=True))
    assert [e.name for e in entries] == [j.name for j in jobs]
    err = capsys.readouterr().err
    starts = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("certify:") and " 0%" in line]
    assert len(starts) == 1, err[-2000:]          # one bar, started once
    assert f"/{total/1000:.2f}k" in err or f"/{total}" in err, err[-2000:]   # its total: every coordinate


def test_callable_entry_info_is_evaluated_when_the_entry_is_produced():
    """`MomentJob.info` values may be callables (torch_compat passes the parameter's
    digest that way, so it is computed in the encode thread, not before the first slab):
    each is called once, when its entry is produced, and stored as its value."""
    from jaxguard import writer
    from jaxguard.core.config import GuardConfig
    rng = np.random.default_rng(0)
    calls = []

    def digest(i):
        def f():
            calls.append(i)
            return f"sha-{i}"
        return f
    jobs = [writer.MomentJob(f"t{i}", rng.normal(0, 1e-3, 512).astype(np.float32),
                             rng.random(512).astype(np.float32) * 1e-6, rng.normal(0, .05, 512).astype(np.float32),
                             GuardConfig(lr=1e-3, step=5), {"param": f"p{i}", "param_sha256": digest(i)})
            for i in range(3)]
    it = writer.container_entries(jobs)
    assert calls == []                                # nothing is computed up front
    got = list(it)
    assert calls == [0, 1, 2]
    assert [e.info["param_sha256"] for e in got] == ["sha-0", "sha-1", "sha-2"]
    assert [e.info["param"] for e in got] == ["p0", "p1", "p2"]
