"""`writer.to_file`'s `release` (what `jaxguard compress` drops from its memory-mapped
checkpoint): everything once before the stream starts, a raw array only after the
container writer copied it, and the moment sources again every `RERELEASE_EVERY` raw
entries; payload and decoded hashes are those written without `release`."""
from __future__ import annotations

import numpy as np
import pytest

from jaxguard import writer
from jaxguard.core.config import GuardConfig
from jaxguard.format import container, reader


def _records():
    rng = np.random.default_rng(0)
    jobs = []
    for i in range(3):
        m = rng.normal(0, 1e-3, 700).astype(np.float32)
        v = (m * m + 1e-8).astype(np.float32)
        p = rng.normal(0, 1, 700).astype(np.float32)
        jobs.append(writer.MomentJob(f"opt/{i}", m, v, p, GuardConfig(lr=1e-3, step=10), {"param": f"p{i}"},
                                     source=(m, v, p)))
    raws = [container.Raw(f"raw/{k}", np.full(3 + k, k, np.int64)) for k in range(5)]
    return jobs + raws


def test_release_order_and_same_file(tmp_path, monkeypatch):
    monkeypatch.setattr(writer, "RERELEASE_EVERY", 2)
    recs = _records()
    log = []
    add = container.PayloadSink.add

    def spy_add(self, arr):
        log.append(("written", id(arr)))
        return add(self, arr)
    monkeypatch.setattr(container.PayloadSink, "add", spy_add)

    def release(arrays):
        log.append(("released", [id(a) for s in arrays for a in (s if isinstance(s, tuple) else (s,))]))
    writer.to_file(tmp_path / "a.jg", recs, {"framework": "test"}, release=release)
    first = log[0]
    assert first[0] == "released"            # before anything was written: every source and raw
    ids = {id(a) for r in recs[:3] for a in r.source} | {id(r.array) for r in recs[3:]}
    assert set(first[1]) == ids
    for r in recs[3:]:                       # each raw released (after the first) only once written
        w = log.index(("written", id(r.array)))
        rel = [i for i, (kind, x) in enumerate(log) if kind == "released" and i > 0 and id(r.array) in x]
        assert rel and min(rel) > w, r.name
    source_ids = {id(a) for r in recs[:3] for a in r.source}
    again = [i for i, (kind, x) in enumerate(log) if kind == "released" and i > 0 and set(x) == source_ids]
    assert len(again) >= 2                    # 5 raws, every 2nd: the sources twice more
    monkeypatch.setattr(container.PayloadSink, "add", add)
    writer.to_file(tmp_path / "b.jg", _records(), {"framework": "test"})
    heads = [reader.parse((tmp_path / f).read_bytes())[0] for f in ("a.jg", "b.jg")]
    for key in ("payload_sha256", "decoded_sha256"):
        assert heads[0][key] == heads[1][key], key


