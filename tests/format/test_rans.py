"""jaxguard.format.rans: exact round trips, model arithmetic, a hand-checked byte layout,
golden buffers, and a decoder that refuses corrupt input with RansError."""
import re
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jaxguard.format import rans, rans_fit

GOLDEN = Path(__file__).parent.parent / "golden" / "rans_v1.npz"


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
    buf = rans.encode_streams(sym, bits, n)
    out = rans.decode_streams(buf, bits, n)
    assert out.dtype == np.uint8 and out.shape == sym.shape
    np.testing.assert_array_equal(out, sym)
    assert rans.encoded_size(sym, bits, n) == len(buf)


@pytest.mark.parametrize("width", range(0, 9))
def test_every_width(width):
    rng = np.random.default_rng(width)
    n = 256 * 3 + 5
    bits = np.full(4, width)
    sym = _case(rng, n, bits, "uniform")
    buf = rans.encode_streams(sym, bits, n)
    np.testing.assert_array_equal(rans.decode_streams(buf, bits, n), sym)
    if width == 0:   # one symbol of probability 1 costs nothing: lane states only
        assert len(buf) == 1 + 1 + 2 + 4 * 4


def test_compresses_to_near_entropy():
    rng = np.random.default_rng(1)
    n = 256 * 200
    bits = np.full(200, 8)
    sym = np.clip(rng.normal(128, 6, size=(200, 256)).round(), 0, 255).astype(np.uint8)
    p = np.bincount(sym.ravel()) / sym.size
    entropy = -(p[p > 0] * np.log2(p[p > 0])).sum() * n / 8
    size = len(rans.encode_streams(sym, bits, n))
    assert entropy < size < 1.01 * entropy + 4 * 200 + 200, (size, entropy)


def test_shared_lanes_and_external_models():
    rng = np.random.default_rng(2)
    n = 256 * 5 - 3
    bits = np.stack([np.full(5, 7), np.array([4, 5, 6, 7, 8])])
    sym = _case(rng, n, bits, "skewed")
    models = rans.fit_models(sym, bits, n)
    inline = rans.encode_streams(sym, bits, n, models)
    ext = rans.encode_streams(sym, bits, n, models, inline_models=False)
    assert len(inline) == len(ext) + len(rans.encode_models(models))
    np.testing.assert_array_equal(rans.decode_streams(ext, bits, n, models=models), sym)
    got, end = rans.decode_models(rans.encode_models(models), 2)
    assert end == len(rans.encode_models(models))
    for a, b in zip(got, models):
        assert sorted(a) == sorted(b)
        for w in a:
            assert a[w][0] == b[w][0] and (a[w][1] == b[w][1]).all()
    # two streams in one lane pay one state per block, not two
    split = len(rans.encode_streams(sym[0], bits[0], n)) + len(rans.encode_streams(sym[1], bits[1], n))
    assert len(inline) < split


def test_byte_layout_hand_checked():
    # width 1, P = 1, levels (15, 15): f = (1, 1), c = (0, 1).  Encoding 1, 0, 1 backwards
    # from x = 2**16: x -> 2x + s each step (no renormalization) = 524293 = 0x00080005.
    models = [{1: (1, np.array([15, 15]))}]
    buf = rans.encode_streams(np.array([[1, 0, 1] + [0] * 253]), np.array([1]), 3, models)
    assert buf == bytes([0x01, 0x01, 0x11, 0xFF, 0x05, 0x00, 0x08, 0x00])
    np.testing.assert_array_equal(rans.decode_streams(buf, np.array([1]), 3)[0, :3], [1, 0, 1])


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
    buf = rans.encode_streams(sym, bits, n)
    np.testing.assert_array_equal(rans.decode_streams(buf, bits, n), sym)


# ---------------------------------------------------------------- golden vectors
def test_golden_v1_decodes_identically():
    g = np.load(GOLDEN)
    names = list(g["names"])
    assert names == ["one-symbol", "partial", "mixed-widths", "skewed-8bit", "empty", "width0", "external"]
    ext_models = rans.decode_models(g["external_models"].tobytes(), 2)[0]
    for k, name in enumerate(names):
        n, sym, bits, buf = int(g[f"n_{k}"]), g[f"symbols_{k}"], g[f"bits_{k}"], g[f"buf_{k}"].tobytes()
        models = ext_models if name == "external" else None
        np.testing.assert_array_equal(rans.decode_streams(buf, bits, n, models=models), sym, err_msg=name)
        # the coder (given the stored models) still writes the same bytes
        stored = models if models is not None else rans.decode_models(buf, bits.shape[0], 1)[0]
        assert rans.encode_streams(sym, bits, n, stored, inline_models=models is None) == buf, name


# ---------------------------------------------------------------- corrupt input
def _sample():
    rng = np.random.default_rng(3)
    n = 256 * 3 + 40
    bits = np.stack([np.array([8, 6, 7, 5]), np.array([7, 7, 4, 8])])
    sym = _case(rng, n, bits, "skewed")
    return sym, bits, n, rans.encode_streams(sym, bits, n)


def test_every_truncation_is_refused():
    sym, bits, n, buf = _sample()
    for cut in range(len(buf)):
        with pytest.raises(rans.RansError):
            rans.decode_streams(buf[:cut], bits, n)


