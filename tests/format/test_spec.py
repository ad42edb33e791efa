"""The codec registry (jaxguard.format.spec) is the one place that knows codec ids: the
numpy reader, the torch decoder, the container writer and the CLI all go through it."""
import ast
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxguard.errors import ConfigError
from jaxguard.format import reader, spec
from jaxguard.format.reader import PREFIX, TRAILER, ReaderError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "tests", "golden", "containers")
EXPECTED = np.load(os.path.join(GOLDEN, "expected.npz"))
FORMAT_MODULES = ("spec", "reader", "container", "packed", "storage")


def _golden_hash(codec) -> str:
    """The decoded hash a codec's golden container must verify with: expected.npz, or the
    codec's own ``<codec>.expected.npz`` for codecs added after it (log8-rel-zstd)."""
    own = os.path.join(GOLDEN, f"{codec}.expected.npz")
    return str((np.load(own) if os.path.exists(own) else EXPECTED)[
        "decoded_sha256" if os.path.exists(own) else f"{codec}/decoded_sha256"])


def _golden(codec) -> bytes:
    with open(os.path.join(GOLDEN, f"{codec}.jaxguard"), "rb") as f:
        return f.read()


def _with_codec(data: bytes, codec) -> bytes:
    """`data` with every moments entry's codec field set to `codec`, resealed (the payload,
    and so payload_sha256 and decoded_sha256, unchanged)."""
    header, payload = reader.parse(data)
    for e in header["entries"]:
        if e["kind"] == "moments":
            e["codec"] = codec
    hb = json.dumps(header, separators=(",", ":")).encode("utf-8")
    body = PREFIX.pack(reader.MAGIC, reader.VERSION, 0, len(hb)) + hb + bytes(payload)
    return body + hashlib.sha256(body).digest()


@pytest.fixture
def registered():
    """Register codecs for one test and remove them afterwards."""
    added = []

    def add(codec_spec):
        added.append(spec.register(codec_spec).id)
        return codec_spec

    yield add
    for codec_id in added:
        spec.unregister(codec_id)


def test_registry_covers_every_decodable_id_and_nothing_else():
    # every base decode has a numpy and a torch implementation, and no implementation is
    # keyed by an id the registry does not have
    pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
    torch_decoders = pytest.importorskip("torch_compat.codes_torch").DECODERS
    assert set(reader.DECODERS) == set(spec.decode_ids()) == set(torch_decoders)
    for codec_id, s in spec.CODECS.items():
        assert s.id == codec_id and s.layout in spec.LAYOUTS
        assert reader.decoder(codec_id) is reader.DECODERS[s.decode]
        assert all(t in spec.TABLES for t in s.tables)
    # the golden containers (one per codec written by the previous main) name exactly the registry
    # (besides: the torch checkpoint, and three logrel-ans variants: 9..12-bit blocks, compact
    # models, rANS kind 4; and the BLAKE3-sealed files, blake3-<codec>)
    golden = {f[:-len(".jaxguard")] for f in os.listdir(GOLDEN)
              if f.endswith(".jaxguard") and not f.startswith("blake3-")} - {
        "torch-adam", "logrel-ans-wide", "logrel-ans-compact", "logrel-ans-kind4"}
    assert golden == set(spec.CODECS)
    # ids the old reader half-recognised by prefix are refused now
    data = _golden("block8")
    for codec_id in ("block8-foo", "log8 ", "LOG8"):
        with pytest.raises(ReaderError, match="unknown codec"):
            reader.verify_bytes(_with_codec(data, codec_id))


