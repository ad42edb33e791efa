"""Issue 7: reliability and security of the container, the reader, the CLI and the guard.

Corruption (bit flips, truncation, appends, foreign files) must always be refused by the
numpy-only reader; the CLI must fail with one line and no output file; atomic writes
survive SIGKILL; a malicious pickle is never run; odd float values are stored exactly;
and the guard's contract holds against the real torch Adam.  Also replays the fuzz corpus
written by bench/fuzz/fuzz_reader.py.
"""
from __future__ import annotations

import builtins
import hashlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
from hypothesis import given, settings, strategies as st  # noqa: E402

from jaxguard.format import container, reader  # noqa: E402
from jaxguard.format.reader import PREFIX, TRAILER, ReaderError  # noqa: E402

HERE = pathlib.Path(__file__).resolve().parents[1]   # tests/
ROOT = HERE.parent
CORPUS = HERE / "fuzz_corpus"
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
       "JAX_PLATFORMS": "cpu"}


# ---------------------------------------------------------------- fixtures
def _tiny_checkpoint():
    from torch_compat.models import odd_values_checkpoint
    return odd_values_checkpoint()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    import torch_compat
    ckpt = _tiny_checkpoint()
    data, summary = torch_compat.compress_checkpoint(ckpt)
    reader.verify_bytes(data)
    d = tmp_path_factory.mktemp("rel")
    path = d / "good.jg"
    path.write_bytes(data)
    ck = d / "ckpt.pt"
    torch.save(ckpt, ck)
    return {"data": data, "path": path, "dir": d, "ckpt": ckpt, "ckpt_path": ck}


def _hlen(data):
    return PREFIX.unpack_from(data, 0)[3]


def _refused(data):
    with pytest.raises(ReaderError):
        reader.verify_bytes(data)


def _all_refused(buf: bytearray, bit_positions):
    bad = []
    for i in bit_positions:
        buf[i // 8] ^= 1 << (i % 8)
        try:
            reader.verify_bytes(bytes(buf))
            bad.append(i)
        except ReaderError:
            pass
        finally:
            buf[i // 8] ^= 1 << (i % 8)
    return bad


# ---------------------------------------------------------------- (a) bit flips
def test_bitflips_header_first_last_and_sample_refused(built):
    data = built["data"]
    n = len(data)
    hend = PREFIX.size + _hlen(data)
    rng = random.Random(7)
    positions = set(range(0, hend * 8))                       # every bit of prefix + JSON header
    positions |= set(range(0, 64 * 8)) | set(range((n - 64) * 8, n * 8))
    positions |= set(rng.sample(range(n * 8), 2500))
    buf = bytearray(data)
    bad = _all_refused(buf, sorted(positions))
    assert not bad, f"{len(bad)} single-bit flips accepted, first at bit {bad[:5]}"
    assert bytes(buf) == data


# ---------------------------------------------------------------- (b), (c) truncation, appends
def test_truncations_refused(built):
    data = built["data"]
    n = len(data)
    rng = random.Random(8)
    offsets = set(range(0, 64)) | set(range(n - 64, n)) | set(rng.sample(range(n), min(n, 1500)))
    for k in sorted(offsets):
        _refused(data[:k])


# seeded random tails: every process collects the same ids (pytest-xdist workers compare them)
@pytest.mark.parametrize("extra", [b"\x00", b"\n", *(random.Random(n).randbytes(n) for n in (31, 32, 33)),
                                   b"JAXGUARD" * 100])
def test_appended_bytes_refused(built, extra):
    _refused(built["data"] + extra)


def test_appended_copy_of_trailer_refused(built):
    data = built["data"]
    _refused(data + hashlib.sha256(data).digest())


# ---------------------------------------------------------------- (d) foreign files
def test_foreign_files_refused(built, tmp_path):
    _refused(built["ckpt_path"].read_bytes())
    _refused(b"")
    _refused(os.urandom(10_000))
    _refused(b"JAXGUARD")
    _refused(b"JAXGUARD" + b"\x00" * 100)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    with pytest.raises(ReaderError):
        reader.verify_file(empty)
    with pytest.raises(ReaderError):
        reader.verify_file(tmp_path / "missing")


# ---------------------------------------------------------------- (e) CLI on corrupt files
def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "jaxguard", *map(str, args)], capture_output=True, text=True,
                          env=ENV, timeout=timeout, cwd=str(ROOT))


