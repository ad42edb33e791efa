"""A large streamed container writes its payload once, into the output file itself.

`container.write_stream` moves the payload from its scratch file to the output once it
passes `container.IN_PLACE_AFTER` bytes (room left for the header) and writes the rest
there; the header is padded with spaces to the room, or the payload is moved forward
when the header outgrew it. Whatever the route, a reader sees the same header, payload
and decoded moments as the scratch route writes.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from jaxguard.cli.main import main as cli_main
from jaxguard.core import guard
from jaxguard.errors import ContainerError
from jaxguard.format import container, reader


def _entries(seed=0, pairs=6, raws=18, n=30_000, raw_size=40_000):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(pairs):
        m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
        v = (rng.random(n) * 1e-6).astype(np.float32)
        p = rng.standard_normal(n).astype(np.float32)
        m[0], v[-1] = np.nan, np.inf
        cfg = guard.GuardConfig(lr=1e-3, step=10)
        out.append(container.Moments(f"m{i}", guard.encode(m, v, p, cfg, keep_decoded=True), cfg.to_json()))
        for j in range(raws // pairs):
            out.append(container.Raw(f"r{i}.{j}", rng.standard_normal(int(rng.integers(1, raw_size))).astype(np.float32)))
    return out


def _write(path, entries, monkeypatch, after, expected):
    monkeypatch.setattr(container, "IN_PLACE_AFTER", after)
    size = container.write_stream(path, iter(entries), {"tree": "t"}, extra_header={"op_model": "torch-adam"},
                                  expected_entries=expected)
    data = path.read_bytes()
    assert size == len(data)
    header, payload = reader.parse(data)
    hlen = reader.PREFIX.unpack_from(data, 0)[3]
    return data, header, bytes(payload), hlen


@pytest.mark.parametrize("after", (0, 50_000))
def test_in_place_writes_what_the_scratch_route_writes(tmp_path, monkeypatch, after):
    entries = _entries()
    scratch, h0, p0, hlen0 = _write(tmp_path / "scratch.jg", entries, monkeypatch, 1 << 60, len(entries))
    data, h1, p1, hlen1 = _write(tmp_path / "inplace.jg", entries, monkeypatch, after, len(entries))
    assert p1 == p0 and h1 == h0                       # the same payload, the same header object
    assert hlen1 > hlen0                               # padded to the room it reserved ...
    head = data[reader.PREFIX.size:reader.PREFIX.size + hlen1]
    assert head[:hlen0] == scratch[reader.PREFIX.size:reader.PREFIX.size + hlen0]
    assert set(head[hlen0:]) == {ord(" ")}             # ... with spaces only
    assert hlen1 - hlen0 < len(p1) / 16
    header, payload, _ = container.read(str(tmp_path / "inplace.jg"))   # decoded hash checked too
    assert header["decoded_sha256"] == h0["decoded_sha256"]
    assert cli_main(["verify", str(tmp_path / "inplace.jg")]) == 0


def test_a_header_that_outgrew_its_room_moves_the_payload(tmp_path, monkeypatch):
    entries = _entries(seed=1, raws=600, raw_size=400)     # many small entries after the large ones
    scratch, h0, p0, hlen0 = _write(tmp_path / "scratch.jg", entries, monkeypatch, 1 << 60, None)
    # told to expect 2 entries, the writer reserves far too little room for the header
    data, h1, p1, hlen1 = _write(tmp_path / "moved.jg", entries, monkeypatch, 20_000, 2)
    assert hlen1 == hlen0 > 20_000
    assert data == scratch                             # moved forward: byte for byte the scratch route's file


def test_small_containers_are_written_as_before(tmp_path, monkeypatch):
    entries = _entries(seed=2)
    a = _write(tmp_path / "a.jg", entries, monkeypatch, container.IN_PLACE_AFTER, len(entries))[0]
    b = _write(tmp_path / "b.jg", entries, monkeypatch, 1 << 60, None)[0]
    assert a == b
    assert json.loads(a[reader.PREFIX.size:reader.PREFIX.size + reader.PREFIX.unpack_from(a, 0)[3]])


def test_a_failure_after_the_move_leaves_the_target_as_it_was(tmp_path, monkeypatch):
    target = tmp_path / "c.jg"
    target.write_bytes(b"previous")
    entries = _entries(seed=3)

    def failing():
        yield from entries
        raise ContainerError("stop here")

    monkeypatch.setattr(container, "IN_PLACE_AFTER", 0)
    with pytest.raises(ContainerError, match="stop here"):
        container.write_stream(target, failing(), {}, expected_entries=len(entries))
    assert target.read_bytes() == b"previous"
    assert [p.name for p in tmp_path.iterdir()] == ["c.jg"]


@pytest.mark.parametrize("after", (0, 1 << 60))   # in place, and the scratch route
def test_decoded_hash_in_a_thread_of_its_own_writes_the_same_bytes(tmp_path, monkeypatch, after):
    """`container.BEHIND_FROM`: an entry's decoded values are hashed in a thread of their
    own, one entry behind the payload.  Every entry hashed that way (0) and none (2**60)
    give byte-identical files, and the reader's decoded check passes."""
    entries = _entries(seed=3)
    monkeypatch.setattr(container, "BEHIND_FROM", 0)
    threaded, *_ = _write(tmp_path / "threaded.jg", entries, monkeypatch, after, len(entries))
    monkeypatch.setattr(container, "BEHIND_FROM", 1 << 60)
    inline, *_ = _write(tmp_path / "inline.jg", entries, monkeypatch, after, len(entries))
    assert threaded == inline
    container.read(str(tmp_path / "threaded.jg"))     # verifies the decoded SHA-256


