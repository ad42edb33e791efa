"""log8-rel-zstd: log8-rel's codes through the zstd entropy stage (jaxguard/format/entropy.py).

The stage is lossless over certified codes, so an entry decodes to exactly what log8-rel's
does (where no block was widened) and to what the guard certified (the writer's sample
check); its streams are untrusted input: every malformation is one ReaderError line."""
import hashlib
import json
import os

import numpy as np
import pytest

from jaxguard import writer
from jaxguard.core import adaptive, guard
from jaxguard.core.config import GuardConfig
from jaxguard.format import container, entropy, packed, reader, zstd_streams

CODEC = entropy.CODEC


def _moments(n, seed=0, span=12.0):
    """Adam-like moments: log-uniform v over `span` binades, m ~ +-sqrt(v), a few exact zeros."""
    rng = np.random.default_rng(seed)
    v = np.exp2(rng.uniform(-30, -30 + span, n)).astype(np.float32)
    m = (rng.standard_normal(n) * np.sqrt(v) * 0.3).astype(np.float32)
    v[::97] = 0.0
    m[::97] = 0.0
    p = (rng.standard_normal(n) * 0.05).astype(np.float32)
    return m, v, p


def _edge_moments():
    """The golden containers' inputs: NaN, inf, subnormals, zeros, float32 max."""
    from golden.make_container_golden import inputs
    return inputs()


def _container(jobs):
    data, summary = writer.to_bytes(jobs, {"framework": "test"})
    header, payload = reader.parse(data)
    return data, summary, header, payload


def _bits(x):
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


@pytest.mark.parametrize("n", [1, 255, 256, 257, 5000, 70_001])
def test_decodes_to_log8_rels_bits_and_what_jax_and_torch_decode(n):
    torch_dec = pytest.importorskip("torch_compat.codes_torch")
    m, v, p = _moments(n, seed=n)
    out = {}
    for codec in ("log8-rel", CODEC):
        cfg = GuardConfig(lr=1e-3, step=100, codec=codec)
        data, s, header, payload = _container([writer.MomentJob("w", m, v, p, cfg)])
        entry = header["entries"][0]
        assert reader.verify_bytes(data)["ok"]
        mt, vt = reader.read_moments(entry, payload, {})
        tm, tv = torch_dec.read_moments(entry, payload, {})
        assert np.array_equal(_bits(mt), _bits(tm.numpy())) and np.array_equal(_bits(vt), _bits(tv.numpy()))
        enc = guard.encode(m, v, p, cfg)
        jm, jv = guard.decode(enc)
        assert np.array_equal(_bits(mt), _bits(jm)) and np.array_equal(_bits(vt), _bits(jv))
        out[codec] = (header["decoded_sha256"], _bits(mt), _bits(vt), s)
    assert out[CODEC][0] == out["log8-rel"][0]       # the same codes: the same decoded hash
    assert out[CODEC][3]["escapes"] == out["log8-rel"][3]["escapes"]


def test_edge_values_escape_exactly_and_decode_like_log8_rel():
    m, v, p = _edge_moments()
    hashes = {}
    for codec in ("log8-rel", CODEC):
        cfg = GuardConfig(lr=1e-3, step=100, codec=codec)
        data, s, header, payload = _container([writer.MomentJob("w", m, v, p, cfg)])
        mt, vt = reader.read_moments(header["entries"][0], payload, {})
        # NaN, +-inf, negative v and nonzero moments below 2**-80 are stored exactly (guard's contract)
        must = ~np.isfinite(m) | ~np.isfinite(v) | (v < 0) | ((m != 0) & (np.abs(m) < 2.0**-80)) \
            | ((v != 0) & (np.abs(v) < 2.0**-80))
        assert must[512:520].sum() >= 5
        assert np.array_equal(_bits(mt)[must], _bits(m)[must]) and np.array_equal(_bits(vt)[must], _bits(v)[must])
        hashes[codec] = header["decoded_sha256"]
    assert hashes[CODEC] == hashes["log8-rel"]