def _corrupt(built, tmp_path, name="bad.jg"):
    data = bytearray(built["data"])
    data[len(data) // 2] ^= 0x10
    p = tmp_path / name
    p.write_bytes(bytes(data))
    return p


def test_cli_verify_corrupt_one_line(built, tmp_path):
    p = _corrupt(built, tmp_path)
    r = _cli("verify", p)
    assert r.returncode != 0
    lines = [l for l in (r.stdout + r.stderr).splitlines() if l.strip()]
    assert len(lines) == 1, lines
    assert "checksum" in lines[0] or "SHA-256" in lines[0]
    assert "Traceback" not in r.stderr
    ok = _cli("verify", built["path"])
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_cli_restore_corrupt_exit2_no_output(built, tmp_path):
    p = _corrupt(built, tmp_path)
    out = tmp_path / "restored.pt"
    r = _cli("restore", p, "-o", out)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("jaxguard: error: "), r.stderr
    assert not out.exists()
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".restored.pt")]


def _reseal(header, payload):
    return container.seal(header, payload)


def _split(data):
    h = _hlen(data)
    return json.loads(data[PREFIX.size:PREFIX.size + h]), data[PREFIX.size + h:len(data) - TRAILER]


def _moments_entry(header):
    return next(e for e in header["entries"] if e["kind"] == "moments")


def test_cli_restore_crafted_header_one_line(built, tmp_path):
    header, payload = _split(built["data"])
    sec = _moments_entry(header)["sections"]
    sec["escape_pairz"] = sec.pop("escape_pairs")       # same range, so the layout still tiles
    p = tmp_path / "crafted.jg"
    p.write_bytes(_reseal(header, payload))
    from jaxguard import cli                              # in-process: same code path as the console script
    assert cli.main(["restore", str(p), "-o", str(tmp_path / "out.pt")]) == 2
    assert not (tmp_path / "out.pt").exists()


def test_restore_meta_tree_missing_tensor_is_jaxguard_error(built, tmp_path):
    import torch_compat
    from jaxguard.errors import JaxguardError
    header, payload = _split(built["data"])
    header["meta"]["tree"]["__dict__"].append(["ghost", {"__tensor__": "no/such/tensor"}])
    p = tmp_path / "ghost.jg"
    p.write_bytes(_reseal(header, payload))
    reader.verify_bytes(p.read_bytes())                 # the reader does not look at meta
    with pytest.raises(JaxguardError):
        torch_compat.restore_tree(p)


# ---------------------------------------------------------------- reader robustness on resealed headers
def _crafted_cases(data):
    header, payload = _split(data)
    cases = {}
    h = json.loads(json.dumps(header))
    sec = _moments_entry(h)["sections"]
    sec["escape_pairz"] = sec.pop("escape_pairs")
    cases["missing_section_key"] = _reseal(h, payload)
    h = json.loads(json.dumps(header))
    _moments_entry(h)["codec"] = ["log8"]
    cases["unhashable_codec"] = _reseal(h, payload)
    h = json.loads(json.dumps(header))
    _moments_entry(h)["shape"] = [2 ** 64, 1]
    cases["shape_beyond_int64"] = _reseal(h, payload)
    h = json.loads(json.dumps(header))
    _moments_entry(h)["shape"] = [2 ** 62, 4]        # product wraps to 0 in int64
    cases["shape_product_overflow"] = _reseal(h, payload)
    h = json.loads(json.dumps(header))
    h["tables"] = [1]
    cases["tables_not_a_dict"] = _reseal(h, payload)
    h = json.loads(json.dumps(header))
    del _moments_entry(h)["name"]
    cases["moments_without_name"] = _reseal(h, payload)
    hb = b'{"entries":[],"payload_bytes":' + b"9" * 5000 + b"}"
    body = PREFIX.pack(reader.MAGIC, 1, 0, len(hb)) + hb
    cases["json_int_over_4300_digits"] = body + hashlib.sha256(body).digest()
    hb = b'{"entries":[' + b"[" * 100000 + b"]" * 100000 + b"]}"
    body = PREFIX.pack(reader.MAGIC, 1, 0, len(hb)) + hb
    cases["json_nesting_100000"] = body + hashlib.sha256(body).digest()
    return cases


