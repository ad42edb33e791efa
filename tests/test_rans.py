"""jaxguard.format.rans: exact round trips, model arithmetic, a hand-checked byte layout,
golden buffers, and a decoder that refuses corrupt input with RansError."""
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxguard.format import rans

GOLDEN = Path(__file__).parent / "golden" / "rans_v1.npz"


def _coded(n, nb):
    return np.arange(256)[None] < np.minimum(256, n - 256 * np.arange(nb))[:, None]


def _case(rng, n, bits, kind):
    nb = bits.shape[-1]
    size = bits.shape + (256,)
    if kind == "uniform":
        sym = rng.integers(0, 1 << 8, size=size) % (1 << bits)[..., None]
    elif kind == "skewed":
        sym = (rng.geometric(0.3, size=size) - 1) % (1 << bits)[..., None]
    elif kind == "single-symbol":
        sym = np.full(size, 3) % (1 << bits)[..., None]
    else:
        raise ValueError(kind)
    return np.where(_coded(n, nb), sym, 0).astype(np.uint8)


@pytest.mark.parametrize("kind", ["uniform", "skewed", "single-symbol"])
@pytest.mark.parametrize("n", [0, 1, 255, 256, 257, 1000, 256 * 12])
@pytest.mark.parametrize("streams", [1, 2])
def test_round_trip(kind, n, streams):
    rng = np.random.default_rng(n * 7 + streams)
    nb = max(1, -(-n // 256))
    bits = rng.integers(4, 9, size=(streams, nb))
    sym = _case(rng, n, bits, kind)
    if streams == 1:
        sym, bits = sym[0], bits[0]
    buf = rans.encode(sym, bits, n)
    out = rans.decode(buf, bits, n)
    assert out.dtype == np.uint8 and out.shape == sym.shape
    np.testing.assert_array_equal(out, sym)
    assert rans.encoded_size(sym, bits, n) == len(buf)


@pytest.mark.parametrize("width", range(0, 9))
def test_every_width(width):
    rng = np.random.default_rng(width)
    n = 256 * 3 + 5
    bits = np.full(4, width)
    sym = _case(rng, n, bits, "uniform")
    buf = rans.encode(sym, bits, n)
    np.testing.assert_array_equal(rans.decode(buf, bits, n), sym)
    if width == 0:   # one symbol of probability 1 costs nothing: lane states only
        assert len(buf) == 1 + 1 + 2 + 4 * 4


def test_compresses_to_near_entropy():
    rng = np.random.default_rng(1)
    n = 256 * 200
    bits = np.full(200, 8)
    sym = np.clip(rng.normal(128, 6, size=(200, 256)).round(), 0, 255).astype(np.uint8)
    p = np.bincount(sym.ravel()) / sym.size
    entropy = -(p[p > 0] * np.log2(p[p > 0])).sum() * n / 8
    size = len(rans.encode(sym, bits, n))
    assert entropy < size < 1.01 * entropy + 4 * 200 + 200, (size, entropy)


def test_shared_lanes_and_external_models():
    rng = np.random.default_rng(2)
    n = 256 * 5 - 3
    bits = np.stack([np.full(5, 7), np.array([4, 5, 6, 7, 8])])
    sym = _case(rng, n, bits, "skewed")
    models = rans.fit_models(sym, bits, n)
    inline = rans.encode(sym, bits, n, models)
    ext = rans.encode(sym, bits, n, models, inline_models=False)
    assert len(inline) == len(ext) + len(rans.encode_models(models))
    np.testing.assert_array_equal(rans.decode(ext, bits, n, models=models), sym)
    got, end = rans.decode_models(rans.encode_models(models), 2)
    assert end == len(rans.encode_models(models))
    for a, b in zip(got, models):
        assert sorted(a) == sorted(b)
        for w in a:
            assert a[w][0] == b[w][0] and (a[w][1] == b[w][1]).all()
    # two streams in one lane pay one state per block, not two
    split = len(rans.encode(sym[0], bits[0], n)) + len(rans.encode(sym[1], bits[1], n))
    assert len(inline) < split


def test_byte_layout_hand_checked():
    # width 1, P = 1, levels (15, 15): f = (1, 1), c = (0, 1).  Encoding 1, 0, 1 backwards
    # from x = 2**16: x -> 2x + s each step (no renormalization) = 524293 = 0x00080005.
    models = [{1: (1, np.array([15, 15]))}]
    buf = rans.encode(np.array([[1, 0, 1] + [0] * 253]), np.array([1]), 3, models)
    assert buf == bytes([0x01, 0x01, 0x11, 0xFF, 0x05, 0x00, 0x08, 0x00])
    np.testing.assert_array_equal(rans.decode(buf, np.array([1]), 3)[0, :3], [1, 0, 1])


@given(st.lists(st.integers(0, 255), min_size=1, max_size=256), st.integers(8, 15))
def test_model_freqs_sum_and_floor(hist, p):
    hist = np.array(hist)
    if not hist.any():
        hist[0] = 1
    width = max(0, int(np.ceil(np.log2(hist.size))))
    hist = np.concatenate([hist, np.zeros((1 << width) - hist.size, np.int64)])
    for shift in range(4):
        lv = rans.quantize_levels(hist, shift)
        f = rans.model_freqs(lv, p)
        assert f.sum() == 1 << p
        assert ((f >= 1) == (hist > 0)).all()


@given(st.integers(0, 1500), st.integers(0, 2**32 - 1), st.integers(1, 2), st.sampled_from([0.05, 0.5, 1.0]))
def test_round_trip_property(n, seed, streams, geo):
    rng = np.random.default_rng(seed)
    nb = max(1, -(-n // 256))
    bits = rng.integers(0, 9, size=(streams, nb))
    sym = (rng.geometric(geo, size=(streams, nb, 256)) - 1) % (1 << bits)[..., None]
    sym = np.where(_coded(n, nb), sym, 0).astype(np.uint8)
    buf = rans.encode(sym, bits, n)
    np.testing.assert_array_equal(rans.decode(buf, bits, n), sym)


# ---------------------------------------------------------------- golden vectors
def test_golden_v1_decodes_identically():
    g = np.load(GOLDEN)
    names = list(g["names"])
    assert names == ["one-symbol", "partial", "mixed-widths", "skewed-8bit", "empty", "width0", "external"]
    ext_models = rans.decode_models(g["external_models"].tobytes(), 2)[0]
    for k, name in enumerate(names):
        n, sym, bits, buf = int(g[f"n_{k}"]), g[f"symbols_{k}"], g[f"bits_{k}"], g[f"buf_{k}"].tobytes()
        models = ext_models if name == "external" else None
        np.testing.assert_array_equal(rans.decode(buf, bits, n, models=models), sym, err_msg=name)
        # the coder (given the stored models) still writes the same bytes
        stored = models if models is not None else rans.decode_models(buf, bits.shape[0], 1)[0]
        assert rans.encode(sym, bits, n, stored, inline_models=models is None) == buf, name


# ---------------------------------------------------------------- corrupt input
def _sample():
    rng = np.random.default_rng(3)
    n = 256 * 3 + 40
    bits = np.stack([np.array([8, 6, 7, 5]), np.array([7, 7, 4, 8])])
    sym = _case(rng, n, bits, "skewed")
    return sym, bits, n, rans.encode(sym, bits, n)


def test_every_truncation_is_refused():
    sym, bits, n, buf = _sample()
    for cut in range(len(buf)):
        with pytest.raises(rans.RansError):
            rans.decode(buf[:cut], bits, n)


def test_bit_flips_are_refused_or_harmless():
    sym, bits, n, buf = _sample()
    rng = np.random.default_rng(4)
    refused = 0
    for pos in rng.choice(len(buf), size=300, replace=True):
        bad = bytearray(buf)
        bad[pos] ^= 1 << int(rng.integers(8))
        try:
            out = rans.decode(bytes(bad), bits, n)
        except rans.RansError as exc:
            assert "\n" not in str(exc)
            refused += 1
        else:      # only a flip in an unused level nibble can decode, and then to the same symbols
            np.testing.assert_array_equal(out, sym)
    assert refused >= 250


@pytest.mark.parametrize("mutate, match", [
    (lambda b: b"", "kind byte"),
    (lambda b: b"\x07" + b[1:], "kind byte"),
    (lambda b: b + b"\x00\x00", "left over"),
    (lambda b: b + b"\x00", "whole"),
    (lambda b: b[:1] + b"\x0b" + b[2:], "declares 11 models"),
    (lambda b: b[:2] + bytes([0x90]) + b[3:], "model byte"),
    (lambda b: b[:2] + bytes([(b[2] & 0xF0) | 3]) + b[3:], "model byte"),
])
def test_malformed_buffers(mutate, match):
    sym, bits, n, buf = _sample()
    with pytest.raises(rans.RansError, match=match):
        rans.decode(mutate(buf), bits, n)


def test_wrong_arguments():
    sym, bits, n, buf = _sample()
    with pytest.raises(rans.RansError, match="cannot hold"):
        rans.decode(buf, bits, n + 256)
    with pytest.raises(rans.RansError):
        rans.decode(buf, bits[:, ::-1], n)            # other widths: missing model or a broken lane
    with pytest.raises(rans.RansError, match="do not pass models"):
        rans.decode(buf, bits, n, models=rans.fit_models(sym, bits, n))
    ext = rans.encode(sym, bits, n, inline_models=False)
    with pytest.raises(rans.RansError, match="pass the shared models"):
        rans.decode(ext, bits, n)
    with pytest.raises(rans.RansError, match="does not fit"):
        rans.encode(np.full((4, 256), 200), np.full(4, 7), n)
    with pytest.raises(rans.RansError, match="outside 0..8"):
        rans.encode(np.zeros((4, 256)), np.full(4, 9), n)
    with pytest.raises(rans.RansError, match="frequency 0"):
        rans.encode(sym, bits, n, rans.fit_models(np.zeros_like(sym), bits, n))
    assert issubclass(rans.RansError, ValueError)


def test_lane_states_checked():
    sym, bits, n, buf = _sample()
    models_end = rans.decode_models(buf, 2, 1)[1]
    bad = bytearray(buf)
    bad[models_end:models_end + 4] = (5).to_bytes(4, "little")
    with pytest.raises(rans.RansError, match="below 2\\*\\*16"):
        rans.decode(bytes(bad), bits, n)


def test_sizes_checked_before_allocating():
    sym, bits, n, buf = _sample()
    big = 1 << 24                                  # 65,536 lanes claimed, 4 in the buffer
    wide = np.tile(bits, (1, big // 256 // bits.shape[1]))
    with pytest.raises(rans.RansError, match="cannot hold 65536 lane states"):
        rans.decode(buf, wide, big)


def test_lane_tails_ride_free():
    sym, bits, n, buf = _sample()
    models = rans.decode_models(buf, 2, 1)[0]
    tails = np.array([0, 1, 0xBEEF, 0xFFFF])
    tb = rans.encode(sym, bits, n, models, lane_tails=tails)
    assert len(buf) <= len(tb) <= len(buf) + 2 * tails.size     # 64 bits stored for at most 4 more
    out, got = rans.decode(tb, bits, n, lane_tails=True)
    np.testing.assert_array_equal(out, sym)
    np.testing.assert_array_equal(got, tails)
    with pytest.raises(rans.RansError, match="pass lane_tails=True"):
        rans.decode(tb, bits, n)
    with pytest.raises(rans.RansError, match="pass lane_tails=False"):
        rans.decode(buf, bits, n, lane_tails=True)
    with pytest.raises(rans.RansError, match="0..65535"):
        rans.encode(sym, bits, n, lane_tails=[0, 1, 2, 1 << 16])


def test_decode_many_is_decode_per_buffer():
    rng = np.random.default_rng(5)
    items, want = [], []
    for k, n in enumerate([1, 256, 700, 0, 256 * 6 + 9]):
        nb = max(1, -(-n // 256))
        bits = rng.integers(0, 9, size=(2, nb))
        sym = _case(rng, n, bits, "skewed")
        if k == 2:       # one buffer with external models
            models = rans.fit_models(sym, bits, n)
            items.append((rans.encode(sym, bits, n, models, inline_models=False), bits, n, models))
        else:
            items.append((rans.encode(sym, bits, n), bits, n))
        want.append(sym)
    got = rans.decode_many(items)
    for g, w, it in zip(got, want, items):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(rans.decode(*it[:3], models=it[3] if len(it) > 3 else None), w)
    bad = list(items)
    bad[1] = (bad[1][0][:-2],) + bad[1][1:]          # truncate the second buffer only
    with pytest.raises(rans.RansError, match=r"rans\[1\]"):
        rans.decode_many(bad)
    assert rans.decode_many([]) == []
    tail_empty = rans.decode_many(items[:2] + [items[3]])          # an empty tensor last
    np.testing.assert_array_equal(tail_empty[2], want[3])