def test_bit_flips_are_refused_or_harmless():
    sym, bits, n, buf = _sample()
    rng = np.random.default_rng(4)
    refused = 0
    for pos in rng.choice(len(buf), size=300, replace=True):
        bad = bytearray(buf)
        bad[pos] ^= 1 << int(rng.integers(8))
        try:
            out = rans.decode_streams(bytes(bad), bits, n)
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
        rans.decode_streams(mutate(buf), bits, n)


def test_wrong_arguments():
    sym, bits, n, buf = _sample()
    with pytest.raises(rans.RansError, match="cannot hold"):
        rans.decode_streams(buf, bits, n + 256)
    with pytest.raises(rans.RansError):
        rans.decode_streams(buf, bits[:, ::-1], n)            # other widths: missing model or a broken lane
    with pytest.raises(rans.RansError, match="do not pass models"):
        rans.decode_streams(buf, bits, n, models=rans.fit_models(sym, bits, n))
    ext = rans.encode_streams(sym, bits, n, inline_models=False)
    with pytest.raises(rans.RansError, match="pass the shared models"):
        rans.decode_streams(ext, bits, n)
    with pytest.raises(rans.RansError, match="does not fit"):
        rans.encode_streams(np.full((4, 256), 200), np.full(4, 7), n)
    with pytest.raises(rans.RansError, match="needs the compact inline models"):
        rans.encode_streams(np.zeros((4, 256)), np.full(4, 9), n)             # kind 1 models stop at 8 bits
    with pytest.raises(rans.RansError, match="outside 0..12"):
        rans.encode_streams(np.zeros((4, 256)), np.full(4, 13), n, compact_models=True)
    with pytest.raises(rans.RansError, match="frequency 0"):
        rans.encode_streams(sym, bits, n, rans.fit_models(np.zeros_like(sym), bits, n))
    assert issubclass(rans.RansError, ValueError)


def test_lane_states_checked():
    sym, bits, n, buf = _sample()
    models_end = rans.decode_models(buf, 2, 1)[1]
    bad = bytearray(buf)
    bad[models_end:models_end + 4] = (5).to_bytes(4, "little")
    with pytest.raises(rans.RansError, match="below 2\\*\\*16"):
        rans.decode_streams(bytes(bad), bits, n)