CRAFTED = ["missing_section_key", "unhashable_codec", "shape_beyond_int64", "shape_product_overflow",
           "tables_not_a_dict", "moments_without_name", "json_int_over_4300_digits", "json_nesting_100000"]
CRAFTED_RAISES = {"missing_section_key": KeyError, "unhashable_codec": TypeError, "shape_beyond_int64": OverflowError,
                  "tables_not_a_dict": AttributeError,
                  "moments_without_name": KeyError, "json_int_over_4300_digits": ValueError,
                  "json_nesting_100000": RecursionError}
CRAFTED_REASON = {
    "missing_section_key": "reader.read_moments: entry['sections']['escape_pairs'] KeyError (keys not validated)",
    "unhashable_codec": "reader.read_moments: `codec not in CODE_DTYPES` raises TypeError for a list codec",
    "shape_beyond_int64": "reader.shape_size: np.prod raises OverflowError for dims >= 2**63",
    "tables_not_a_dict": "reader.check_layout: (header['tables'] or {}).items() AttributeError for a list",
    "moments_without_name": "reader.read_moments: entry['name'] KeyError",
    "json_int_over_4300_digits": "reader.parse catches only JSONDecodeError; int > 4300 digits raises plain ValueError",
    "json_nesting_100000": "reader.parse: json.loads raises RecursionError on deeply nested header JSON",
}


# CRAFTED_RAISES / CRAFTED_REASON record what each case raised before the reader was fixed.
@pytest.mark.parametrize("case", CRAFTED)
def test_crafted_header_raises_reader_error(built, case):
    data = _crafted_cases(built["data"])[case]
    try:
        reader.verify_bytes(data)
    except ReaderError:
        return
    # verifying cleanly is not acceptable for these either (the payload/layout is broken)
    pytest.fail("crafted header verified")


# ---------------------------------------------------------------- fuzz corpus replay
def _corpus():
    return sorted(CORPUS.glob("*.bin")) if CORPUS.is_dir() else []


def _corpus_params():
    out = []
    for p in _corpus():
        # crash-* files made the reader raise a plain exception before it was fixed;
        # every file must now raise ReaderError or verify cleanly.
        out.append(pytest.param(p, id=p.name))
    return out


@pytest.mark.parametrize("path", _corpus_params())
def test_fuzz_corpus_replay(path):
    data = path.read_bytes()
    try:
        reader.verify_bytes(data)
    except ReaderError:
        pass


# ---------------------------------------------------------------- (f) atomic writes under SIGKILL
WRITER = textwrap.dedent("""
    import sys, numpy as np
    from jaxguard.format import container
    path, a, b = sys.argv[1:4]
    blobs = [open(a, 'rb').read(), open(b, 'rb').read()]
    i = 0
    while True:
        container.atomic_write(path, blobs[i % 2])
        if i == 0:
            print('first', flush=True)
        i += 1
""")


