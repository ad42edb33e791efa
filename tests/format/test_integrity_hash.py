"""The integrity hash of new containers (BLAKE3, prefix flags 1, header ``"hash"``) beside
the SHA-256 of the files written before: what each catches, what is refused, what stays the
same bytes (docs/security.md, docs/format.md)."""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import jaxguard.format.container as C
from jaxguard.errors import ContainerError
from jaxguard.format import integrity, reader
from jaxguard.format.reader import PREFIX, TRAILER, ReaderError

HERE = os.path.join(os.path.dirname(__file__), "..", "golden", "containers")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "golden"))
from make_container_golden import golden_entries, inputs  # noqa: E402

HASHES = ("sha256", "blake3")
OLD_GOLDEN = ("log8", "log8-rel", "bf16", "block8", "block8-unguarded", "logrel-aw", "logrel-ans", "torch-adam",
              "log8-rel-zstd")
NEW_GOLDEN = ("log8-rel", "log8-rel-zstd", "logrel-ans")
ENV = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}


@pytest.fixture(scope="module")
def entries():
    return golden_entries("log8-rel", *inputs())


@pytest.fixture(scope="module")
def files(entries):
    return {name: C.build(entries, {"x": 1}, integrity_hash=name) for name in HASHES}


def _digest(name, data):
    h = integrity.hasher(name)
    h.update(data)
    return h


def _reseal(data, *, header=None, payload=None, flags=None, fix_payload=False):
    """`data` with its header / payload / prefix flags replaced and the trailer recomputed with
    the hash its (new) flags name (and, with `fix_payload`, the payload digest too)."""
    _, _, old_flags, hlen = PREFIX.unpack_from(data, 0)
    flags = old_flags if flags is None else flags
    header = json.loads(data[PREFIX.size:PREFIX.size + hlen]) if header is None else header
    payload = bytes(data[PREFIX.size + hlen:len(data) - TRAILER]) if payload is None else payload
    name = integrity.HASHES.get(flags, "sha256")
    if fix_payload:
        header["payload_sha256"] = _digest(name, payload).hexdigest()
    hb = json.dumps(header, separators=(",", ":")).encode()
    body = PREFIX.pack(reader.MAGIC, reader.VERSION, flags, len(hb)) + hb + payload
    return body + _digest(name, body).digest()


def _refused(data, match):
    with pytest.raises(ReaderError, match=match):
        reader.verify_bytes(data)
    header, payload, wait = None, None, None
    try:
        header, payload, wait = reader.parse_deferred(data)
    except ReaderError as exc:
        assert len(str(exc).splitlines()) == 1
        return
    with pytest.raises(ReaderError, match=match):
        wait()
        if reader.decoded_digest(header, payload) != header["decoded_sha256"]:
            raise ReaderError(integrity.decoded_mismatch(header))


def test_new_files_use_blake3_and_say_so(entries):
    data = C.build(entries, {"x": 1})
    _, version, flags, hlen = PREFIX.unpack_from(data, 0)
    header = json.loads(data[PREFIX.size:PREFIX.size + hlen])
    assert (version, flags, header["hash"]) == (1, 1, "blake3")
    import blake3
    assert data[-TRAILER:] == blake3.blake3(data[:-TRAILER]).digest()     # the package's own BLAKE3, not ours
    assert header["payload_sha256"] == blake3.blake3(data[PREFIX.size + hlen:-TRAILER]).hexdigest()
    assert reader.verify_bytes(data)["hash"] == "blake3"


def test_sha256_files_are_written_as_before(files):
    data = files["sha256"]
    _, _, flags, hlen = PREFIX.unpack_from(data, 0)
    assert flags == 0 and "hash" not in json.loads(data[PREFIX.size:PREFIX.size + hlen])
    assert data[-TRAILER:] == hashlib.sha256(data[:-TRAILER]).digest()


