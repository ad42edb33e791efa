"""The restore's read path of log8-rel-zstd entries decodes exactly what the general code
does and refuses exactly what it refuses.

* `zstd_streams.decode_stream` (a stream of one frame is returned without a copy) against
  `stream_frames` + `decode_frame` on valid streams and on one-byte mutations and
  truncations of them.
* `decoders.log_decode` of blocks wider than 8 bits tabulates the powers; checked bit for
  bit against powering each code alone, on adversarial block parameters."""
import numpy as np
import pytest

from jaxguard.format import decoders, zstd_streams


def _powered_alone(qb, lo, r, n, bits):
    """`lo * r**(q-1)`, each code powered bit by bit from the lowest (0 for q == 0)."""
    k = qb.astype(np.int64) - 1
    p = r.astype(np.float32)[:, None]
    val = np.broadcast_to(lo.astype(np.float32)[:, None], qb.shape).copy()
    with np.errstate(over="ignore", invalid="ignore"):
        for j in range(bits):
            bit = ((k >> j) & 1) == 1
            val = np.where(bit, val * p, val).astype(np.float32)
            p = (p * p).astype(np.float32)
    val[qb == 0] = 0.0
    return val.reshape(-1)[:n]


SPECIALS = np.array([0.0, 1e-45, 1e-40, 1.1754944e-38, 3.4028235e38, np.inf, -np.inf, np.nan, -0.0, 1.0, 0.5,
                     1.0000001, 0.99999994, -2.0], np.float32)


@pytest.mark.parametrize("seed", range(6))
def test_wide_blocks_decode_as_each_code_powered_alone(seed, monkeypatch):
    rng = np.random.default_rng(seed)
    if seed % 2:      # tables built a few rows at a time
        monkeypatch.setattr(decoders, "TABLE_CELLS", 5000)
    for trial in range(30):
        nb, bits = int(rng.integers(1, 30)), int(rng.integers(8, 13))
        qb = rng.integers(0, 1 << bits, size=(nb, 256)).astype(np.uint16)
        qb[0, :4] = (0, 1, (1 << bits) - 1, 1 << (bits - 1))
        qb[:, 5] = (1 << bits) - 1          # every block wider than 8 bits
        lo = rng.choice(SPECIALS, nb) if trial % 3 == 0 else (10 ** rng.uniform(-30, 30, nb)).astype(np.float32)
        r = rng.choice(SPECIALS, nb) if trial % 2 == 0 else (1 + 10 ** rng.uniform(-7, 0, nb)).astype(np.float32)
        n = nb * 256 - int(rng.integers(0, 256))
        got = decoders.log_decode(qb.reshape(-1)[:n], lo, r, n, bits=max(bits, 9))
        want = _powered_alone(qb, lo, r, n, bits)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (seed, trial)


def _streams():
    rng = np.random.default_rng(0)
    out = [zstd_streams.encode_stream(b"")]
    for n in (1, 5, 64, 65, 127, 128, 300, 16384, 20000):
        out.append(zstd_streams.encode_stream(rng.integers(100, 104, n).astype(np.uint8)))   # zstd frames
        out.append(zstd_streams.encode_stream(rng.integers(0, 256, n).astype(np.uint8)))     # stored as is
    return out


def _general(buf, expected=None, limit=zstd_streams.MAX_STREAM):
    """decode_stream through the general path only (`_stream_frames` + `decode_frame`)."""
    mv = zstd_streams.bytes_view(buf)
    try:
        decoded, frames = zstd_streams.stream_frames(mv, "s", expected, limit)
        out = np.empty(decoded, np.uint8)
        pos = 0
        for start, stored, d in frames:
            out[pos:pos + d] = np.frombuffer(zstd_streams.decode_frame(mv, start, stored, d, "s"), np.uint8)
            pos += d
        return out
    except zstd_streams.StreamError as exc:
        return str(exc)


def _fast(buf, expected=None, limit=zstd_streams.MAX_STREAM):
    try:
        return np.array(zstd_streams.decode_stream(buf, "s", expected, limit=limit))
    except zstd_streams.StreamError as exc:
        return str(exc)


def _same(a, b):
    return a == b if isinstance(a, str) or isinstance(b, str) else np.array_equal(a, b)


def test_single_frame_streams_decode_and_refuse_as_the_general_path():
    for good in _streams():
        good = bytes(good)
        n = _general(good)
        cases = [good[:k] for k in range(len(good))] + [good + b"\0"]
        for i in range(min(len(good), 12)):
            for v in (0x00, 0x01, 0x7F, 0x80, 0xFF, good[i] ^ 0x40):
                cases.append(good[:i] + bytes([v]) + good[i + 1:])
        for buf in cases:
            for expected, limit in ((None, zstd_streams.MAX_STREAM), (len(n), zstd_streams.MAX_STREAM),
                                    ((len(n), len(n) + 1), zstd_streams.MAX_STREAM), (None, max(0, len(n) - 1))):
                assert _same(_fast(buf, expected, limit), _general(buf, expected, limit)), (buf[:8], expected, limit)