def test_atomic_write_survives_sigkill(tmp_path):
    from jaxguard.format import container
    rng = np.random.default_rng(3)
    blobs = []
    for k in range(2):
        arr = rng.standard_normal(1_000_000).astype(np.float32)         # 4 MB container
        blobs.append(container.build([container.Raw(f"x{k}", arr, None)], {"k": k}))
        reader.verify_bytes(blobs[-1])
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    a.write_bytes(blobs[0])
    b.write_bytes(blobs[1])
    target = tmp_path / "out" / "state.jg"
    target.parent.mkdir()
    container.atomic_write(target, blobs[1])                           # the "old" file
    pyrng = random.Random(11)
    for trial in range(6):
        proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target), str(a), str(b)],
                                stdout=subprocess.PIPE, env=ENV, cwd=str(ROOT))
        if trial % 2:
            assert proc.stdout.readline().strip() == b"first"
        time.sleep(pyrng.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        data = target.read_bytes()
        assert data in (blobs[0], blobs[1]), f"trial {trial}: {target} is neither the old nor the new file"
        reader.verify_bytes(data)
    leftovers = [f for f in os.listdir(target.parent) if f != "state.jg"]
    assert all(f.startswith(".state.jg.") and f.endswith(".tmp") for f in leftovers), leftovers


# ---------------------------------------------------------------- (g) malicious pickle
class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_refused_and_not_run(built, tmp_path):
    marker = tmp_path / "PWNED"
    evil = tmp_path / "evil.pt"
    ck = dict(built["ckpt"])
    ck["extra"] = _Evil(marker)
    torch.save(ck, evil)
    assert not marker.exists()
    out = tmp_path / "evil.jg"
    r = _cli("compress", evil, "-o", out)
    assert r.returncode == 2, r.stdout + r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("jaxguard: error: "), r.stderr
    assert "Traceback" not in r.stderr
    assert not marker.exists(), "the pickled payload ran"
    assert not out.exists()


# ---------------------------------------------------------------- (h) odd values through encode/decode
def _enc_dec(m, v, p, lr=1e-3, step=10, codec=None):
    import jaxguard as jg
    enc = jg.encode(m, v, p, jg.GuardConfig(lr=lr, step=step, codec=codec or jg.DEFAULT_CODEC))
    m2, v2 = jg.decode(enc)
    return np.asarray(m2), np.asarray(v2), enc


def _bits(x):
    return np.ascontiguousarray(x, np.float32).view(np.uint32)


def test_special_values_stored_exactly():
    f32 = np.float32
    rng = np.random.default_rng(0)
    n = 300
    m = (rng.standard_normal(n) * 1e-3).astype(f32)
    v = (rng.random(n) * 1e-6).astype(f32)
    p = rng.standard_normal(n).astype(f32)
    sub = np.array(1e-45, f32)
    special_m = {0: np.nan, 1: np.inf, 2: -np.inf, 3: f32(-np.nan)}
    special_v = {10: np.nan, 11: np.inf, 12: -np.inf, 13: f32(-1e-3), 14: -sub, 15: f32(-3.4e38), 16: -np.inf}
    for i, x in special_m.items():
        m[i] = x
    for i, x in special_v.items():
        v[i] = x
    v[20], m[21] = np.nan, np.inf                                  # both moments odd at once
    m[20], v[21] = -np.inf, -sub
    m2, v2, _ = _enc_dec(m, v, p)
    idx = sorted(set(special_m) | set(special_v) | {20, 21})
    np.testing.assert_array_equal(_bits(m2)[idx], _bits(m)[idx])
    np.testing.assert_array_equal(_bits(v2)[idx], _bits(v)[idx])


def test_edge_values_never_raise():
    f32 = np.float32
    big = np.finfo(f32).max
    vals = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, 1.17e-38, big, -big, big / 2, 1e38, 3e38], f32)
    n = vals.size
    for m, v in [(vals, np.abs(vals)), (vals, np.zeros(n, f32)), (np.zeros(n, f32), np.abs(vals)),
                 (-vals, np.full(n, -0.0, f32))]:
        m2, v2, _ = _enc_dec(m.copy(), v.copy(), vals.copy())
        assert m2.shape == (n,) and v2.shape == (n,)
        # zeros and -0.0 come back bitwise
        z = (m == 0)
        np.testing.assert_array_equal(_bits(m2)[z & (_bits(m) == 0)], 0)