def test_unknown_codec_is_one_line_reader_error_naming_the_registered_ids():
    with pytest.raises(ReaderError) as exc:
        reader.verify_bytes(_with_codec(_golden("log8"), "zip8"))
    msg = str(exc.value)
    assert "\n" not in msg and "'zip8'" in msg
    assert all(codec_id in msg for codec_id in spec.CODECS), msg
    # decoding arrays directly: the same refusal
    with pytest.raises(ReaderError, match="registered: log8, log8-rel"):
        reader.decode_codes("zip8", 1, *([np.zeros(1)] * 4), {})
    # a lookup in the registry itself: one line, a ConfigError and a KeyError
    with pytest.raises(ConfigError, match="codec 'zip8' is unknown; registered: log8,") as exc:
        spec.get("zip8")
    assert isinstance(exc.value, KeyError) and "\n" not in str(exc.value)


@pytest.mark.parametrize("base", ["log8", "block8", "bf16"])
def test_codec_registered_at_run_time_is_read_by_reader_and_torch(registered, base):
    """One registry entry, `decode=` an existing id, and nothing else: the numpy reader and
    the torch decoder read its containers bit for bit."""
    pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
    codes_torch = pytest.importorskip("torch_compat.codes_torch")
    b = spec.get(base)
    new = registered(spec.CodecSpec(f"{base}-copy", "test", b.m_code_dtype, b.v_code_dtype, b.m_params, b.v_params,
                                    decode=base, tables=b.tables))
    data = _with_codec(_golden(base), new.id)
    info = reader.verify_bytes(data)
    assert info["ok"] and info["decoded_sha256"] == str(EXPECTED[f"{base}/decoded_sha256"])
    header, payload = reader.parse(data)
    tables = reader.read_tables(header, payload)
    entry = next(e for e in header["entries"] if e["name"] == "layer/w")
    assert entry["codec"] == new.id
    m, v = reader.read_moments(entry, payload, tables)
    tm, tv = codes_torch.read_moments(entry, payload, tables)
    for got_m, got_v in ((np.asarray(m), np.asarray(v)), (tm.numpy(), tv.numpy())):
        np.testing.assert_array_equal(got_m.view(np.uint32), EXPECTED[f"{base}/m_bits"])
        np.testing.assert_array_equal(got_v.view(np.uint32), EXPECTED[f"{base}/v_bits"])
    # unregistered again: the same file is refused with the one-line error
    spec.unregister(new.id)
    with pytest.raises(ReaderError, match="unknown codec"):
        reader.verify_bytes(data)
    spec.register(new)   # so the fixture's clean-up finds it


def test_a_codec_without_its_tables_is_refused(registered):
    # declared like block8 but without tables: the reader refuses (the tables come from the registry)
    b = spec.get("block8")
    registered(spec.CodecSpec("block8-untabled", "test", "u1", "u1", 1, 1, decode="block8", tables=("dynamic8s",)))
    header, payload = reader.parse(_golden("block8"))
    entry = next(e for e in header["entries"] if e["kind"] == "moments")
    entry = {**entry, "codec": "block8-untabled"}
    tables = reader.read_tables(header, payload)
    reader.read_moments(entry, payload, tables)   # both tables present: reads
    with pytest.raises(ReaderError, match="block8-untabled entries need the dynamic8s tables"):
        reader.read_moments(entry, payload, {"dynamic8u": tables["dynamic8u"]})
    assert b.tables == ("dynamic8s", "dynamic8u")


def test_register_refuses_bad_entries():
    with pytest.raises(ConfigError, match="already registered"):
        spec.register(spec.CodecSpec("log8", "dup", "i1", "u1", 1, 2))
    with pytest.raises(ConfigError, match="decode='block8-unguarded' is not a registered base decode"):
        spec.register(spec.CodecSpec("x8", "t", "u1", "u1", 1, 1, decode="block8-unguarded"))
    with pytest.raises(ConfigError, match="layout='zip' is unknown"):
        spec.CodecSpec("x8", "t", "u1", "u1", 1, 1, layout="zip")
    with pytest.raises(ConfigError, match="tables \\['t9'\\] are unknown"):
        spec.CodecSpec("x8", "t", "u1", "u1", 1, 1, tables=("t9",))
    assert "x8" not in spec.CODECS