def test_payload_stat_is_the_stored_sections_and_smaller_than_log8_rel():
    m, v, p = _moments(200_000, seed=3)
    sizes = {}
    for codec in ("log8-rel", CODEC):
        cfg = GuardConfig(lr=1e-3, step=100, codec=codec)
        data, s, header, payload = _container([writer.MomentJob("w", m, v, p, cfg)])
        entry = header["entries"][0]
        stored = sum(e - b for b, e in entry["sections"].values())
        assert s["payload_bytes"] == stored == entry["stats"]["payload_bytes"]
        sizes[codec] = stored
    # 12 binades of log-uniform v: 8-bit codes of ~7.6 bits' entropy, no escape mask, 12-byte parameters
    assert sizes[CODEC] < 0.93 * sizes["log8-rel"], sizes


@pytest.mark.parametrize("size", [0, 1, 64, 65, 1000, entropy.FRAME, entropy.FRAME + 1, 2 * entropy.FRAME + 300])
def test_stream_round_trip_frames_and_stored_as_is(size):
    rng = np.random.default_rng(size)
    data = rng.integers(0, 40, size).astype(np.uint8)    # compressible
    buf = entropy.encode_stream(data)
    decoded, frames = entropy.stream_frames(buf, "s")
    assert decoded == size and len(frames) == -(-size // entropy.FRAME)
    assert [d for *_, d in frames] == entropy.frame_lengths(size)
    assert np.array_equal(entropy.decode_stream(buf, "s", size), data)
    noise = rng.integers(0, 256, size).astype(np.uint8)   # incompressible: every frame stored as is
    buf = entropy.encode_stream(noise)
    assert all(s == d for _, s, d in entropy.stream_frames(buf, "s")[1])
    assert np.array_equal(entropy.decode_stream(buf, "s", size), noise)


def _frame_stream(data):
    frames = entropy.compress_frames(data)
    assert len(frames) == 1 and len(frames[0]) < len(data)
    return frames[0]


BAD_STREAMS = {
    "declares another length": lambda z, d: entropy.join_frames(len(d) + 1, [z, b"\0"]),
    "a frame stored larger than it decodes": lambda z, d: entropy.join_frames(10, [b"\0" * 11]),
    "a zero-length frame": lambda z, d: entropy.join_frames(10, [b""]),
    "bytes after the frames": lambda z, d: np.concatenate([entropy.join_frames(len(d), [z]), [7]]).astype(np.uint8),
    "truncated header": lambda z, d: np.array([0x80], np.uint8),
    "over-long varint": lambda z, d: np.array([0x80] * 8 + [1], np.uint8),
    "a zstd frame shorter than stored": lambda z, d: entropy.join_frames(len(d), [bytes(z) + b"\0"]),
    "a zstd frame cut short": lambda z, d: entropy.join_frames(len(d) - 1, [bytes(z)[:-1]]),
    "a reserved bit in the frame header": lambda z, d: entropy.join_frames(len(d), [bytes([z[0] | 8]) + bytes(z)[1:]]),
    "a dictionary id": lambda z, d: entropy.join_frames(len(d), [bytes([z[0] | 1]) + bytes(z)[1:]]),
    "garbage in the frame": lambda z, d: entropy.join_frames(len(d), [bytes(z)[:6] + b"\xff" * (len(z) - 6)]),
}


@pytest.mark.parametrize("case", sorted(BAD_STREAMS))
def test_malformed_streams_are_refused_in_one_line(case):
    data = np.tile(np.arange(30, dtype=np.uint8), 100)
    z = _frame_stream(data)
    buf = BAD_STREAMS[case](z, data)
    with pytest.raises(entropy.StreamError) as info:
        out = entropy.decode_stream(buf, "w.m_codes", len(data))
        if case == "garbage in the frame" and np.array_equal(out, data):   # zstd may not notice: the hashes do
            raise entropy.StreamError("w.m_codes: (decoded what it was given)")
        if case == "garbage in the frame":
            raise entropy.StreamError("w.m_codes: decoded to other bytes (the decoded hash refuses them)")
    msg = str(info.value)
    assert msg.startswith("w.m_codes: ") and "\n" not in msg and len(msg) < 300, msg


def _entry_arrays(n, seed=0):
    m, v, p = _moments(n, seed)
    enc = guard.encode(m, v, p, GuardConfig(lr=1e-3, step=100, codec=CODEC))
    return enc


def _read(sections, n, name="w", lazy=False):
    """reader.read_codes of one zstd entry built from `sections` (a dict of arrays), sealed
    into a container and read back through `reader.parse` (its layout check included)."""
    parts, rng, pos = [], {}, 0
    for k, a in sections.items():
        a = np.asarray(a)
        b = np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes()
        rng[k] = [pos, pos + len(b)]
        pos += len(b)
        parts.append(b)
    payload = b"".join(parts)
    entry = {"name": name, "kind": "moments", "codec": CODEC, "shape": [n], "sections": rng}
    head = json.dumps({"entries": [entry], "payload_bytes": len(payload),
                       "payload_sha256": hashlib.sha256(payload).hexdigest()}).encode()
    body = reader.PREFIX.pack(reader.MAGIC, reader.VERSION, 0, len(head)) + head + payload
    header, view = reader.parse(body + hashlib.sha256(body).digest())
    return reader.read_codes(header["entries"][0], view, {}, lazy=lazy)


def test_parameters_derive_wlo_rr_or_store_them():
    enc = _entry_arrays(3000)
    nb = enc.arrays["v_params"].shape[0]
    sec = entropy.entry_sections(enc.arrays, enc.n)
    assert entropy.stream_frames(sec["params"], "p")[0] == 12 * nb        # wlo, rr derived
    got = _read(sec, enc.n)
    np.testing.assert_array_equal(_bits(got["v_params"]), _bits(enc.arrays["v_params"]))
    arrays = dict(enc.arrays)
    vp = np.array(arrays["v_params"])
    vp[1, 2] = np.nextafter(vp[1, 2], np.float32(1))     # not sqrt(lo): stored explicitly
    arrays["v_params"] = vp
    sec = entropy.entry_sections(arrays, enc.n)
    assert entropy.stream_frames(sec["params"], "p")[0] == 20 * nb
    np.testing.assert_array_equal(_bits(_read(sec, enc.n)["v_params"]), _bits(vp))


def _wide_arrays():
    """An entry whose blocks 1 and 3 are wide (10-bit v, 9-bit m), built by hand."""
    rng = np.random.default_rng(5)
    n, nb = 1000, 4
    widths = np.full(nb, entropy.NARROW_WIDTHS, np.uint8)
    widths[1], widths[3] = packed.join_widths(9, 10), packed.join_widths(8, 12)
    qm = rng.integers(-127, 128, n).astype(np.int16)
    qv = rng.integers(0, 256, n).astype(np.uint16)
    qm[256:512] = rng.integers(-255, 256, 256)
    qv[256:512] = rng.integers(0, 1024, 256)
    qv[768:] = rng.integers(0, 4096, n - 768)
    lo = np.float32([1e-9, 2e-9, 3e-9, 4e-9])
    r = np.float32([1.05, 1.01, 1.04, 1.003])
    arrays = {"m_codes": qm, "v_codes": qv, "m_params": np.float32([[0.01], [0.02], [0.03], [0.04]]),
              "v_params": np.stack([lo, r, np.sqrt(lo), np.sqrt(r)], 1).astype(np.float32), "widths": widths,
              "escape_index": np.array([5, 300, 999]), "escape_m": np.float32([1, 2, 3]),
              "escape_v": np.float32([4, 5, 6])}
    return arrays, n


def test_wide_blocks_round_trip_through_high_streams():
    arrays, n = _wide_arrays()
    sec = entropy.entry_sections(arrays, n)
    assert {"widths", "m_high", "v_high"} <= set(sec)
    assert entropy.stream_frames(sec["m_high"], "h")[0] == 256           # block 1 only (m of block 3 is 8 bits)
    assert entropy.stream_frames(sec["v_high"], "h")[0] == 256 + (n - 768)
    got = _read(sec, n)
    assert got["m_codes"].dtype == np.int16 and got["v_codes"].dtype == np.uint16
    np.testing.assert_array_equal(got["m_codes"], arrays["m_codes"])
    np.testing.assert_array_equal(got["v_codes"], arrays["v_codes"])
    np.testing.assert_array_equal(got["escape_index"], arrays["escape_index"])
    m1, v1 = reader.decode_codes(CODEC, n, got["m_codes"], got["v_codes"], got["m_params"], got["v_params"], {})
    m2, v2 = reader.decode_codes("log8-rel", n, arrays["m_codes"], arrays["v_codes"], arrays["m_params"],
                                 arrays["v_params"], {})
    assert np.array_equal(_bits(m1), _bits(m2)) and np.array_equal(_bits(v1), _bits(v2))


def test_wide_blocks_read_lazily_give_the_whole_reads_codes(monkeypatch):
    """The restore's lazy read of an entry with wider blocks (frames decoded per slice, the
    high bytes joined per range) gives the codes of the whole read: ranges on and off block
    and frame edges, positions, and the same refusal of an m field past its block's range."""
    monkeypatch.setattr(zstd_streams, "FRAME", 384)          # several frames, edges inside blocks
    arrays, n = _wide_arrays()
    sec = entropy.entry_sections(arrays, n)
    whole, lazy = _read(sec, n), _read(sec, n, lazy=True)
    assert isinstance(lazy["m_codes"], entropy.FramedCodes) and lazy["m_codes"].dtype == np.int16
    for key in ("m_codes", "v_codes"):
        for a, b in ((0, n), (0, 256), (256, 512), (100, 900), (700, 1000), (383, 385), (999, 1000), (5, 5),
                     (512, 768)):                        # (512, 768): block 2, 8 bits: 8-bit codes
            np.testing.assert_array_equal(lazy[key][a:b], whole[key][a:b])
        at = np.array([0, 255, 256, 511, 600, 767, 768, 999])
        np.testing.assert_array_equal(lazy[key][at], whole[key][at])
    low = entropy.decode_stream(sec["m_codes"], "m", n).copy()
    high = entropy.decode_stream(sec["m_high"], "h").copy()
    low[300], high[300 - 256] = 0xFF, 1                  # block 1 is 9 bits: field 511, past 2 * 255
    sec = dict(sec, m_codes=entropy.encode_stream(low), m_high=entropy.encode_stream(high))
    with pytest.raises(reader.ReaderError, match="coordinate 300 has m field"):
        _read(sec, n)
    lazy = _read(sec, n, lazy=True)
    with pytest.raises(entropy.StreamError, match="coordinate 300 has m field"):
        lazy["m_codes"][256:512]


def _sections_with(**change):
    arrays, n = _wide_arrays()
    sec = dict(entropy.entry_sections(arrays, n))
    for k, fn in change.items():
        if fn is None:
            del sec[k]
        else:
            sec[k] = fn(sec, arrays, n)
    return sec, n


WIDE_REFUSALS = {
    "widths all 8 bits": dict(widths=lambda s, a, n: entropy.encode_stream(np.full(4, 0x88, np.uint8))),
    "a width of 13": dict(widths=lambda s, a, n: entropy.encode_stream(np.uint8([0x88, 0x9D, 0x88, 0x8C]))),
    "a width of 7": dict(widths=lambda s, a, n: entropy.encode_stream(np.uint8([0x88, 0x9A, 0x87, 0x8C]))),
    "m_high missing": dict(m_high=None),
    "a high part past the width": dict(v_high=lambda s, a, n: entropy.encode_stream(
        np.full(256 + n - 768, 4, np.uint8))),
    "a narrow m field of 255": dict(widths=None, m_high=None, v_high=None, m_codes=lambda s, a, n: entropy.encode_stream(
        np.full(n, 255, np.uint8))),
    "params of the wrong length": dict(params=lambda s, a, n: entropy.encode_stream(np.zeros(13 * 4, np.uint8))),
    "pairs for another escape count": dict(escape_pairs=lambda s, a, n: np.zeros(2, np.float32)),
    "an escape past the end": dict(escape_index=lambda s, a, n: entropy.encode_stream(packed.varint_encode([n]))),
}


@pytest.mark.parametrize("case", sorted(WIDE_REFUSALS))
def test_malformed_sections_are_refused_in_one_line(case):
    sec, n = _sections_with(**WIDE_REFUSALS[case])
    with pytest.raises(reader.ReaderError) as info:
        _read(sec, n)
    msg = str(info.value)
    assert msg.startswith(("w.", "w:")) and "\n" not in msg and len(msg) < 300, msg


def test_section_set_is_checked_before_decoding():
    arrays, n = _wide_arrays()
    sec = dict(entropy.entry_sections(arrays, n))
    del sec["widths"]                         # m_high / v_high without widths: not a section set of the layout
    with pytest.raises(reader.ReaderError, match="must have exactly the sections"):
        _read(sec, n)


def test_pieces_join_their_frames_into_the_whole_tensors_bytes(monkeypatch):
    """A tensor certified in pieces (writer.container_entries above PIECES_OVER slabs) takes its
    pieces' code frames as they are: the payload is byte for byte the one-piece one."""
    monkeypatch.setattr(zstd_streams, "FRAME", 4096)
    m, v, p = _moments(4096 * 5 + 77, seed=9)
    cfg = GuardConfig(lr=1e-3, step=100, codec=CODEC)
    calls = []
    join = entropy.join_sections

    def counted(*a, **k):
        out = join(*a, **k)
        calls.append(out is not None)
        return out
    monkeypatch.setattr(entropy, "join_sections", counted)
    whole = container.build(list(writer.container_entries([writer.MomentJob("w", m, v, p, cfg)])), {})
    pieces = container.build(list(writer.container_entries([writer.MomentJob("w", m, v, p, cfg)], slab=4096)), {})
    assert calls == [True]
    (hw, pw), (hp, pp) = reader.parse(whole), reader.parse(pieces)   # headers differ in encode_seconds only
    assert bytes(pw) == bytes(pp) and hw["decoded_sha256"] == hp["decoded_sha256"]
    assert hw["entries"][0]["sections"] == hp["entries"][0]["sections"]


def _spanning_moments(n_blocks=8, seed=0):
    """Blocks whose v spans 40 binades with m ~ sqrt(v): 8-bit log steps of v are too coarse."""
    rng = np.random.default_rng(seed)
    n = 256 * n_blocks
    v = np.exp2(rng.uniform(-60, -20, n)).astype(np.float32)
    m = (np.sqrt(v) * rng.choice([-1.0, 1.0], n) * rng.uniform(0.5, 3.0, n)).astype(np.float32)
    p = (rng.standard_normal(n) * 0.05).astype(np.float32)
    return m, v, p


def test_blocks_that_escape_much_are_widened_certified_and_decode_as_certified():
    m, v, p = _spanning_moments()
    esc = {}
    for codec in ("log8-rel", CODEC):
        cfg = GuardConfig(lr=1e-3, step=1000, codec=codec)
        enc = guard.encode(m, v, p, cfg, keep_decoded=True)
        esc[codec] = enc.stats["escapes"]
        if codec == CODEC:
            bm, bv = packed.split_widths(enc.arrays["widths"])
            assert (bv == 10).any() and set(bm) == {8}
            assert enc.arrays["v_codes"].dtype == np.uint16
            # the writer's sample check compares the reader's decode with the certified values
            data, s, header, payload = _container([writer.MomentJob("w", m, v, p, cfg)])
            mt, vt = reader.read_moments(header["entries"][0], payload, {})
            dm, dv = guard.decode(enc)
            assert np.array_equal(_bits(mt), _bits(dm)) and np.array_equal(_bits(vt), _bits(dv))
            assert np.array_equal(_bits(mt), _bits(enc.decoded[0])) and np.array_equal(_bits(vt), _bits(enc.decoded[1]))
    assert esc[CODEC] < esc["log8-rel"] // 2, esc


def test_widening_keeps_the_guarantee_against_real_torch_adam():
    torch = pytest.importorskip("torch")
    import torch_compat
    m, v, p = _spanning_moments(6, seed=2)
    model = torch.nn.Linear(256, 6, bias=False)
    with torch.no_grad():
        model.weight.copy_(torch.from_numpy(p.reshape(6, 256)))
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3, foreach=False)
    opt.state[model.weight] = {"step": torch.tensor(1000.0), "exp_avg": torch.from_numpy(m.reshape(6, 256)).clone(),
                               "exp_avg_sq": torch.from_numpy(v.reshape(6, 256)).clone()}
    ck = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    data, s = torch_compat.compress_checkpoint(ck, codec=CODEC)
    header, payload = reader.parse(data)
    entry = next(e for e in header["entries"] if e["kind"] == "moments")
    assert "widths" in entry["sections"]
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "c.jg")
        container.atomic_write(path, data)
        restored, _ = torch_compat.restore_tree(path)
    a = torch_compat.audit(ck, restored, tau=0.01, clip=0.2)
    assert a["violations"] == 0 and a["max_gap_lr"] <= 0.01, a


def test_widen_skips_blocks_with_few_escapes():
    m, v, p = _moments(5000, seed=1)
    enc = guard.encode(m, v, p, GuardConfig(lr=1e-3, step=100, codec=CODEC))
    counts = np.bincount(enc.arrays["escape_index"] // 256, minlength=enc.arrays["widths"].size)
    assert counts.max(initial=0) < adaptive.WIDEN_FROM
    assert (enc.arrays["widths"] == entropy.NARROW_WIDTHS).all() and enc.arrays["m_codes"].dtype == np.int8
