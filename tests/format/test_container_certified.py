"""The decoded hash records the values the guard certified (`Encoded.decoded`).

The writer hashes the guard's own decode instead of decoding every entry again, and
checks a sample of blocks (`container.SAMPLE_EVERY`) with the numpy reader; a value that
disagrees outside the sample is caught by `jaxguard verify` / restore.
"""
from __future__ import annotations

import numpy as np
import pytest

from jaxguard.cli.main import main as cli_main
from jaxguard.core import guard
from jaxguard.errors import ContainerError
from jaxguard.format import container, reader, spec

CODECS = ("log8-rel", "logrel-aw", "logrel-ans", "log8", "block8", "bf16")
N = spec.BLOCK * (container.SAMPLE_EVERY + 5) + 77      # 70 blocks, the last one partial


def _moments(n, seed=0):
    rng = np.random.default_rng(seed)
    m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    v = (rng.random(n) * 1e-6).astype(np.float32)
    p = rng.standard_normal(n).astype(np.float32)
    m[3], v[10], m[20] = np.nan, np.inf, 2.0**-100     # escapes in block 0
    return m, v, p


def _encode(codec, n=N):
    cfg = guard.GuardConfig(lr=1e-3, step=10, codec=codec)
    return guard.encode(*_moments(n), cfg, keep_decoded=True), cfg.to_json()


@pytest.mark.parametrize("codec", CODECS)
def test_certified_values_are_what_every_decoder_restores(codec):
    enc, info = _encode(codec)
    mt, vt = (np.asarray(x).reshape(-1) for x in guard.decode(enc))
    m_dec, v_dec = enc.decoded
    assert np.array_equal(m_dec.view(np.uint32), mt.view(np.uint32))
    assert np.array_equal(v_dec.view(np.uint32), vt.view(np.uint32))
    data = container.build([container.Moments("x", enc, info)], {})
    header, payload = reader.parse(data)
    assert reader.decoded_digest(header, payload) == header["decoded_sha256"]
    # the reader's full decode (no certified values at hand) writes the very same bytes
    plain = guard.Encoded(enc.arrays, enc.codec, enc.shape, enc.stats)
    assert plain.decoded is None
    assert container.build([container.Moments("x", plain, info)], {}) == data


def _tampered(enc, coordinate):
    m, v = (x.copy() for x in enc.decoded)
    m[coordinate] = np.nextafter(m[coordinate], np.float32(np.inf))
    return guard.Encoded(enc.arrays, enc.codec, enc.shape, enc.stats, decoded=(m, v))


@pytest.mark.parametrize("codec", ("log8-rel", "logrel-ans"))
@pytest.mark.parametrize("block", (0, container.SAMPLE_EVERY, -1))
def test_writer_refuses_certified_values_the_reader_disagrees_with_in_the_sample(codec, block, tmp_path):
    enc, info = _encode(codec)
    nb = -(-N // spec.BLOCK)
    i = (block % nb) * spec.BLOCK + 1
    with pytest.raises(ContainerError, match=r"entry 'x'.*coordinate %d" % i):
        container.build([container.Moments("x", _tampered(enc, i), info)], {})
    out = tmp_path / "c.jg"
    out.write_bytes(b"old")
    with pytest.raises(ContainerError, match="entry 'x'"):
        container.write_stream(out, iter([container.Moments("x", _tampered(enc, i), info)]), {})
    assert out.read_bytes() == b"old"     # nothing was written


def test_disagreement_outside_the_sample_fails_verify_and_restore(tmp_path, capsys):
    enc, info = _encode("log8-rel")
    i = 5 * spec.BLOCK + 7                      # block 5 is not in the writer's sample
    out = tmp_path / "c.jg"
    container.write_stream(out, [container.Moments("x", _tampered(enc, i), info)], {"framework": "none"})
    with pytest.raises(reader.ReaderError, match="decoded moments BLAKE3 mismatch"):
        reader.verify_file(out)
    with pytest.raises(ContainerError, match="decoded moments BLAKE3 mismatch"):
        container.read(out)
    header, payload, tables = container.read(out, verify_decoded=False)
    with pytest.raises(ContainerError, match="decoded moments BLAKE3 mismatch"):
        container.entries_by_name(header, payload, tables, verify_decoded=True)
    capsys.readouterr()
    assert cli_main(["verify", str(out)]) != 0
    got = capsys.readouterr()
    lines = [ln for ln in (got.out + got.err).splitlines() if ln.strip()]
    assert len(lines) == 1 and "decoded moments BLAKE3 mismatch" in lines[0], lines
    # the untampered values verify
    good = tmp_path / "good.jg"
    container.write_stream(good, [container.Moments("x", enc, info)], {"framework": "none"})
    assert reader.verify_file(good)["decoded_sha256"] == reader.parse(good.read_bytes())[0]["decoded_sha256"]


def test_certified_values_of_the_wrong_size_are_refused():
    enc, info = _encode("log8-rel", n=1000)
    bad = guard.Encoded(enc.arrays, enc.codec, enc.shape, enc.stats, decoded=(enc.decoded[0][:-1], enc.decoded[1]))
    with pytest.raises(ContainerError, match=r"entry 'x'.*float32\[1000\]"):
        container.build([container.Moments("x", bad, info)], {})


def test_decoded_values_only_when_asked_for():
    m, v, p = _moments(1000)
    assert guard.encode(m, v, p, guard.GuardConfig(lr=1e-3, step=10)).decoded is None


def test_decoded_values_are_not_a_pytree_leaf():
    import jax
    enc, _ = _encode("log8-rel", n=1000)
    assert enc.decoded is not None
    mapped = jax.tree_util.tree_map(lambda x: x, enc)
    assert mapped.decoded is None             # a transformed encoding is decoded again by the writer


def test_joint_rescued_coordinates_are_hashed_as_their_new_codes_decode():
    m, v, p = _moments(N, seed=3)
    cfg = guard.GuardConfig(lr=1e-3, step=10, codec="log8-rel", joint=True, tau=0.002)
    enc = guard.encode(m, v, p, cfg, keep_decoded=True)
    assert enc.stats["joint_rescued"] > 0
    mt, vt = (np.asarray(x).reshape(-1) for x in guard.decode(enc))
    assert np.array_equal(enc.decoded[0].view(np.uint32), mt.view(np.uint32))
    assert np.array_equal(enc.decoded[1].view(np.uint32), vt.view(np.uint32))
    data = container.build([container.Moments("x", enc, cfg.to_json())], {})
    header, payload = reader.parse(data)
    assert reader.decoded_digest(header, payload) == header["decoded_sha256"]
