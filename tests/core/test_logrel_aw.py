"""logrel-aw: golden vectors (JAX = numpy = torch), packing, container round trip through the
numpy reader, the real-torch audit, and corrupted new sections rejected in one line."""
import functools
import os

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import jaxguard.core.guard as G  # noqa: E402
import torch_compat  # noqa: E402
from jaxguard.format import container, packed, reader  # noqa: E402
from jaxguard.errors import ConfigError, ContainerError  # noqa: E402
from torch_compat import codes_torch  # noqa: E402

GOLDEN = np.load(os.path.join(os.path.dirname(__file__), "..", "golden", "codes_aw_v1.npz"))
AW = packed.CODEC


def _golden_encoded():
    a = {k: GOLDEN[k] for k in ("m_codes", "v_codes", "m_params", "v_params", "widths", "escape_index")}
    idx = a["escape_index"]
    a.update(escape_m=GOLDEN["m"][idx], escape_v=GOLDEN["v"][idx])
    return G.Encoded(a, AW, GOLDEN["m"].shape)


def test_golden_decode_bit_identical_in_jax_numpy_torch():
    n = GOLDEN["m"].size
    e = _golden_encoded()
    want_m, want_v = GOLDEN["m_decoded_bits"], GOLDEN["v_decoded_bits"]
    jm, jv = G.decode_arrays(e.arrays, AW, n)
    t = {k: torch.from_numpy(np.array(GOLDEN[k])) for k in ("m_codes", "v_codes", "m_params", "v_params")}
    tm = codes_torch.rel8_decode(t["m_codes"], t["m_params"][:, 0], t["v_codes"], t["v_params"][:, 2],
                                 t["v_params"][:, 3], n)
    tv = codes_torch.log_decode(t["v_codes"], t["v_params"][:, 0], t["v_params"][:, 1], n)
    # numpy: from the packed bytes of the container, escapes removed (bits before escapes)
    hdr, pay = reader.parse(container.build([container.Moments("x", e, {})], {}))
    nm, nv = reader.read_moments(hdr["entries"][0], pay, {})
    nm, nv = nm.copy(), nv.copy()
    esc = GOLDEN["escape_index"]
    for name, (m, v) in {"jax": (jm, jv), "numpy": (nm, nv), "torch": (tm, tv)}.items():
        m = np.asarray(m, np.float32).view(np.uint32).copy()
        v = np.asarray(v, np.float32).view(np.uint32).copy()
        if name == "numpy":    # the reader returns the escapes' exact values
            assert np.array_equal(m[esc], GOLDEN["m"][esc].view(np.uint32))
            assert np.array_equal(v[esc], GOLDEN["v"][esc].view(np.uint32))
            keep = np.setdiff1d(np.arange(m.size), esc)
            m, v, wm, wv = m[keep], v[keep], want_m[keep], want_v[keep]
        else:
            wm, wv = want_m, want_v
        assert np.array_equal(m, wm), f"{name} m differs at {np.flatnonzero(m != wm)[:5]}"
        assert np.array_equal(v, wv), f"{name} v differs at {np.flatnonzero(v != wv)[:5]}"


def test_golden_params_are_in_stored_form():
    vp = GOLDEN["v_params"]
    lo, r = packed.lo_r(vp[:, 2], vp[:, 3])
    assert np.array_equal(lo.view(np.uint32), vp[:, 0].view(np.uint32))
    assert np.array_equal(r.view(np.uint32), vp[:, 1].view(np.uint32))
    assert not (GOLDEN["m_params"].view(np.uint32) & 0xFFFF).any()


