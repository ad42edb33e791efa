"""Containers written by the main of 2026-12-01 (before the layout change of issue 12)
must still read, and decode bit for bit, with every later version: through the numpy
reader (verify + decode) and through the JAX decoder of the encoded form."""
import os

import numpy as np
import pytest

from jaxguard.format import reader

HERE = os.path.join(os.path.dirname(__file__), "..", "golden", "containers")
EXPECTED = np.load(os.path.join(HERE, "expected.npz"))
CODECS = ("log8", "log8-rel", "bf16", "block8", "block8-unguarded", "logrel-aw", "logrel-ans")
# written later, by tests/golden/make_ans_golden.py (issue 17): layer/w rANS-coded, layer/small packed


@pytest.mark.parametrize("codec", CODECS + ("torch-adam",))
def test_golden_container_verifies_with_the_same_decoded_hash(codec):
    info = reader.verify_file(os.path.join(HERE, f"{codec}.jaxguard"))
    assert info["ok"]
    assert info["decoded_sha256"] == str(EXPECTED[f"{codec}/decoded_sha256"])


@pytest.mark.parametrize("codec", CODECS)
def test_golden_container_decodes_to_the_same_bits(codec):
    with open(os.path.join(HERE, f"{codec}.jaxguard"), "rb") as f:
        header, payload = reader.parse(f.read())
    tables = reader.read_tables(header, payload)
    entry = next(e for e in header["entries"] if e["name"] == "layer/w")
    m, v = reader.read_moments(entry, payload, tables)
    np.testing.assert_array_equal(np.asarray(m, np.float32).view(np.uint32), EXPECTED[f"{codec}/m_bits"])
    np.testing.assert_array_equal(np.asarray(v, np.float32).view(np.uint32), EXPECTED[f"{codec}/v_bits"])


def test_golden_logrel_ans_has_both_forms_and_decodes_them_to_the_same_bits():
    """logrel-ans.jaxguard: layer/w in the mv_rans form, layer/small in the packed form; both
    decode bit for bit, alone and through the container-level decode_many pre-pass."""
    with open(os.path.join(HERE, "logrel-ans.jaxguard"), "rb") as f:
        header, payload = reader.parse(f.read())
    tables = reader.read_tables(header, payload)
    moments = [e for e in header["entries"] if e["kind"] == "moments"]
    assert {e["name"]: "mv_rans" in e["sections"] for e in moments} == {"layer/w": True, "layer/small": False}
    for e in moments:
        key = "logrel-ans" if e["name"] == "layer/w" else f"logrel-ans:{e['name']}"
        m, v = reader.read_moments(e, payload, tables)
        np.testing.assert_array_equal(np.asarray(m, np.float32).view(np.uint32), EXPECTED[f"{key}/m_bits"])
        np.testing.assert_array_equal(np.asarray(v, np.float32).view(np.uint32), EXPECTED[f"{key}/v_bits"])
    assert reader.decoded_digest(header, payload) == str(EXPECTED["logrel-ans/decoded_sha256"])


def _ans_golden(name):
    """A logrel-ans golden file with its own expected.npz: verified (same decoded hash), parsed;
    -> (expected, header, payload, moments entries, entry name -> mv_rans kind byte or None)."""
    expected = np.load(os.path.join(HERE, f"{name}.expected.npz"))
    path = os.path.join(HERE, f"{name}.jaxguard")
    info = reader.verify_file(path)
    assert info["ok"] and info["decoded_sha256"] == str(expected["decoded_sha256"])
    with open(path, "rb") as f:
        header, payload = reader.parse(f.read())
    moments = [e for e in header["entries"] if e["kind"] == "moments"]
    kinds = {e["name"]: payload[e["sections"]["mv_rans"][0]] if "mv_rans" in e["sections"] else None for e in moments}
    return expected, header, payload, moments, kinds


def test_golden_logrel_ans_compact_models_decode_to_the_same_bits():
    """logrel-ans-compact.jaxguard (tests/golden/make_ans_compact_golden.py): three entries
    whose mv_rans buffers carry compact models (kind byte 0x13) and one packed; every entry
    decodes bit for bit, alone and through the decode_many pre-pass."""
    expected, header, payload, moments, kinds = _ans_golden("logrel-ans-compact")
    assert kinds == {"layer/w": 0x13, "layer/big": 0x13, "layer/small": 0x13, "layer/tiny": None}
    pre = reader.decode_rans_entries(header["entries"], payload)
    assert len(pre) == 3
    for k, e in enumerate(header["entries"]):
        if e["kind"] != "moments":
            continue
        for m, v in (reader.read_moments(e, payload, {}), reader.read_moments(e, payload, {}, pre.get(k))):
            np.testing.assert_array_equal(np.asarray(m, np.float32).view(np.uint32), expected[f"{e['name']}/m_bits"])
            np.testing.assert_array_equal(np.asarray(v, np.float32).view(np.uint32), expected[f"{e['name']}/v_bits"])