def _frame_result(fn, frame, decoded):
    try:
        return bytes(fn(frame, decoded))
    except zstd_streams.StreamError as exc:
        return str(exc)


def test_zstd_frames_decode_and_refuse_as_their_parsed_block_headers():
    """`decode_frame` (the header's content size read, then zstd's own checks with no byte
    left unused) against `_decode_frame_checked` (every block header parsed first): the same
    bytes, or the same StreamError, on truncations, a trailing byte, one-byte mutations and
    a wrong decoded length of zstd frames with one and several blocks."""
    rng = np.random.default_rng(1)
    datas = [rng.integers(100, 104, n).astype(np.uint8) for n in (65, 300, 5000)]
    datas.append(np.concatenate([rng.integers(0, 256, 150_000), np.zeros(150_000, int)]).astype(np.uint8))
    for data in datas:
        (frame,) = zstd_streams.compress_frames(data)
        frame = bytes(frame)
        assert len(frame) < data.size                      # a zstd frame, not stored as is
        cases = [frame[:k] for k in range(0, len(frame), max(1, len(frame) // 40))] + [frame + b"\0", frame + frame]
        for i in list(range(min(len(frame), 16))) + [int(x) for x in rng.integers(0, len(frame), 24)]:
            for v in (0x00, 0x01, 0x7F, 0x80, 0xFF, frame[i] ^ 0x08, frame[i] ^ 0x20, frame[i] ^ 0x03):
                cases.append(frame[:i] + bytes([v]) + frame[i + 1:])
        refused = 0
        for buf in cases:
            for d in (data.size, data.size - 1, data.size + 1):
                mv = memoryview(buf)
                fast = _frame_result(lambda f, n: zstd_streams.decode_frame(f, 0, len(f), n, "s"), mv, d)
                want = (bytes(buf) if len(buf) == d       # a frame as long as it decodes is stored as is
                        else _frame_result(lambda f, n: zstd_streams._decode_frame_checked(f, n, "s"), mv, d))
                assert fast == want, (len(buf), d, buf[:8])
                refused += isinstance(want, str)
        assert refused > len(cases)                        # the mutations were mostly refused
        assert _frame_result(lambda f, n: zstd_streams.decode_frame(f, 0, len(f), n, "s"),
                             memoryview(frame), data.size) == data.tobytes()


def test_an_empty_zstd_frame_is_named():
    with pytest.raises(zstd_streams.StreamError, match="an empty zstd frame"):
        zstd_streams.decode_frame(b"\x01\x02", 1, 0, 5, "s")


@pytest.mark.parametrize("seed", range(4))
def test_log8_rel_wide_v_codes_decode_as_each_code_powered_alone(seed, monkeypatch):
    """log8-rel's decode of uint16 v codes (blocks up to 12 bits, the widest code present
    setting the tables' width): v and w = wlo * rr**(qv-1) as each code powered alone, from
    one table of every block (a small entry) or from 8-bit tables and the wider blocks'
    own (odd seeds: tables of a few thousand cells)."""
    rng = np.random.default_rng(seed)
    if seed % 2:
        monkeypatch.setattr(decoders, "TABLE_CELLS", 5000)
    for trial in range(20):
        nb, bits = int(rng.integers(1, 12)), int(rng.integers(9, 13))
        qb = rng.integers(0, 257, size=(nb, 256)).astype(np.uint16)
        wide = rng.random(nb) < 0.5
        wide[0] = True
        qb[wide] = rng.integers(0, 1 << bits, size=(int(wide.sum()), 256))
        qb[0, 0] = (1 << bits) - 1 if trial % 2 else (1 << (bits - 1)) + 1
        vp = np.stack([(10 ** rng.uniform(-12, 0, nb)), 1 + 10 ** rng.uniform(-4, -1, nb),
                       (10 ** rng.uniform(-6, 0, nb)), 1 + 10 ** rng.uniform(-3, -1, nb)], axis=1).astype(np.float32)
        mp = (10 ** rng.uniform(-3, 0, (nb, 1))).astype(np.float32)
        n = nb * 256 - int(rng.integers(0, 256))
        mq = rng.integers(-127, 128, n).astype(np.int16)
        with np.errstate(over="ignore", invalid="ignore"):     # large codes overflow some blocks to inf
            m, v = decoders.DECODERS["log8-rel"](n, mq, qb.reshape(-1)[:n], mp, vp, {})
            want_v = _powered_alone(qb, vp[:, 0], vp[:, 1], n, bits)
            w = _powered_alone(np.maximum(qb, 1), vp[:, 2], vp[:, 3], n, bits)
            want_m = (mq.astype(np.float32) * np.repeat(mp[:, 0], 256)[:n]) * w
        assert np.array_equal(v.view(np.uint32), want_v.view(np.uint32)), (seed, trial)
        assert np.array_equal(m.view(np.uint32), want_m.view(np.uint32)), (seed, trial)