@pytest.mark.parametrize("codec", ["log8", "log8-rel"])
@pytest.mark.parametrize("shape", [(0,), (3, 0), (), (1,), (1, 1), (255,), (257,), (300,), (7, 11, 5)])
def test_shapes_round_trip(shape, codec):
    rng = np.random.default_rng(1)
    m = (rng.standard_normal(shape) * 1e-3).astype(np.float32)
    v = (rng.random(shape) * 1e-6).astype(np.float32)
    p = rng.standard_normal(shape).astype(np.float32)
    m2, v2, enc = _enc_dec(m, v, p, codec=codec)
    assert m2.shape == shape and v2.shape == shape
    assert m2.dtype == np.float32 and v2.dtype == np.float32
    assert enc.stats["coordinates"] == int(np.prod(shape))
    if m.size and codec == "log8":
        # linear8: absolute error <= absmax/254 per block (log8-rel's error follows sqrt(v)
        # instead; both are judged by the guard, tested elsewhere)
        assert np.allclose(m2, m, rtol=0.02, atol=1e-2 * np.abs(m).max())
    if m.size:
        assert np.allclose(v2, v, rtol=0.05, atol=0)


def test_container_round_trip_special_values_exact(built):
    header, payload = reader.parse(built["data"])
    tables = reader.read_tables(header, payload)
    sd = built["ckpt"]["optimizer"]["state"][0]
    e = [e for e in header["entries"] if e["kind"] == "moments"][0]
    m, v = reader.read_moments(e, payload, tables)
    m0, v0 = sd["exp_avg"].numpy(), sd["exp_avg_sq"].numpy()
    assert m.shape == m0.shape
    # NaN, +Inf, -Inf in m (index 3 holds -0.0, which may come back as +0.0: same update)
    np.testing.assert_array_equal(_bits(m).reshape(-1)[:3], _bits(m0).reshape(-1)[:3])
    np.testing.assert_array_equal(_bits(v).reshape(-1)[4:9], _bits(v0).reshape(-1)[4:9])


# ---------------------------------------------------------------- (i) property: guard vs real torch Adam
f32s = st.floats(width=32, allow_nan=False, allow_infinity=False)


@st.composite
def adam_states(draw):
    n = draw(st.integers(1, 256))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    rng = np.random.default_rng(seed)
    mscale = draw(st.sampled_from([0.0, 1e-30, 1e-8, 1e-4, 1e-2, 1.0, 1e3]))
    vscale = draw(st.sampled_from([0.0, 1e-38, 1e-20, 1e-10, 1e-6, 1e-2, 1.0, 1e6]))
    pscale = draw(st.sampled_from([0.0, 1e-3, 1.0, 1e4]))
    m = (rng.standard_normal(n) * mscale).astype(np.float32)
    v = (rng.random(n) ** 3 * vscale).astype(np.float32)
    p = (rng.standard_normal(n) * pscale).astype(np.float32)
    k = draw(st.integers(0, 3))
    for _ in range(k):                                    # sprinkle extremes
        i = int(rng.integers(n))
        m[i] = draw(st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1e-38, 3e38, -3e38, np.nan, np.inf]))
        v[i] = draw(st.sampled_from([0.0, 1e-45, 1e-38, 3e38, np.inf]))
    step = draw(st.sampled_from([1, 2, 3, 10, 1000, 10 ** 6]))
    lr = draw(st.sampled_from([1e-6, 1e-4, 1e-3, 3e-2, 1.0]))
    return m, v, p, step, lr, seed


def _torch_step(p, m, v, g, step, lr):
    t = torch.nn.Parameter(torch.from_numpy(p.copy()))
    opt = torch.optim.Adam([t], lr=lr, foreach=False, fused=False)
    opt.load_state_dict({"state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.from_numpy(m.copy()),
                                       "exp_avg_sq": torch.from_numpy(v.copy())}},
                         "param_groups": [{**opt.state_dict()["param_groups"][0]}]})
    t.grad = torch.from_numpy(g)
    opt.step()
    return t.detach().numpy().copy()