def test_both_kinds_hold_the_same_payload_and_decoded_values(files):
    parsed = {k: reader.parse(d) for k, d in files.items()}
    (h0, p0), (h1, p1) = parsed["sha256"], parsed["blake3"]
    assert bytes(p0) == bytes(p1)
    assert h0["decoded_sha256"] == reader.decoded_digest(h1, p1, "sha256")
    for a, b in zip(C.entries_by_name(h0, p0, reader.read_tables(h0, p0), verify_decoded=True).values(),
                    C.entries_by_name(h1, p1, reader.read_tables(h1, p1), verify_decoded=True).values()):
        for x, y in zip(a, b) if isinstance(a, tuple) else [(a, b)]:
            assert np.asarray(x).tobytes() == np.asarray(y).tobytes() and np.asarray(x).dtype == np.asarray(y).dtype


@pytest.mark.parametrize("name", HASHES)
def test_a_flipped_byte_is_caught_in_trailer_header_and_payload(files, name):
    data = files[name]
    _, _, _, hlen = PREFIX.unpack_from(data, 0)
    label = integrity.hash_label(name)
    for at in (len(data) - 1, len(data) - TRAILER, PREFIX.size + 3, PREFIX.size + hlen + 5, 12):   # 12: the flags
        bad = bytearray(data)
        bad[at] ^= 0x04
        _refused(bytes(bad), "checksum mismatch|unknown|integrity hash")
    # a payload byte changed and the trailer recomputed: the payload digest catches it
    payload = bytearray(data[PREFIX.size + hlen:-TRAILER])
    payload[7] ^= 0x01
    _refused(_reseal(data, payload=bytes(payload)), f"payload {label} mismatch")
    # ... and with the payload digest recomputed too, the decoded digest does
    header = json.loads(data[PREFIX.size:PREFIX.size + hlen])
    codes = next(e for e in header["entries"] if e["kind"] == "moments")["sections"]["m_codes"]
    payload = bytearray(data[PREFIX.size + hlen:-TRAILER])
    payload[codes[0] + 3] ^= 0x01
    _refused(_reseal(data, payload=bytes(payload), fix_payload=True), f"decoded moments {label} mismatch")
    # the decoded digest itself edited
    header["decoded_sha256"] = "0" * 64
    _refused(_reseal(data, header=header), f"decoded moments {label} mismatch")
    with pytest.raises(ContainerError, match=f"decoded moments {label} mismatch"):
        h, p = reader.parse(_reseal(data, header=header))
        C.entries_by_name(h, p, reader.read_tables(h, p), verify_decoded=True)


def test_a_blake3_file_sealed_with_sha256_is_refused(files):
    """Negative control: the prefix says BLAKE3, every digest is a SHA-256 (or the reverse)."""
    blake, sha = files["blake3"], files["sha256"]
    hb_len = PREFIX.unpack_from(blake, 0)[3]
    body = blake[:-TRAILER]
    _refused(body + hashlib.sha256(body).digest(), "trailing BLAKE3")
    body = sha[:-TRAILER]
    _refused(body + _digest("blake3", body).digest(), "trailing SHA-256")
    header = json.loads(blake[PREFIX.size:PREFIX.size + hb_len])
    header["payload_sha256"] = hashlib.sha256(blake[PREFIX.size + hb_len:-TRAILER]).hexdigest()
    _refused(_reseal(blake, header=header), "payload BLAKE3 mismatch")


@pytest.mark.parametrize("flags, match", [(2, "integrity hash id 2 is unknown"), (0xFF, "integrity hash id 255 is unknown"),
                                          (0x100, "unknown flags 0x100"), (0x101, "unknown flags 0x101")])
def test_a_file_claiming_an_unknown_hash_is_refused_in_one_line(files, tmp_path, flags, match):
    data = _reseal(files["blake3"], flags=flags)
    _refused(data, match)
    path = tmp_path / "unknown.jg"
    path.write_bytes(data)
    r = subprocess.run([sys.executable, "-m", "jaxguard.format.reader", str(path)], capture_output=True, text=True,
                       env=ENV)
    assert r.returncode == 1 and r.stdout.count("\n") == 1 and match in r.stdout and not r.stderr, (r.stdout, r.stderr)