@pytest.mark.parametrize("codec", sorted(spec.CODECS))
def test_golden_containers_verify_and_report_certification(codec):
    data = _golden(codec)
    info = reader.verify_bytes(data)
    assert info["decoded_sha256"] == _golden_hash(codec)
    header, _ = reader.parse(data)
    entry = next(e for e in header["entries"] if e["kind"] == "moments")
    assert spec.entry_certified(entry) is (codec != "block8-unguarded")
    # certification as an option: a config saying certify: false marks any codec uncertified
    assert spec.entry_certified({**entry, "config": {"certify": False}}) is False
    assert spec.entry_certified({**entry, "config": {"certify": True}}) is spec.get(codec).certified


def test_block8_unguarded_is_block8_without_the_guard():
    plain, unguarded = spec.get("block8"), spec.get("block8-unguarded")
    assert unguarded.decode == "block8" and not unguarded.certified and plain.certified
    assert (unguarded.m_code_dtype, unguarded.v_code_dtype, unguarded.m_params, unguarded.v_params,
            unguarded.tables) == (plain.m_code_dtype, plain.v_code_dtype, plain.m_params, plain.v_params, plain.tables)


def test_cli_inspect_reports_certified(tmp_path, capsys):
    from jaxguard.cli.main import main
    for codec, want in (("block8-unguarded", False), ("log8-rel", True)):
        assert main(["inspect", os.path.join(GOLDEN, f"{codec}.jaxguard"), "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert out["certified"] is want and out["uncertified"] == (0 if want else 1)


def test_cli_codec_choices_come_from_the_registry():
    from jaxguard.cli.main import build_parser
    sub = next(a for a in build_parser()._actions if a.dest == "cmd").choices
    for verb in ("compress", "migrate"):
        codec = next(a for a in sub[verb]._actions if a.dest == "codec")
        assert tuple(codec.choices) == spec.codec_ids()
        assert codec.default in codec.choices
    assert spec.DEFAULT_CODEC in spec.codec_ids()


def test_one_block_size():
    from jaxguard.core import codes
    from jaxguard.format import packed
    assert reader.BLOCK == packed.BLOCK == codes.BLOCK == spec.BLOCK == 256
    pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
    codes_torch = pytest.importorskip("torch_compat.codes_torch")
    assert codes_torch.BLOCK == spec.BLOCK
    for path in ("jaxguard/format/reader.py", "jaxguard/format/packed.py", "jaxguard/format/container.py",
                 "jaxguard/core/codes.py", "torch_compat/codes_torch.py"):
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        assigned = [t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) for t in n.targets
                    if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)]
        assert "BLOCK" not in assigned, f"{path} defines its own BLOCK"


def test_format_layer_imports_only_numpy_errors_and_itself():
    # blake3: the integrity hash of new containers, imported when one is read or written
    allowed_top = set(sys.stdlib_module_names) | {"numpy", "__future__", "blake3"}
    for mod in FORMAT_MODULES:
        tree = ast.parse(open(os.path.join(ROOT, "jaxguard", "format", f"{mod}.py")).read())
        for n in ast.walk(tree):
            names = ([a.name for a in n.names] if isinstance(n, ast.Import)
                     else [n.module] if isinstance(n, ast.ImportFrom) and n.level == 0 else [])
            for name in names:
                ok = (name.split(".")[0] in allowed_top or name == "jaxguard.errors"
                      or name == "jaxguard.format" or name.startswith("jaxguard.format.") or name == "fsspec")
                assert ok, f"jaxguard/format/{mod}.py imports {name}"
    # at run time: writing and reading a container loads neither JAX, torch nor jaxguard.core
    code = ("import sys\n"
            "from jaxguard.format import container, packed, reader, spec, storage\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'torch', 'optax')"
            " or m.startswith('jaxguard.core'))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