def test_sizes_checked_before_allocating():
    sym, bits, n, buf = _sample()
    big = 1 << 24                                  # 65,536 lanes claimed, 4 in the buffer
    wide = np.tile(bits, (1, big // 256 // bits.shape[1]))
    with pytest.raises(rans.RansError, match="cannot hold 65536 lane states"):
        rans.decode_streams(buf, wide, big)


def test_lane_tails_ride_free():
    sym, bits, n, buf = _sample()
    models = rans.decode_models(buf, 2, 1)[0]
    tails = np.array([0, 1, 0xBEEF, 0xFFFF])
    tb = rans.encode_streams(sym, bits, n, models, lane_tails=tails)
    assert len(buf) <= len(tb) <= len(buf) + 2 * tails.size     # 64 bits stored for at most 4 more
    out, got = rans.decode_streams(tb, bits, n, lane_tails=True)
    np.testing.assert_array_equal(out, sym)
    np.testing.assert_array_equal(got, tails)
    with pytest.raises(rans.RansError, match="pass lane_tails=True"):
        rans.decode_streams(tb, bits, n)
    with pytest.raises(rans.RansError, match="pass lane_tails=False"):
        rans.decode_streams(buf, bits, n, lane_tails=True)
    with pytest.raises(rans.RansError, match="0..65535"):
        rans.encode_streams(sym, bits, n, lane_tails=[0, 1, 2, 1 << 16])


def test_decode_many_is_decode_per_buffer():
    rng = np.random.default_rng(5)
    items, want = [], []
    for k, n in enumerate([1, 256, 700, 0, 256 * 6 + 9]):
        nb = max(1, -(-n // 256))
        bits = rng.integers(0, 9, size=(2, nb))
        sym = _case(rng, n, bits, "skewed")
        if k == 2:       # one buffer with external models
            models = rans.fit_models(sym, bits, n)
            items.append((rans.encode_streams(sym, bits, n, models, inline_models=False), bits, n, models))
        else:
            items.append((rans.encode_streams(sym, bits, n), bits, n))
        want.append(sym)
    got = rans.decode_streams_many(items)
    for g, w, it in zip(got, want, items):
        np.testing.assert_array_equal(g, w)
        np.testing.assert_array_equal(rans.decode_streams(*it[:3], models=it[3] if len(it) > 3 else None), w)
    bad = list(items)
    bad[1] = (bad[1][0][:-2],) + bad[1][1:]          # truncate the second buffer only
    with pytest.raises(rans.RansError, match=r"rans\[1\]"):
        rans.decode_streams_many(bad)
    assert rans.decode_streams_many([]) == []
    tail_empty = rans.decode_streams_many(items[:2] + [items[3]])          # an empty tensor last
    np.testing.assert_array_equal(tail_empty[2], want[3])


@pytest.mark.parametrize("batch_slots", [1, 1 << 12, 1 << 16])
def test_decode_many_in_batches_is_one_loop(monkeypatch, batch_slots):
    """decode_many runs one lane loop per batch of buffers whose tables fit BATCH_SLOTS (one
    buffer alone, or a few): the same symbols and tails as one loop over all, and an error
    names the buffer by its position among all of them, not within its batch."""
    rng = np.random.default_rng(8)
    items, want = [], []
    for n in [300, 256 * 3, 5, 0, 256 * 4 + 17, 1000]:
        nb = max(1, -(-n // 256))
        bits = rng.integers(0, 9, size=(2, nb))
        sym = _case(rng, n, bits, "skewed")
        tails = rng.integers(0, 1 << 16, nb)
        items.append((rans.encode_streams(sym, bits, n, lane_tails=tails, compact_models=True), bits, n))
        want.append((sym, tails))
    whole = rans.decode_streams_many(items, lane_tails=True)
    monkeypatch.setattr(rans, "BATCH_SLOTS", batch_slots)
    batched = rans.decode_streams_many(items, lane_tails=True)
    for (s1, t1), (s2, t2), (sym, tails) in zip(whole, batched, want):
        np.testing.assert_array_equal(s1, sym)
        np.testing.assert_array_equal(s2, sym)
        np.testing.assert_array_equal(t2, tails)
        np.testing.assert_array_equal(t1, tails)
    bad = list(items)
    bad[4] = (bad[4][0][:-2],) + bad[4][1:]
    with pytest.raises(rans.RansError, match=r"rans\[4\]"):
        rans.decode_streams_many(bad, "rans", lane_tails=True)


# ---------------------------------------------------------------- compact models (kind 3)
GOLDEN_V2 = Path(__file__).parent.parent / "golden" / "rans_v2.npz"


@pytest.mark.parametrize("width", range(0, 9))
@pytest.mark.parametrize("kind", ["uniform", "skewed", "single-symbol"])
def test_compact_round_trip_every_width(width, kind):
    rng = np.random.default_rng(100 + width)
    n = 256 * 3 + 5
    bits = np.stack([np.full(4, width), np.full(4, max(width - 1, 0))])
    sym = _case(rng, n, bits, kind)
    buf = rans.encode_streams(sym, bits, n, compact_models=True)
    assert buf[0] == rans.KIND_COMPACT
    np.testing.assert_array_equal(rans.decode_streams(buf, bits, n), sym)
    assert rans.encoded_size(sym, bits, n, compact_models=True) == len(buf)


@pytest.mark.parametrize("n", [1, 255, 256, 1000])
def test_compact_round_trip_all_symbols_and_one_symbol(n):
    nb = -(-n // 256)
    for w in (1, 4, 8):
        bits = np.full((2, nb), w)
        every = np.broadcast_to(np.arange(256) % (1 << w), (2, nb, 256))     # all symbols of the alphabet
        one = np.full((2, nb, 256), (1 << w) - 1)                             # the last symbol only
        for sym in (every, one):
            sym = np.where(_coded(n, nb)[None], sym, 0).astype(np.uint8)
            buf = rans.encode_streams(sym, bits, n, compact_models=True)
            np.testing.assert_array_equal(rans.decode_streams(buf, bits, n), sym)


def test_compact_byte_layout_hand_checked():
    # width 1, P = 1, levels (15, 15): bits K=1 (4), width 1 (4), P 1 (4), lo 0 (1), hi 1 (1),
    # mode 0 (4), first knot 15 (4), delta 0 as Exp-Golomb '1' (1), one padding bit:
    # 0x11, 0x21, 0x7C; then the same lane state as kind 1.
    models = [{1: (1, np.array([15, 15]))}]
    buf = rans.encode_streams(np.array([[1, 0, 1] + [0] * 253]), np.array([1]), 3, models, compact_models=True)
    assert buf == bytes([0x03, 0x11, 0x21, 0x7C, 0x05, 0x00, 0x08, 0x00])
    np.testing.assert_array_equal(rans.decode_streams(buf, np.array([1]), 3)[0, :3], [1, 0, 1])


@pytest.mark.parametrize("compact_fit", [False, True])
def test_compact_models_encode_any_levels_exactly(compact_fit):
    """Every model (kind-1 fits with gaps, compact fits) comes back level for level."""
    rng = np.random.default_rng(7)
    n = 256 * 6 + 11
    bits = np.stack([np.array([8, 8, 7, 6, 8, 5, 4]), np.array([7, 7, 7, 8, 8, 4, 0])])
    sym = _case(rng, n, bits, "skewed")
    sym[0, 0, ::7] = 200          # a gap-toothed histogram: levels the knots cannot describe
    models = rans.fit_models(sym, bits, n, compact=compact_fit)
    raw = rans.encode_compact_models(models)
    got, end = rans.decode_compact_models(raw + b"tail", 2)
    assert end == len(raw)
    for a, b in zip(got, models):
        assert sorted(a) == sorted(b)
        for w in a:
            assert a[w][0] == b[w][0]
            np.testing.assert_array_equal(a[w][1], b[w][1])
    assert len(raw) <= len(rans.encode_models(models)) + 2


def test_compact_models_are_much_smaller_on_a_small_smooth_tensor():
    """The CNN case: ~1,000 coordinates of log-spaced codes, where 4-bit levels cost more
    than rANS saves and the compact models do not."""
    rng = np.random.default_rng(8)
    n = 1000
    nb = 4
    bits = np.stack([np.full(nb, 8), np.full(nb, 7)])
    sym = np.stack([np.clip(np.round(rng.laplace(127, 40, (nb, 256))), 0, 254),
                    np.clip(np.round(rng.normal(64, 20, (nb, 256))), 1, 127)]).astype(np.uint8)
    sym = np.where(_coded(n, nb)[None], sym, 0)
    kind1 = rans.encode_streams(sym, bits, n)
    kind3 = rans.encode_streams(sym, bits, n, compact_models=True)
    m1 = len(rans.encode_models(rans.fit_models(sym, bits, n)))
    m3 = len(rans.encode_compact_models(rans.fit_models(sym, bits, n, compact=True)))
    assert m3 * 3 < m1, (m3, m1)
    assert len(kind3) < len(kind1) - 100, (len(kind3), len(kind1))
    packed_bytes = int(((np.minimum(256, n - 256 * np.arange(nb)) * bits).sum(1) + 7).sum() // 8)
    assert len(kind3) < packed_bytes < len(kind1), (len(kind3), packed_bytes, len(kind1))
    np.testing.assert_array_equal(rans.decode_streams(kind3, bits, n), sym)


def _compact_sample():
    sym, bits, n, _ = _sample()
    return sym, bits, n, rans.encode_streams(sym, bits, n, compact_models=True)


def test_compact_every_truncation_is_refused():
    sym, bits, n, buf = _compact_sample()
    for cut in range(len(buf)):
        with pytest.raises(rans.RansError):
            rans.decode_streams(buf[:cut], bits, n)


def test_compact_bit_flips_are_refused_or_harmless():
    """Every single-bit flip of the compact models is refused or decodes to the same
    symbols; flips in the lane states and words are refused but for a few that decode to
    another valid message (the lane end-state check is a checksum of 32 bits per lane, not
    a hash: measured 70 of 4,832 word-bit flips here, 9 of 4,752 for the kind-1 buffer of
    the same symbols; the container's payload and decoded-moments SHA-256 refuse those)."""
    sym, bits, n, buf = _compact_sample()
    end = rans.decode_compact_models(buf, 2, 1)[1]
    rng = np.random.default_rng(9)
    flips = [(pos, bit) for pos in range(end) for bit in range(8)]           # every model bit
    flips += [(int(p), int(b)) for p, b in zip(rng.integers(end, len(buf), 600), rng.integers(0, 8, 600))]
    wrong = refused = 0
    for pos, bit in flips:
        bad = bytearray(buf)
        bad[pos] ^= 1 << bit
        try:
            out = rans.decode_streams(bytes(bad), bits, n)
        except rans.RansError as exc:
            assert "\n" not in str(exc)
            refused += 1
            continue
        if pos < end:
            np.testing.assert_array_equal(out, sym, err_msg=f"model byte {pos} bit {bit}")
        wrong += not np.array_equal(out, sym)
    assert refused >= 0.96 * len(flips) and wrong <= 0.04 * 600, (refused, wrong)


def _from_bits(b):
    b = b + [0] * (-len(b) % 8)
    return np.packbits(np.array(b, np.uint8), bitorder="little").tobytes()


def _field(v, n):
    return [(v >> k) & 1 for k in range(n)]


@pytest.mark.parametrize("fields, match", [
    (_field(10, 4), "declares 10 models"),
    (_field(1, 4) + _field(9, 4) + _field(9, 4), "width must be"),
    (_field(1, 4) + _field(4, 4) + _field(2, 4), "width must be"),             # P below the width
    (_field(1, 4) + _field(4, 4) + _field(8, 4) + _field(9, 4) + _field(3, 4), "hi 3 < lo 9"),
    (_field(1, 4) + _field(4, 4) + _field(8, 4) + _field(0, 4) + _field(15, 4) + _field(9, 4), "mode 9"),
    (_field(1, 4) + _field(4, 4) + _field(8, 4) + _field(0, 4) + _field(15, 4) + _field(15, 4)
     + [0] * 64, "no symbol"),                                                 # raw levels, all 0
    (_field(1, 4) + _field(4, 4) + _field(8, 4) + _field(0, 4) + _field(15, 4) + _field(0, 4)
     + _field(15, 4) + [0, 1, 1], "outside 0..15"),                            # 15 + 1
    (_field(1, 4) + _field(4, 4) + _field(8, 4) + _field(0, 4) + _field(15, 4) + _field(0, 4)
     + _field(1, 4) + [0] * 5 + [1], "longer than"),
    (_field(1, 4) + _field(4, 4) + _field(8, 4) + _field(0, 4) + _field(15, 4) + _field(0, 4)
     + _field(1, 4), "truncated"),                                             # the knot codes end
])
def test_compact_malformed_models(fields, match):
    with pytest.raises(rans.RansError, match=match):
        rans.decode_compact_models(_from_bits(fields), 1)


def _compact_models_reference(buf, streams, max_width):
    """The kind-3/4 model reader written the obvious way, one bit at a time (the format as
    docs/format.md states it): the word-at-a-time reader must agree with it on every input,
    models, end offset and error message alike."""
    raw = np.frombuffer(bytes(buf), np.uint8)[:rans.compact_models_bound(streams, max_width)]
    bits = np.unpackbits(raw, bitorder="little").tolist()
    at = 0

    def get(n, where):
        nonlocal at
        if at + n > len(bits):
            raise rans.RansError(f"rans: truncated inside the compact models ({where})")
        v = sum(bits[at + k] << k for k in range(n))
        at += n
        return v

    models = []
    for st in range(streams):
        k = get(4, f"stream {st} model count")
        if k > max_width + 1:
            raise rans.RansError(f"rans: stream {st} declares {k} models; at most {max_width + 1} widths exist")
        mods = {}
        for _ in range(k):
            w, p = get(4, f"stream {st} width"), get(4, f"stream {st} P")
            if w > max_width or not max(1, w) <= p <= rans.MAX_PROB_BITS or (mods and w <= max(mods)):
                raise rans.RansError(f"rans: stream {st} compact model (width {w}, P {p}): width must be "
                                     f"0..{max_width}, ascending and distinct, P max(1, width)..{rans.MAX_PROB_BITS}")
            where = f"stream {st} width {w}"
            lo, hi, mode = get(w, where), get(w, where), get(4, where)
            if hi < lo:
                raise rans.RansError(f"rans: {where} model has hi {hi} < lo {lo}")
            lv = np.zeros(1 << w, np.int64)
            if mode == rans.COMPACT_RAW:
                lv[lo:hi + 1] = [get(4, where) for _ in range(hi - lo + 1)]
            elif mode <= max_width:
                kpos = list(range(lo, hi, 1 << mode)) + [hi] if hi > lo else [lo]
                kl = [get(4, where)]
                for _ in range(len(kpos) - 1):
                    nz = 0
                    while get(1, where) == 0:
                        nz += 1
                        if nz > 4:
                            raise rans.RansError(f"rans: {where} model has a knot code longer than a level "
                                                 f"delta needs")
                    z = 1
                    for _ in range(nz):
                        z = (z << 1) | get(1, where)
                    z -= 1
                    lvl = kl[-1] + (z // 2 if z % 2 == 0 else -(z + 1) // 2)
                    if not 0 <= lvl <= 15:
                        raise rans.RansError(f"rans: {where} model has a knot level {lvl} outside 0..15")
                    kl.append(lvl)
                for sym in range(lo, hi + 1):   # docs/format.md: round-half-up between knots pa < pb
                    if len(kpos) == 1:
                        lv[sym] = kl[0]
                        continue
                    i = min(max(j for j in range(len(kpos)) if kpos[j] <= sym), len(kpos) - 2)
                    pa, pb, la, lb = kpos[i], kpos[i + 1], kl[i], kl[i + 1]
                    lv[sym] = la + ((lb - la) * (sym - pa) * 2 + (pb - pa)) // (2 * (pb - pa))
            else:
                raise rans.RansError(f"rans: {where} model has mode {mode}; pass 0..{max_width} (knots) or "
                                     f"{rans.COMPACT_RAW} (raw levels)")
            if not lv.any():
                raise rans.RansError(f"rans: {where} model has no symbol")
            mods[w] = (p, lv)
        models.append(mods)
    pad = -at % 8
    if get(pad, "padding") if pad else 0:
        raise rans.RansError("rans: the compact models' padding bits are not 0")
    return models, at // 8


def _outcome(read, *args):
    try:
        models, end = read(*args)
    except rans.RansError as exc:
        return str(exc)
    return end, [{w: (p, lv.tolist()) for w, (p, lv) in m.items()} for m in models]


def test_compact_models_reader_agrees_with_a_bit_by_bit_reader():
    """Fitted models of 1 and 2 streams at widths up to 8 and 12, then random bit flips,
    truncations and random bytes: the same models and end, or the same one-line error."""
    rng = np.random.default_rng(12)
    seeds = []
    for k in range(12):
        S, mw, n = 1 + k % 2, (8, 12)[k % 2], int(rng.choice([37, 256, 1283]))
        nb = -(-n // 256)
        bits = rng.integers(0, mw + 1, size=(S, nb))
        sym = np.round(rng.laplace(0, 1 + 3 * k, size=(S, nb, 256))) + ((1 << bits)[:, :, None] // 2)
        sym = np.clip(sym, 0, (1 << bits)[:, :, None] - 1).astype(np.int64)
        for compact in (False, True):
            seeds.append((rans.encode_compact_models(rans.fit_models(sym, bits, n, compact=compact)), S, mw))
    outcomes = set()
    for i in range(3000):
        buf, S, mw = seeds[i % len(seeds)]
        b = bytearray(buf)
        if i < len(seeds):
            pass                                       # the untouched models first
        elif i % 5 < 3:
            for _ in range(1 + i % 4):
                b[int(rng.integers(len(b)))] ^= 1 << int(rng.integers(8))
        elif i % 5 == 3:
            b = b[:int(rng.integers(len(b) + 1))]
        else:
            b = bytearray(rng.integers(0, 256, int(rng.integers(0, 48)), dtype=np.uint8).tobytes())
        want = _outcome(_compact_models_reference, bytes(b), S, mw)
        assert _outcome(rans.decode_compact_models, bytes(b), S, 0, "rans", mw) == want, (i, want)
        outcomes.add("error" if isinstance(want, str) else "models")
    assert outcomes == {"error", "models"}


def test_compact_padding_and_kind_checked():
    # the hand-checked models (23 bits): their one padding bit set
    with pytest.raises(rans.RansError, match="padding"):
        rans.decode_compact_models(bytes([0x11, 0x21, 0xFC]), 1)
    assert rans.decode_compact_models(bytes([0x11, 0x21, 0x7C]), 1)[1] == 3
    sym, bits, n, buf = _compact_sample()
    models = rans.decode_compact_models(buf, 2, 1)[0]
    with pytest.raises(rans.RansError, match="do not pass models"):
        rans.decode_streams(buf, bits, n, models=models)
    with pytest.raises(rans.RansError, match="kind byte"):
        rans.decode_streams(bytes([0x05]) + buf[1:], bits, n)


def _wide_sample(seed=3):
    rng = np.random.default_rng(seed)
    widths = np.array([[12, 9, 4, 8, 11], [10, 12, 8, 5, 9]])
    n = 5 * 256 - 37
    sym = np.stack([np.minimum(rng.geometric(0.004, (5, 256)), (1 << widths[s])[:, None] - 1) for s in range(2)])
    return sym, widths, n


def test_wide_alphabets_round_trip_in_kind_4():
    """Fields up to 12 bits are rANS-coded whole (kind byte 4, compact models); a buffer
    whose blocks are all <= 8 bits stays kind 3, readable by readers that predate kind 4."""
    sym, bits, n = _wide_sample()
    coded = np.arange(256)[None] < np.array([256] * 4 + [n - 1024])[:, None]
    tails = np.array([1, 2, 3, 0xFFFF, 0])
    buf = rans.encode_streams(sym, bits, n, lane_tails=tails, compact_models=True)
    assert buf[0] == rans.KIND_COMPACT_WIDE | rans.TAILS_FLAG
    out, got = rans.decode_streams(buf, bits, n, lane_tails=True)
    assert out.dtype == np.uint16 and (out[:, coded] == sym[:, coded]).all() and (got == tails).all()
    assert (out[:, ~coded] == 0).all()
    narrow = rans.encode_streams(sym % 256, np.minimum(bits, 8), n, compact_models=True)
    assert narrow[0] == rans.KIND_COMPACT
    plain = rans.encode_streams(sym, bits, n, compact_models=True)
    (o1, o2) = rans.decode_streams_many([(narrow, np.minimum(bits, 8), n), (plain, bits, n)])
    assert (o1[:, coded] == (sym % 256)[:, coded]).all() and (o2[:, coded] == sym[:, coded]).all()
    # models of a 12-bit alphabet cost bits, not 2 KB each (kind 1 would store 4 bits per symbol)
    models_end = rans.decode_compact_models(buf, 2, 1, max_width=rans.MAX_WIDTH)[1]
    assert models_end < 200


def test_wide_alphabets_refused_outside_kind_4():
    sym, bits, n = _wide_sample()
    buf = bytearray(rans.encode_streams(sym, bits, n, compact_models=True))
    assert buf[0] == rans.KIND_COMPACT_WIDE
    buf[0] = rans.KIND_COMPACT                         # same models, but kind 3 stops at 8 bits
    with pytest.raises(rans.RansError, match="at most 8 bits|width must be 0..8"):
        rans.decode_streams(bytes(buf), bits, n)
    with pytest.raises(rans.RansError, match="outside 0..12"):
        rans.decode_streams(bytes(buf), np.full_like(bits, 13), n)


def test_compact_lane_tails_and_decode_many():
    sym, bits, n, buf = _compact_sample()
    tails = np.array([7, 0, 0xFFFF, 0x3F80])
    tb = rans.encode_streams(sym, bits, n, lane_tails=tails, compact_models=True)
    assert tb[0] == rans.KIND_COMPACT | rans.TAILS_FLAG
    (out, got), = rans.decode_streams_many([(tb, bits, n)], lane_tails=True)
    np.testing.assert_array_equal(out, sym)
    np.testing.assert_array_equal(got, tails)
    many = rans.decode_streams_many([(buf, bits, n), (rans.encode_streams(sym, bits, n), bits, n)])     # kinds 3 and 1 together
    for m in many:
        np.testing.assert_array_equal(m, sym)


def test_golden_v2_compact_decodes_identically():
    g = np.load(GOLDEN_V2)
    names = list(g["names"])
    assert names == ["cnn-like", "mixed-widths", "one-symbol", "all-symbols", "width0", "gappy", "tails"]
    for k, name in enumerate(names):
        n, sym, bits, buf = int(g[f"n_{k}"]), g[f"symbols_{k}"], g[f"bits_{k}"], g[f"buf_{k}"].tobytes()
        tails = buf[0] & rans.TAILS_FLAG
        assert buf[0] & 0x0F == rans.KIND_COMPACT, name
        out = rans.decode_streams(buf, bits, n, lane_tails=bool(tails))
        if tails:
            out, t = out
            np.testing.assert_array_equal(t, g[f"tails_{k}"], err_msg=name)
        np.testing.assert_array_equal(out, sym, err_msg=name)
        stored = rans.decode_compact_models(buf, bits.shape[0], 1)[0]
        again = rans.encode_streams(sym, bits, n, stored, compact_models=True,
                            lane_tails=g[f"tails_{k}"] if tails else None)
        assert again == buf, name


def test_encode_many_gives_each_buffer_the_bytes_of_encode_and_names_the_bad_one():
    rng = np.random.default_rng(26)
    items = []
    for n in (1, 255, 256, 300, 0, 2049, 256 * 5):
        nb = max(1, -(-n // 256))
        bits = rng.integers(4, 13, size=(2, nb))
        sym = np.where(_coded(n, nb), (rng.geometric(0.2, size=bits.shape + (256,)) - 1) % (1 << bits)[..., None], 0)
        items.append((sym, bits, n, None, rng.integers(0, 1 << 16, nb)))
    many = rans.encode_streams_many(items, compact_models=True, lane_tails=True)
    assert many == [rans.encode_streams(s, b, n, lane_tails=t, compact_models=True) for s, b, n, _, t in items]
    got = rans.decode_streams_many([(buf, b, n) for buf, (_, b, n, _, _) in zip(many, items)], lane_tails=True)
    for (sym, tails), (s, _, _, _, t) in zip(got, items):
        assert (sym == s).all() and (tails == t).all()
    bad = list(items)
    s, b, n, _, t = bad[3]
    bad[3] = (s, b, n, rans.fit_models(np.zeros_like(s), b, n, compact=True), t)
    with pytest.raises(rans.RansError, match=r"^rans\[3\]: stream 0: a symbol has frequency 0"):
        rans.encode_streams_many(bad, compact_models=True, lane_tails=True)


# ---------------------------------------------------------------- the compact fit against its plain formulas
_W = np.array(rans.LEVEL_WEIGHTS, np.int64)


def _knot_positions(lo, hi, mode):
    """Knots of mode j over [lo, hi]: lo, lo + 2**j, ... below hi, then hi (the format's rule)."""
    return np.concatenate([np.arange(lo, hi, 1 << mode), [hi]]).astype(np.int64) if hi > lo \
        else np.array([lo], np.int64)


def _eg_bits(delta):
    """Bits of each signed delta's Exp-Golomb-0 code of its zigzag."""
    z = np.where(np.asarray(delta) >= 0, 2 * np.asarray(delta), -2 * np.asarray(delta) - 1) + 1
    return 2 * np.floor(np.log2(z)).astype(np.int64) + 1


def _cost_bits(hist, freqs, prob_bits):
    nz = hist > 0
    return float((hist[nz] * (prob_bits - np.log2(freqs[nz]))).sum())

def _smooth_levels_reference(hist, lo, hi, mode):
    """Knot positions of a mode and their levels [4, K] at shifts 0..3 (the formulas before commit 35952bd)."""
    pos = _knot_positions(lo, hi, mode)
    half = (1 << mode) // 2
    c = np.concatenate([[0], np.cumsum(hist)])
    a, b = np.maximum(pos - half, lo), np.minimum(pos + half, hi) + 1
    mean = (c[b] - c[a]) / (b - a)
    with np.errstate(divide="ignore"):
        k = np.round(np.log2(mean / mean.max()) / 0.75) + 15
    k = np.nan_to_num(k[None] + np.arange(4)[:, None], nan=1, neginf=1)
    return pos, np.clip(k, 1, 15).astype(np.int64)


def _interpolate_rows_reference(pos, knot_levels):
    """The format's interpolation between knots, of knot-level rows [B, K]."""
    kl = np.asarray(knot_levels, np.int64)
    if pos.size == 1:
        return kl.copy()
    s = np.arange(pos[0], pos[-1] + 1)
    seg = np.minimum(np.searchsorted(pos, s, side="right") - 1, pos.size - 2)
    pa, pb = pos[seg], pos[seg + 1]
    la, lb = kl[:, seg], kl[:, seg + 1]
    return la + ((lb - la) * (s - pa) * 2 + (pb - pa)) // (2 * (pb - pa))


def _coded_bits_rows_reference(hist, levels, prob_bits):
    """`_cost_bits` under `rans.model_freqs` of level rows [B, A]."""
    lv = np.asarray(levels, np.int64)
    M = 1 << prob_bits
    k = (lv > 0).sum(1)
    w = _W[lv]
    f = np.where(lv > 0, 1 + w * (M - k)[:, None] // w.sum(1)[:, None], 0)
    f[np.arange(lv.shape[0]), np.argmax(lv, axis=1)] += M - f.sum(1)
    nz = hist > 0
    with np.errstate(divide="ignore"):
        return (hist[nz] * (prob_bits - np.log2(f[:, nz]))).sum(1)


def _fit_compact_reference(hist, width, cands):
    """`rans.fit_compact_model` as it was before commit 35952bd (plain formulas, one candidate set a call),
    P by the rule `rans_fit.choose_prob_bits` states: the fast fit must return exactly its (P, levels)."""
    hist = np.asarray(hist, np.int64)
    nz = np.flatnonzero(hist)
    lo, hi = int(nz[0]), int(nz[-1])
    h = hist[lo:hi + 1]
    ref_p = max(cands)
    head = 8 + 2 * width + 4 + 4

    def totals(kl_rows, pos):
        mbits = head + _eg_bits(np.diff(kl_rows, axis=1)).sum(1)
        return _coded_bits_rows_reference(h, _interpolate_rows_reference(pos, kl_rows), ref_p) + mbits

    best = None
    for shift in range(4):
        lv = rans.quantize_levels(hist, shift)
        c = _cost_bits(hist, rans.model_freqs(lv, ref_p), ref_p) + rans.compact_model_bits(lv, width)
        if best is None or c < best[0]:
            best = (c, lv[lo:hi + 1])
    smooth = None
    for mode in range(1, rans.MAX_WIDTH + 1):
        pos, rows = _smooth_levels_reference(hist, lo, hi, mode)
        c = totals(rows, pos)
        i = int(np.argmin(c))
        if smooth is None or c[i] < smooth[0]:
            smooth = (float(c[i]), pos, rows[i])
        if pos.size <= 2:
            break
    c, pos, kl = smooth
    K = kl.size
    step = np.concatenate([np.eye(K, dtype=np.int64), -np.eye(K, dtype=np.int64)])
    for _ in range(8 * K):
        rows = kl[None] + step
        ok = ((rows >= 1) & (rows <= 15)).all(1)
        if not ok.any():
            break
        cs = np.where(ok, totals(np.clip(rows, 1, 15), pos), np.inf)
        i = int(np.argmin(cs))
        if not cs[i] < c:
            break
        c, kl = float(cs[i]), rows[i]
    if c < best[0]:
        best = (c, _interpolate_rows_reference(pos, kl[None])[0])
    lv = np.zeros(1 << width, np.int64)
    lv[lo:hi + 1] = best[1]
    cost = {p: _cost_bits(hist, rans.model_freqs(lv, p), p) for p in cands}
    limit = min(cost.values()) + rans_fit.P_SLACK_BITS + rans_fit.P_SLACK_PER_SYMBOL * float(hist.sum())
    return min(p for p in cands if cost[p] <= limit), lv


def _fit_histograms():
    """(hist, width, cands) cases for the compact fit: random and adversarial."""
    rng = np.random.default_rng(11)
    cases = []
    for width in range(0, 13):
        A = 1 << width
        span = min(A, 300)                        # keeps the plain reference fast at 11-12 bits
        top = rng.integers(0, A - span + 1)
        sym = np.arange(span) + top
        shapes = [np.full(span, 7), np.full(span, 1 << 40), rng.integers(0, 50, span),
                  np.round(1e4 * np.exp(-np.arange(span) / max(1, span / 6))),
                  np.round(2.0 ** rng.uniform(0, 40, span)),
                  rng.geometric(0.05, span) * (rng.random(span) < 0.3),
                  np.round(1e6 * np.exp(-np.abs(np.arange(span) - span / 2) / max(1, span / 10)))]
        for counts in shapes:
            hist = np.zeros(A, np.int64)
            hist[sym] = np.asarray(counts, np.int64)
            cases.append(hist)
        for _ in range(3):                        # single symbol, two symbols, a sparse few
            for k in (1, 2, 5):
                hist = np.zeros(A, np.int64)
                at = rng.choice(A, size=min(k, A), replace=False)
                hist[at] = rng.integers(1, 1 << 40, at.size) if rng.random() < 0.5 else rng.integers(1, 9, at.size)
                cases.append(hist)
    out = []
    for hist in cases:
        if not hist.any():
            hist[0] = 1
        width = int(hist.size).bit_length() - 1
        out.append((hist, width, [p for p in rans.PROB_BITS if p >= width]))
        if rng.random() < 0.3:
            out.append((hist, width, [int(rng.choice(rans.PROB_BITS))]))
    for width in (8, 10):                         # a full-range alphabet, and P below what it needs
        hist = rng.integers(0, 3, 1 << width) * 1000 + 1
        out.append((hist, width, [p for p in rans.PROB_BITS if p >= width]))
        out.append((hist, width, [8]))
        sparse = np.zeros(1 << width, np.int64)
        sparse[[0, (1 << width) - 1]] = [5, 3]
        out.append((sparse, width, [8]))
    return out


@pytest.mark.filterwarnings("ignore:invalid value encountered in log2")   # P forced below the range
def test_compact_fit_is_exactly_the_plain_formulas():
    cases = _fit_histograms()
    assert len(cases) > 250
    for hist, width, cands in cases:
        try:
            want = _fit_compact_reference(hist, width, cands)
        except rans.RansError as e:
            with pytest.raises(rans.RansError, match=re.escape(str(e))):
                rans.fit_compact_model(hist, width, cands)
            continue
        got = rans.fit_compact_model(hist, width, cands)
        assert got[0] == want[0], (width, cands, hist.nonzero())
        assert got[1].dtype == want[1].dtype and np.array_equal(got[1], want[1]), (width, cands, hist.nonzero())


@pytest.mark.parametrize("count", [300, 5_000, 200_000])
def test_a_model_takes_the_smallest_table_within_the_slack(count):
    """`rans_fit.choose_prob_bits`: the decoder builds 2**P slots a model, so a compact model
    takes the smallest P whose coded bits are within the stated slack of the fewest (a
    model of a few hundred symbols no longer gets 2**15 slots), and decodes exactly."""
    rng = np.random.default_rng(count)
    nb = -(-count // rans.BLOCK)
    sym = np.minimum(rng.geometric(0.05, (nb, rans.BLOCK)) - 1, 255).astype(np.uint8)
    widths = np.full(nb, 8)
    (models,) = rans.fit_models(sym, widths, count, compact=True)
    P, lv = models[8]
    hist = np.bincount(sym.reshape(-1)[:count], minlength=256)
    cost = {p: _cost_bits(hist, rans.model_freqs(lv, p), p) for p in rans.PROB_BITS if p >= 8}
    limit = min(cost.values()) + rans_fit.P_SLACK_BITS + rans_fit.P_SLACK_PER_SYMBOL * count
    assert cost[P] <= limit and all(cost[p] > limit for p in cost if p < P)
    if count <= 5_000:
        assert P < max(cost)           # fewest bits alone would take the largest table here
    buf = rans.encode_streams(sym, widths, count, compact_models=True)
    assert np.array_equal(rans.decode_streams(buf, widths, count).reshape(-1)[:count], sym.reshape(-1)[:count])


@given(st.integers(0, 10), st.integers(0, 2**32 - 1), st.sampled_from([0.02, 0.2, 0.6]))
def test_compact_fit_is_exactly_the_plain_formulas_property(width, seed, geo):
    rng = np.random.default_rng(seed)
    hist = np.bincount(np.minimum(rng.geometric(geo, 400) - 1, (1 << width) - 1), minlength=1 << width)
    hist = hist * rng.integers(1, 1 << int(rng.integers(1, 30)), hist.size) * (rng.random(hist.size) < 0.8)
    if not hist.any():
        hist[int(rng.integers(hist.size))] = 1
    cands = [p for p in rans.PROB_BITS if p >= width]
    got, want = rans.fit_compact_model(hist, width, cands), _fit_compact_reference(hist, width, cands)
    assert got[0] == want[0] and np.array_equal(got[1], want[1])