@pytest.mark.parametrize("declared", ["sha256", "md5", 3, None, ["blake3"]])
def test_a_header_hash_that_disagrees_with_the_prefix_is_refused(files, declared):
    data = files["blake3"]
    hlen = PREFIX.unpack_from(data, 0)[3]
    header = json.loads(data[PREFIX.size:PREFIX.size + hlen])
    header["hash"] = declared
    _refused(_reseal(data, header=header), "header declares integrity hash")


def test_a_sha256_prefix_with_a_header_naming_blake3_is_refused(files):
    data = files["sha256"]
    hlen = PREFIX.unpack_from(data, 0)[3]
    header = json.loads(data[PREFIX.size:PREFIX.size + hlen])
    header["hash"] = "blake3"
    _refused(_reseal(data, header=header), "header declares integrity hash 'blake3' but the prefix 'sha256'")


@pytest.mark.parametrize("name", OLD_GOLDEN)
def test_old_golden_files_verify_with_sha256_as_before(name):
    path = os.path.join(HERE, f"{name}.jaxguard")
    with open(path, "rb") as fh:
        data = fh.read()
    assert PREFIX.unpack_from(data, 0)[2] == 0
    assert data[-TRAILER:] == hashlib.sha256(data[:-TRAILER]).digest()
    info = reader.verify_file(path)
    header, payload = reader.parse(data)
    assert info["hash"] == "sha256" and "hash" not in header
    assert header["payload_sha256"] == hashlib.sha256(payload).hexdigest()


@pytest.mark.parametrize("codec", NEW_GOLDEN)
def test_blake3_golden_files_verify_and_decode_to_the_same_bits(codec):
    expected = np.load(os.path.join(HERE, "blake3.expected.npz"))
    path = os.path.join(HERE, f"blake3-{codec}.jaxguard")
    info = reader.verify_file(path)
    assert info["hash"] == "blake3" and info["decoded_sha256"] == str(expected[f"{codec}/decoded_blake3"])
    with open(path, "rb") as fh:
        header, payload = reader.parse(fh.read())
    assert hashlib.sha256(payload).hexdigest() == str(expected[f"{codec}/payload_sha256"])
    assert reader.decoded_digest(header, payload, "sha256") == str(expected[f"{codec}/decoded_sha256"])
    entry = next(e for e in header["entries"] if e["name"] == "layer/w")
    m, v = reader.read_moments(entry, payload, reader.read_tables(header, payload))
    np.testing.assert_array_equal(np.asarray(m, np.float32).view(np.uint32), expected[f"{codec}/m_bits"])
    np.testing.assert_array_equal(np.asarray(v, np.float32).view(np.uint32), expected[f"{codec}/v_bits"])


@pytest.mark.parametrize("name", HASHES)
def test_the_numpy_reader_cli_verifies_both_kinds(files, tmp_path, name):
    path = tmp_path / f"{name}.jg"
    path.write_bytes(files[name])
    r = subprocess.run([sys.executable, "-m", "jaxguard.format.reader", str(path), "--json"], capture_output=True,
                       text=True, env=ENV)
    res = json.loads(r.stdout)
    assert r.returncode == 0 and res["ok"] and res["hash"] == name, r


@pytest.mark.parametrize("name", HASHES)
def test_streamed_in_place_writes_seal_with_the_hash_they_name(entries, tmp_path, monkeypatch, name):
    """The large-file route (`_InPlace`: header room, trailer read back) with each hash."""
    monkeypatch.setattr(C, "IN_PLACE_AFTER", 1)
    path = tmp_path / "big.jg"
    C.write_stream(str(path), [entries[1], entries[2], entries[0]], {"x": 1}, integrity_hash=name)
    data = path.read_bytes()
    assert reader.verify_bytes(data)["hash"] == name
    assert PREFIX.unpack_from(data, 0)[2] == integrity.hash_flags(name)


def test_an_unknown_hash_name_is_refused_before_anything_is_written(entries, tmp_path):
    path = tmp_path / "x.jg"
    with pytest.raises(ContainerError, match="unknown integrity hash 'md5'"):
        C.write_stream(str(path), entries, {"x": 1}, integrity_hash="md5")
    assert not os.listdir(tmp_path)