def test_golden_encode_and_pack_are_stable():
    """The golden vectors were encoded with widths 4..8: every block keeps its codes bit for
    bit, except those that had escapes and now certify more at 9..12 bits (block 5 here)."""
    e = G.encode(GOLDEN["m"], GOLDEN["v"], GOLDEN["p"], G.GuardConfig(lr=1e-3, step=100, codec=AW))
    moved = np.flatnonzero(np.asarray(e.arrays["widths"]) != GOLDEN["widths"])
    assert moved.size and (np.maximum(*packed.split_widths(np.asarray(e.arrays["widths"])[moved])) > 8).all()
    same = np.setdiff1d(np.arange(GOLDEN["widths"].size), moved)
    coords = (same[:, None] * 256 + np.arange(256)).reshape(-1)
    coords = coords[coords < GOLDEN["m"].size]
    for k in ("m_codes", "v_codes"):
        assert np.array_equal(np.asarray(e.arrays[k])[coords], GOLDEN[k][coords]), k
    for k in ("m_params", "v_params"):
        assert np.array_equal(np.asarray(e.arrays[k])[same], GOLDEN[k][same]), k
    old_esc, new_esc = GOLDEN["escape_index"], np.asarray(e.arrays["escape_index"])
    kept = ~np.isin(old_esc // 256, moved)
    assert np.array_equal(new_esc[~np.isin(new_esc // 256, moved)], old_esc[kept])   # same escapes elsewhere
    for b in moved:                                    # and fewer in each block that moved
        assert (new_esc // 256 == b).sum() < (old_esc // 256 == b).sum(), b
    bm, bv = packed.split_widths(GOLDEN["widths"])
    qv = np.zeros(bv.size * 256, np.int64)
    qv[:GOLDEN["v"].size] = GOLDEN["v_codes"]
    n = GOLDEN["v"].size
    assert np.array_equal(packed.pack(qv, bv, n), GOLDEN["v_stream"])
    assert np.array_equal(packed.unpack(GOLDEN["v_stream"], bv, n), qv)
    assert np.array_equal(packed.varint_encode(GOLDEN["escape_index"]), GOLDEN["escape_varints"])


def test_pack_and_varint_round_trip():
    rng = np.random.default_rng(3)
    widths = rng.integers(4, 9, 37)
    codes = (rng.integers(0, 256, widths.size * 256) & ((1 << np.repeat(widths, 256)) - 1)).astype(np.uint8)
    for n in (codes.size, codes.size - 255, codes.size - 7):
        s = packed.pack(codes, widths, n)
        assert s.size == 32 * widths[:-1].sum() + -(-(n - 256 * 36) * widths[-1] // 8)
        want = codes.copy()
        want[n:] = 0
        assert np.array_equal(packed.unpack(s, widths, n), want)
    for lo_w, hi_w in ((9, 13), (0, 13)):  # 9..12-bit fields (up to 3 bytes each); 0 = a block without bits
        widths = rng.integers(lo_w, hi_w, 29)
        widths[:3] = (12, 9, 0)
        codes = (rng.integers(0, 1 << 12, widths.size * 256) & ((1 << np.repeat(widths, 256)) - 1)).astype(np.uint16)
        for n in (codes.size, codes.size - 255, codes.size - 7):
            s = packed.pack(codes, widths, n)
            assert s.size == 32 * widths[:-1].sum() + -(-(n - 256 * 28) * widths[-1] // 8)
            want = codes.copy()
            want[n:] = 0
            got = packed.unpack(s, widths, n)
            assert got.dtype == np.uint16 and np.array_equal(got, want)
    # a w <= 8 stream is the same bytes whichever dtype holds the codes
    narrow = rng.integers(4, 9, 5)
    c8 = (rng.integers(0, 256, 5 * 256) & ((1 << np.repeat(narrow, 256)) - 1)).astype(np.uint8)
    assert np.array_equal(packed.pack(c8, narrow, 5 * 256), packed.pack(c8.astype(np.uint16), narrow, 5 * 256))
    n = 10**9
    idx = np.unique(np.concatenate([[0, 127, 128, 16383, 16384, n - 1], rng.integers(0, n, 500)]))
    assert np.array_equal(packed.varint_decode(packed.varint_encode(idx), n), idx)
    assert packed.varint_decode(packed.varint_encode(idx[:0]), n).size == 0


@pytest.fixture(scope="module")
def odd():
    from torch_compat.models import odd_values_checkpoint
    ck = odd_values_checkpoint()
    data, s = torch_compat.compress_checkpoint(ck, codec=AW)
    return ck, data, s


def test_container_round_trip_and_real_torch_audit(odd, tmp_path):
    """Small trained model (Linear 20-30-3, 3 Adam steps, NaN/Inf/negative moments):
    restore through the numpy reader equals guard.decode bit for bit, and the real
    torch.optim.Adam update moves by at most tau*lr."""
    ck, data, s = odd
    path = tmp_path / "aw.jg"
    container.atomic_write(path, data)
    assert reader.verify_file(path)["ok"]
    restored, header = torch_compat.restore_tree(path)
    assert all(e["codec"] == AW for e in header["entries"] if e["kind"] == "moments")
    a = torch_compat.audit(ck, restored, tau=0.01, clip=0.2)
    assert a["violations"] == 0 and a["max_gap_lr"] <= 0.01
    for idx, st in ck["optimizer"]["state"].items():
        rs = restored["optimizer"]["state"][idx]
        om, ov = st["exp_avg"].numpy(), st["exp_avg_sq"].numpy()
        bad = ~np.isfinite(om) | ~np.isfinite(ov) | (ov < 0)    # stored exactly (escapes)
        assert bad.any() or idx != 0
        for o, r in ((om, rs["exp_avg"].numpy()), (ov, rs["exp_avg_sq"].numpy())):
            assert np.array_equal(o[bad].view(np.uint32), r[bad].view(np.uint32))
    assert s["payload_bytes"] == sum(e2[1] - e2[0] for e in header["entries"] if e["kind"] == "moments"
                                     for e2 in e["sections"].values())


def test_sparse_and_mask_escape_sections_both_decode():
    rng = np.random.default_rng(5)
    n = 256 * 8
    v = rng.lognormal(-14, 1, n).astype(np.float32)
    m = (rng.normal(0, 1, n) * np.sqrt(v) * 0.3).astype(np.float32)
    p = rng.normal(0, 0.05, n).astype(np.float32)
    few = m.copy()
    few[[3, 700]] = np.nan                                   # 2 escapes: sparse index
    many = m.copy()
    many[::3] = np.nan                                       # a third: bitmask
    for mm, kind in ((few, "escape_index"), (many, "escape_mask")):
        e = G.encode(mm, v, p, G.GuardConfig(lr=1e-3, step=100, codec=AW))
        hdr, pay = reader.parse(container.build([container.Moments("x", e, {})], {}))
        assert kind in hdr["entries"][0]["sections"]
        rm, rv = reader.read_moments(hdr["entries"][0], pay, {})
        gm, gv = G.decode(e)
        assert np.array_equal(rm.view(np.uint32), np.asarray(gm).view(np.uint32))
        assert np.array_equal(rv.view(np.uint32), np.asarray(gv).view(np.uint32))


# ---------------------------------------------------------------- corrupted sections
def _reseal(header, payload):
    return container.seal(header, payload, payload_digest=True)


def _edit(data, section, fn):
    hdr, pay = reader.parse(data)
    e = next(x for x in hdr["entries"] if x["kind"] == "moments" and section in x["sections"])
    b, end = e["sections"][section]
    p = bytearray(pay)
    p[b:end] = fn(bytes(p[b:end]))
    return _reseal(hdr, bytes(p))


@functools.lru_cache(maxsize=None)
def _sparse_container():
    rng = np.random.default_rng(6)
    n = 256 * 8                      # 8 blocks: the jit bucket of the golden vectors
    v = rng.lognormal(-14, 1, n).astype(np.float32)
    m = (rng.normal(0, 1, n) * np.sqrt(v) * 0.3).astype(np.float32)
    m[[5, 300]] = np.nan
    e = G.encode(m, v, rng.normal(0, 0.05, n).astype(np.float32), G.GuardConfig(lr=1e-3, step=100, codec=AW))
    return container.build([container.Moments("x", e, {})], {})


CORRUPT = {
    "widths out of range": ("widths", lambda b: bytes([0xD5]) + b[1:], "widths must be 4..12"),
    "v width below 4": ("widths", lambda b: bytes([0x83]) + b[1:], "widths must be 4..12"),
    "m code outside its width": ("m_codes", lambda b: b"\xff" * len(b), "outside its"),
    "varint unterminated": ("escape_index", lambda b: b[:-1] + bytes([b[-1] | 0x80]), "unterminated"),
    "varint index past the end": ("escape_index", lambda b: b"\x00" * (len(b) - 2) + b"\xff\x7f", "past the end"),
}


def test_varint_malformed_refused():
    with pytest.raises(packed.PackError, match="longer than 7 bytes"):
        packed.varint_decode(np.array([0xFF] * 8 + [1], np.uint8), 10**12)
    with pytest.raises(packed.PackError, match="unterminated"):
        packed.varint_decode(np.array([5, 0x81], np.uint8), 100)


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupted_new_sections_rejected_in_one_line(case):
    section, fn, msg = CORRUPT[case]
    data = _edit(_sparse_container(), section, fn)
    with pytest.raises(reader.ReaderError) as exc:
        reader.verify_bytes(data)
    text = str(exc.value)
    assert msg in text and "\n" not in text


def test_wrong_section_set_and_bad_params_refused():
    hdr, pay = reader.parse(_sparse_container())
    e = hdr["entries"][0]
    e["sections"]["escape_mask"] = e["sections"].pop("escape_index")   # both kinds are fine by name ...
    e["sections"]["v_params_x"] = e["sections"].pop("v_params")        # ... an unknown one is not
    with pytest.raises(reader.ReaderError, match="must have exactly the sections"):
        reader.verify_bytes(_reseal(hdr, bytes(pay)))
    enc = _golden_encoded()
    enc.arrays["v_params"] = enc.arrays["v_params"].copy()
    enc.arrays["v_params"][0, 1] = np.nextafter(enc.arrays["v_params"][0, 1], np.float32(np.inf))
    with pytest.raises(ContainerError, match="lo = wlo\\*wlo"):
        container.build([container.Moments("x", enc, {})], {})


def test_jit_paths_refuse_logrel_aw_clearly():
    from jaxguard.core import jit_encode
    x = np.ones(300, np.float32)
    with pytest.raises(ConfigError, match="logrel-aw"):
        jit_encode.encode_jit(x, x, x, G.GuardConfig(lr=1e-3, step=10, codec=AW), capacity=64)


@pytest.mark.parametrize("mu_dtype", ["float32", "bfloat16"])
def test_optax_adapter_logrel_aw_real_optax_audit(tmp_path, mu_dtype):
    """jaxguard.save/load with codec logrel-aw; audit with the real jitted optax update.
    bfloat16 mu takes the nu-only path, which codes v with log8-rel."""
    import jax
    import jax.numpy as jnp
    import optax

    import jaxguard as jg
    from jaxguard import optax_adapter as oa
    lr = 1e-3
    key = jax.random.PRNGKey(0)
    p = {"a": {"w": jax.random.normal(key, (24, 40)) * 0.1, "b": jnp.zeros(40)}}
    tx = optax.adam(lr, mu_dtype=jnp.dtype(mu_dtype))
    st = tx.init(p)
    for i in range(4):
        g = jax.tree_util.tree_map(lambda x: jnp.sin(x * (i + 3.0)) + 0.01 * (i + 1), p)
        u, st = tx.update(g, st, p)
        p = optax.apply_updates(p, u)
    s = jg.save(tmp_path / "o.jg", st, p, lr=lr, codec=AW)
    r = jg.load(tmp_path / "o.jg", like=tx.init(p))
    res = oa.audit(tx, st, r, p, lr=lr)
    assert res["violations"] == 0 and s["coordinates"] == 24 * 40 + 40, (res, s)