def test_golden_logrel_ans_wide_blocks_decode_to_the_same_bits():
    """logrel-ans-wide.jaxguard (tests/golden/make_ans_wide_golden.py, issue 17 H17-wide):
    9..12-bit blocks, layer/w rANS-coded with its low bits in m_low / v_low, layer/small
    packed with 9..12-bit fields; numpy and torch decode them to the stored bits."""
    name = "logrel-ans-wide"
    info = reader.verify_file(os.path.join(HERE, f"{name}.jaxguard"))
    assert info["ok"] and info["decoded_sha256"] == str(EXPECTED[f"{name}/decoded_sha256"])
    with open(os.path.join(HERE, f"{name}.jaxguard"), "rb") as f:
        header, payload = reader.parse(f.read())
    moments = [e for e in header["entries"] if e["kind"] == "moments"]
    assert {e["name"]: sorted(set(e["sections"]) & {"mv_rans", "m_low", "v_low", "m_codes"}) for e in moments} == {
        "layer/w": ["m_low", "mv_rans", "v_low"], "layer/small": ["m_codes"]}
    pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
    torch_codes = pytest.importorskip("torch_compat.codes_torch")
    for e in moments:
        key = f"{name}:{e['name']}"
        for m, v in (reader.read_moments(e, payload, {}), torch_codes.read_moments(e, payload, {})):
            np.testing.assert_array_equal(np.asarray(m, np.float32).reshape(-1).view(np.uint32), EXPECTED[f"{key}/m_bits"])
            np.testing.assert_array_equal(np.asarray(v, np.float32).reshape(-1).view(np.uint32), EXPECTED[f"{key}/v_bits"])


def test_golden_logrel_ans_kind4_whole_wide_fields_decode_to_the_same_bits():
    """logrel-ans-kind4.jaxguard (tests/golden/make_ans_kind4_golden.py, issue 17): a tensor
    with 9..12-bit blocks rANS-coded whole (kind byte 0x14, no m_low / v_low), one of
    kind 0x13 and one packed, codes chosen by the rate pass; numpy (alone and through the
    decode_many pre-pass) and torch decode them to the stored bits."""
    expected, header, payload, moments, kinds = _ans_golden("logrel-ans-kind4")
    assert kinds == {"layer/wide": 0x14, "layer/w": 0x13, "layer/tiny": None}
    assert not any({"m_low", "v_low"} & set(e["sections"]) for e in moments)
    pre = reader.decode_rans_entries(header["entries"], payload)
    assert len(pre) == 2
    pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
    torch_codes = pytest.importorskip("torch_compat.codes_torch")
    for k, e in enumerate(header["entries"]):
        if e["kind"] != "moments":
            continue
        for m, v in (reader.read_moments(e, payload, {}), reader.read_moments(e, payload, {}, pre.get(k)),
                     torch_codes.read_moments(e, payload, {})):
            np.testing.assert_array_equal(np.asarray(m, np.float32).reshape(-1).view(np.uint32), expected[f"{e['name']}/m_bits"])
            np.testing.assert_array_equal(np.asarray(v, np.float32).reshape(-1).view(np.uint32), expected[f"{e['name']}/v_bits"])


def test_golden_log8_rel_zstd_decodes_to_the_same_bits():
    """log8-rel-zstd.jaxguard (tests/golden/make_zstd_golden.py, issue 57): 8-bit blocks,
    widened blocks (``widths`` / ``v_high``), code streams of two frames, streams stored as is,
    the 20-byte parameter form; the numpy reader (whole and frame by frame) and the torch
    decoder decode every entry to the stored bits, whatever zstd wrote them."""
    name = "log8-rel-zstd"
    expected = np.load(os.path.join(HERE, f"{name}.expected.npz"))
    info = reader.verify_file(os.path.join(HERE, f"{name}.jaxguard"))
    assert info["ok"] and info["decoded_sha256"] == str(expected["decoded_sha256"])
    with open(os.path.join(HERE, f"{name}.jaxguard"), "rb") as f:
        header, payload = reader.parse(f.read())
    moments = [e for e in header["entries"] if e["kind"] == "moments"]
    assert {e["name"] for e in moments} == {"layer/w", "layer/wide", "layer/big", "layer/tiny", "layer/explicit"}
    assert {"widths", "v_high"} <= set(next(e for e in moments if e["name"] == "layer/wide")["sections"])
    pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
    torch_codes = pytest.importorskip("torch_compat.codes_torch")
    for e in moments:
        want_m, want_v = expected[f"{e['name']}/m_bits"], expected[f"{e['name']}/v_bits"]
        for m, v in (reader.read_moments(e, payload, {}), torch_codes.read_moments(e, payload, {})):
            np.testing.assert_array_equal(np.asarray(m, np.float32).reshape(-1).view(np.uint32), want_m)
            np.testing.assert_array_equal(np.asarray(v, np.float32).reshape(-1).view(np.uint32), want_v)
        # the lazy, frame-by-frame read the writer's sample check uses gives the same codes
        whole = reader.read_codes(e, payload, {})
        lazy = reader.read_codes(e, payload, {}, lazy=True)
        n = int(np.prod(e["shape"])) if e["shape"] else 1
        at = np.unique(np.r_[0, n - 1, np.random.default_rng(0).integers(0, n, 64)])
        for key in ("m_codes", "v_codes"):
            np.testing.assert_array_equal(np.asarray(lazy[key][at]), np.asarray(whole[key])[at])


def test_golden_zstd_stream_vectors_decode_to_the_same_bytes():
    """tests/golden/zstd_v1.npz: each kind of stream (empty, stored as is, one frame, two
    frames, float planes) as written by the zstandard of issue 57 decodes to its bytes."""
    from jaxguard.format import entropy
    vectors = np.load(os.path.join(os.path.dirname(HERE), "zstd_v1.npz"))
    kinds = sorted({k.split("/")[0] for k in vectors.files})
    assert kinds == ["as_is", "empty", "one_frame", "planes", "two_frames"]
    for k in kinds:
        want = vectors[f"{k}/decoded"]
        got = entropy.decode_stream(vectors[f"{k}/stream"], k, want.size)
        np.testing.assert_array_equal(got, want)
    assert len(entropy.stream_frames(vectors["two_frames/stream"], "two_frames")[1]) == 2