@settings(max_examples=6, deadline=None)
@given(adam_states())
def test_guard_property_against_torch_adam(s):
    m, v, p, step, lr, seed = s
    tau = 0.01
    m2, v2, _ = _enc_dec(m, v, p, lr=lr, step=step)
    rng = np.random.default_rng(seed + 1)
    n = m.size
    grads = [np.zeros(n, np.float32), np.full(n, 0.2, np.float32), np.full(n, -0.2, np.float32)]
    grads += [rng.uniform(-0.2, 0.2, n).astype(np.float32) for _ in range(3)]
    for g in grads:
        p1 = _torch_step(p, m, v, g, step, lr)
        p2 = _torch_step(p, m2, v2, g, step, lr)
        both_nan = np.isnan(p1) & np.isnan(p2)
        with np.errstate(invalid="ignore"):
            gap = np.abs(p1.astype(np.float64) - p2.astype(np.float64))
        same = (p1 == p2) | both_nan
        ok = same | (gap <= tau * lr)
        assert ok.all(), (f"gap {np.nanmax(np.where(same, 0, gap)) / lr:.4g} lr at "
                          f"{np.flatnonzero(~ok)[:5]} (step {step}, lr {lr})")


def test_chunked_path_for_huge_tensors_matches_unchunked(monkeypatch, tmp_path):
    """Tensors above guard.MAX_PIECE elements (2**28; the path that carries 2**31+) are
    encoded in pieces and joined with 64-bit escape indices; shrinking MAX_PIECE runs that
    path here and must give the same codes, escapes and container as one piece."""
    import jaxguard as jg
    from jaxguard.core import guard
    rng = np.random.default_rng(11)
    shape = (37, 1000)
    v = rng.lognormal(-14, 2, shape).astype(np.float32)
    m = (rng.normal(0, 1, shape) * np.sqrt(v) * 0.3).astype(np.float32)
    p = rng.normal(0, 0.05, shape).astype(np.float32)
    m[3, 5], v[30, 999] = np.nan, -1.0
    cfg = jg.GuardConfig(lr=1e-3, step=100, codec="log8")
    whole = jg.encode(m, v, p, cfg)
    monkeypatch.setattr(guard, "MAX_PIECE", 4096)
    pieces = jg.encode(m, v, p, cfg)
    assert pieces.shape == shape and pieces.arrays["escape_index"].dtype == np.int64
    for k in ("m_codes", "v_codes", "m_params", "v_params", "escape_m", "escape_v"):
        np.testing.assert_array_equal(pieces.arrays[k], whole.arrays[k])
    np.testing.assert_array_equal(pieces.arrays["escape_index"], whole.arrays["escape_index"])
    assert pieces.stats["escapes"] == whole.stats["escapes"] and pieces.stats["coordinates"] == m.size
    a = [np.asarray(x) for x in jg.decode(pieces)]
    b = [np.asarray(x) for x in jg.decode(whole)]
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))


def test_overflowing_bound_never_certifies():
    """Regression (found by the hypothesis property test): m = 3e38 with v = 0 makes every
    cell's bound NaN; XLA's vectorised max over cells dropped the NaNs and returned -inf
    for batches of >= 1024 coordinates, which passed `<= threshold`, and log8-rel's
    3.0000002e38 was certified with a real gap of 1.2e33 lr."""
    import jax.numpy as jnp
    import jaxguard as jg
    from jaxguard.core import bound as B
    cfg = jg.GuardConfig(lr=1e-6, step=1)
    n = 1024
    k = np.repeat(np.asarray(B.pack_constants(cfg.constants(), 0.01))[None], n, 0)
    z = np.zeros(n, np.float32)
    b = np.asarray(B.batch_bound_pc(k, np.full(n, 3e38, np.float32), z, np.full(n, 3.0000002e38, np.float32), z, z,
                                    np.full(n, 0.2, np.float32), jnp.asarray(B.unit_edges(0))))
    assert np.all(b == np.inf)
    m = np.array([0, 0, 3e38, -0.0, 0, 0, -0.0, 0, 0, 0], np.float32)
    v = np.array([427831.2, 155845.34, 0, 490102.9, 27871.822, 93266.53, 2408.3508, 65505.89, 8421.833, 18049.332],
                 np.float32)
    m2, v2, enc = _enc_dec(m, v, np.zeros(10, np.float32), lr=1e-6, step=1, codec="log8-rel")
    assert m2[2] == m[2] and 2 in enc.arrays["escape_index"]