def test_a_failing_early_fsync_leaves_nothing_and_keeps_the_old_file(tmp_path, monkeypatch):
    """The in-place route fsyncs header and payload in a thread while it reads them back
    for the trailer.  A disk error there (EIO from fsync) must surface as the one-line
    ContainerError, with no output and no temporary file left, and the file that was
    there before intact."""
    import errno
    import os
    import threading
    entries = _entries(seed=5)
    target = tmp_path / "c.jg"
    target.write_bytes(b"the previous checkpoint")
    real_fsync = os.fsync

    def failing_fsync(fd):   # only the early one, in its thread: the caller's own fsync would catch it anyway
        if threading.current_thread().name == "jaxguard-fsync":
            raise OSError(errno.EIO, "Input/output error")
        real_fsync(fd)
    monkeypatch.setattr(container, "IN_PLACE_AFTER", 0)
    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(ContainerError, match="Input/output error") as info:
        container.write_stream(target, iter(entries), {"tree": "t"}, expected_entries=len(entries))
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert "\n" not in str(info.value)
    assert target.read_bytes() == b"the previous checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jg"]


@pytest.mark.parametrize("after", (0, 1 << 60))
def test_hashing_beside_the_write_writes_the_same_file(tmp_path, monkeypatch, after):
    """`container.HASH_BESIDE_FROM`: a large write's SHA-256 runs in a thread beside it; with
    every write hashed that way (threshold 1) the file is byte for byte the one written with
    none (threshold 2**60), on both routes."""
    entries = _entries(seed=3)
    monkeypatch.setattr(container, "HASH_BESIDE_FROM", 1 << 60)
    plain = _write(tmp_path / "plain.jg", entries, monkeypatch, after, len(entries))[0]
    monkeypatch.setattr(container, "HASH_BESIDE_FROM", 1)
    beside = _write(tmp_path / "beside.jg", entries, monkeypatch, after, len(entries))[0]
    assert beside == plain


def test_a_failed_write_beside_its_hash_raises_and_leaves_no_thread(monkeypatch):
    import io
    import threading

    class Full(io.RawIOBase):
        def writable(self):
            return True

        def write(self, b):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(container, "HASH_BESIDE_FROM", 1)
    sink = container.PayloadSink(Full())
    before = threading.active_count()
    with pytest.raises(OSError, match="No space left"):
        sink.add(np.arange(1000, dtype=np.float32))
    assert threading.active_count() == before and sink.pos == 0


def _raws_first(seed):
    """`_entries` with a large raw entry ahead of all the others and every raw before the
    moments: the order of a torch checkpoint's compress (its parameters lead)."""
    entries = _entries(seed=seed, pairs=40, raws=40, n=3000)
    big = container.Raw("big", np.random.default_rng(seed).standard_normal(1 << 20).astype(np.float32))
    return ([big] + [e for e in entries if isinstance(e, container.Raw)]
            + [e for e in entries if isinstance(e, container.Moments)])


def _write_watched(path, entries, monkeypatch, expected_moments):
    """write_stream in place from the first byte on; -> (file bytes, scratch bytes copied to
    the output, payload moves)."""
    copied, moves = [], []
    copy, move = container._copy_scratch, container._move_forward

    def counted_copy(scratch, out, sha=None):
        copied.append(scratch.seek(0, 2))
        return copy(scratch, out, sha)

    def counted_move(*args):
        moves.append(args)
        return move(*args)
    monkeypatch.setattr(container, "_copy_scratch", counted_copy)
    monkeypatch.setattr(container, "_move_forward", counted_move)
    monkeypatch.setattr(container, "IN_PLACE_AFTER", 0)
    container.write_stream(path, iter(entries), {"tree": "t"}, extra_header={"op_model": "torch-adam"},
                           expected_entries=len(entries), expected_moments=expected_moments)
    return path.read_bytes(), copied, moves


def test_a_stream_led_by_raws_leaves_room_for_the_moments_after_them(tmp_path, monkeypatch):
    """Raw entries first (a header entry of ~100 bytes each), moments after (~600-1000):
    told how many moments come, the writer leaves them room and the header fits (padded,
    not moved); the first entry, which crosses the mark, goes straight to the output
    (nothing through the scratch file).  Counted at the raws' mean size alone, the room is
    too small and the whole payload is moved forward (what the count avoids)."""
    entries = _raws_first(seed=6)
    moments = sum(isinstance(e, container.Moments) for e in entries)
    scratch = _write(tmp_path / "scratch.jg", entries, monkeypatch, 1 << 60, None)
    data, copied, moves = _write_watched(tmp_path / "led.jg", entries, monkeypatch, moments)
    header, payload = reader.parse(data)
    hlen = reader.PREFIX.unpack_from(data, 0)[3]
    assert (header, bytes(payload)) == (scratch[1], scratch[2])
    assert not moves and copied == [0]
    assert hlen > scratch[3] and hlen - scratch[3] < len(payload) / 16
    assert set(data[reader.PREFIX.size + scratch[3]:reader.PREFIX.size + hlen]) == {ord(" ")}
    container.read(str(tmp_path / "led.jg"))       # decoded hash verified

    unknown, _, moves = _write_watched(tmp_path / "unknown.jg", entries, monkeypatch, None)
    assert len(moves) == 1 and unknown == scratch[0]     # moved forward: the scratch route's bytes