@pytest.mark.parametrize("threads", ["1", "3"])
def test_large_job_in_pieces_writes_the_same_container(tmp_path, monkeypatch, threads):
    """A tensor over `PIECES_OVER` slabs is certified in slab-sized pieces, each a task of
    the encode threads: the payload and decoded hashes and every entry's codes are those
    of one piece, with one encode thread or several."""
    monkeypatch.setenv("JAXGUARD_ENCODE_THREADS", threads)
    rng = np.random.default_rng(3)
    n = 37 * 1000 + 5                          # not whole blocks
    v = rng.lognormal(-14, 2, n).astype(np.float32)
    m = (rng.normal(0, 1, n) * np.sqrt(v) * 0.3).astype(np.float32)
    p = rng.normal(0, 0.05, n).astype(np.float32)
    m[17], v[30000] = np.nan, -1.0             # escapes in two pieces

    def recs():
        return [writer.MomentJob("big", m.reshape(37005, 1), v.reshape(37005, 1), p.reshape(37005, 1),
                                 GuardConfig(lr=1e-3, step=100), {"param": "w"}),
                container.Raw("r", np.arange(3))]
    whole = list(writer.container_entries(recs(), slab=1 << 20))
    pieced = list(writer.container_entries(recs(), slab=4096))
    assert whole[0].encoded.shape == pieced[0].encoded.shape == (37005, 1)
    for k in ("m_codes", "v_codes", "m_params", "v_params", "escape_index", "escape_m", "escape_v"):
        np.testing.assert_array_equal(np.asarray(pieced[0].encoded.arrays[k]), np.asarray(whole[0].encoded.arrays[k]))
    assert pieced[0].encoded.stats["escapes"] == whole[0].encoded.stats["escapes"] >= 2
    dm, dv = pieced[0].encoded.decoded            # the certified values stay in their pieces
    assert isinstance(dm, container.Pieces) and len(dm.parts) == -(-n // 4096)
    for got, want in ((dm, whole[0].encoded.decoded[0]), (dv, whole[0].encoded.decoded[1])):
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32))
        at = np.array([0, 4095, 4096, 20000, n - 1])
        np.testing.assert_array_equal(got.take(at).view(np.uint32), np.asarray(want)[at].view(np.uint32))
    heads = []
    for name, slab in (("w.jg", 1 << 20), ("p.jg", 4096)):
        writer.to_file(tmp_path / name, recs(), {"framework": "test"}, slab=slab)
        heads.append(reader.parse((tmp_path / name).read_bytes())[0])
    for key in ("payload_sha256", "decoded_sha256"):
        assert heads[0][key] == heads[1][key], key
    bad = list(writer.container_entries(recs(), slab=4096))  # a certified value off inside a later piece: refused
    part = bad[0].encoded.decoded[1].parts[4]
    part[3] = np.nextafter(part[3], np.float32(np.inf))
    with pytest.raises(container.ContainerError, match="coordinate 16387 .*nothing was written"):
        container.build(bad, {"framework": "test"})
    calls = []                                  # each piece's inputs released once certified
    job = recs()[0]
    job = writer.MomentJob(job.name, job.m, job.v, job.p, job.config, job.info, source=(job.m, job.v, job.p))
    list(writer.container_entries([job], slab=4096, release=calls.append))
    pieces = [c for c in calls if len(c) == 3 and all(isinstance(a, np.ndarray) and a.size <= 4096 for a in c)]
    assert len(pieces) == -(-n // 4096) and all(np.shares_memory(c[0], m) for c in pieces)


def test_pieces_of_a_cpu_jax_array_are_host_views():
    """`jaxguard compress` hands torch tensors to the writer as CPU JAX arrays (DLPack):
    their pieces are numpy views of the tensor (no eager JAX slice, no copy) and encode
    to the codes of the numpy route."""
    import jax.numpy as jnp
    rng = np.random.default_rng(5)
    n = 9 * 1024 + 7
    v = rng.lognormal(-14, 2, n).astype(np.float32)
    m = (rng.normal(0, 1, n) * np.sqrt(v) * 0.3).astype(np.float32)
    p = rng.normal(0, 0.05, n).astype(np.float32)
    mj, vj, pj = (jnp.asarray(x) for x in (m, v, p))
    cfg = GuardConfig(lr=1e-3, step=100)
    out = {}
    for kind, arrays in (("numpy", (m, v, p)), ("jax", (mj, vj, pj))):
        calls = []
        job = writer.MomentJob("big", *arrays, cfg, {"param": "w"}, source=arrays)
        out[kind] = list(writer.container_entries([job], slab=4096, release=calls.append))[0].encoded
        pieces = [c for c in calls if len(c) == 3 and all(isinstance(a, np.ndarray) and a.size <= 4096 for a in c)]
        assert len(pieces) == -(-n // 4096), kind
        if kind == "jax":
            host = np.asarray(mj)
            assert all(np.shares_memory(c[0], host) for c in pieces)
    for k in ("m_codes", "v_codes", "m_params", "v_params", "escape_index", "escape_m", "escape_v"):
        np.testing.assert_array_equal(np.asarray(out["jax"].arrays[k]), np.asarray(out["numpy"].arrays[k]))


@pytest.mark.parametrize("order", ["sorted", "shuffled", "2-d"])
def test_pieces_take_gathers_across_pieces_in_any_order(order):
    """`Pieces.take` is ``np.asarray(pieces)[idx]``: across empty pieces, at their edges, with
    repeats, for sorted positions (the writer's sample), shuffled ones, and a 2-d index."""
    rng = np.random.default_rng(5)
    parts = [rng.standard_normal(k).astype(np.float32) for k in (7, 0, 1, 300, 0, 64, 2)]
    pieces = container.Pieces(parts)
    whole = np.concatenate(parts)
    edges = np.concatenate([pieces.offsets[1:] - 1, pieces.offsets[:-1]])
    idx = np.concatenate([edges[edges < whole.size], rng.integers(0, whole.size, 500), [0, 0, whole.size - 1]])
    idx = {"sorted": np.sort(idx), "shuffled": idx, "2-d": idx[:500].reshape(20, 25)}[order]
    got = pieces.take(idx)
    assert got.shape == idx.shape
    np.testing.assert_array_equal(got.view(np.uint32), whole[idx].view(np.uint32))
