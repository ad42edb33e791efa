"""logrel-ans (issue 17): logrel-aw's codes with rANS-coded m/v code streams.

Same guard, same widths, same escapes as logrel-aw, so the decoded moments are logrel-aw's
bit for bit; per tensor the payload is at most logrel-aw's.  End to end through the CLI and
torch_compat with the real torch.optim.Adam audit, the optax adapter with the real jitted
optax audit, and the new section's corruptions refused in one line (naming the entry)."""
import functools
import json
import os

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import jaxguard.core.guard as G  # noqa: E402
import torch_compat  # noqa: E402
from jaxguard.format import container, packed, rans, reader, spec  # noqa: E402
from torch_compat import models  # noqa: E402
from helpers import one_torch_thread  # noqa: E402,F401  (autouse)
from cli_batch import run_cli_batch  # noqa: E402

ANS, AW = "logrel-ans", packed.CODEC
TAU = 0.01


@functools.lru_cache(maxsize=None)
def _trained():
    ckpts, _, sample = models.train("transformer", seed=3, steps=40, fractions=(1.0,))
    ck = ckpts[1.0]
    return ck, models.next_gradients("transformer", ck, sample)


def _section_bytes(header):
    return {e["name"]: sum(b - a for a, b in e["sections"].values()) for e in header["entries"]
            if e["kind"] == "moments"}


@functools.lru_cache(maxsize=None)
def _both():
    ck, _ = _trained()
    out = {}
    for codec in (AW, ANS, "ans-no-rate"):
        fn = lambda: torch_compat.compress_checkpoint(ck, tau=TAU, codec=codec.replace("ans-no-rate", ANS))  # noqa: E731
        data, s = _rounds_off(fn) if codec == "ans-no-rate" else fn()
        out[codec] = (data, s, reader.parse(data)[0])
    return out


def test_registered_with_the_ans_layout_and_logrel_aw_decode():
    s = spec.get(ANS)
    assert s.layout == "ans" and s.decode == "log8-rel" and s.certified and ANS in spec.codec_ids()
    assert ANS in G.CODECS
    assert set(map(frozenset, spec.LAYOUTS["packed"])) < set(map(frozenset, spec.LAYOUTS["ans"]))


def _with_rate(fn, **settings):
    """fn() with `jaxguard.core.rate`'s module settings replaced, restored afterwards."""
    from jaxguard.core import rate
    saved = {k: getattr(rate, k) for k in settings}
    for k, v in settings.items():
        setattr(rate, k, v)
    try:
        return fn()
    finally:
        for k, v in saved.items():
            setattr(rate, k, v)


def _rounds_off(fn):
    """fn() with the rate pass off, logrel-ans's own width search kept."""
    return _with_rate(fn, ROUNDS=0)


def _without_rate_pass(fn):
    """fn() with the rate pass off and logrel-aw's width search (every level): logrel-ans's
    codes are then logrel-aw's, only stored otherwise."""
    return _with_rate(fn, ROUNDS=0, SEARCH_MAX_LEVEL=None)


def test_without_the_rate_pass_same_escapes_and_decoded_bits_as_logrel_aw_and_payload_never_larger():
    """The rANS storage alone: with the rate pass off, logrel-ans certifies and restores exactly
    logrel-aw's values (same escapes, decoded hash) and no section is larger."""
    ck, _ = _trained()
    daw, saw = torch_compat.compress_checkpoint(ck, tau=TAU, codec=AW)
    dans, sans = _without_rate_pass(lambda: torch_compat.compress_checkpoint(ck, tau=TAU, codec=ANS))
    haw, hans = reader.parse(daw)[0], reader.parse(dans)[0]
    assert sans["escapes"] == saw["escapes"] and sans["coordinates"] == saw["coordinates"]
    assert reader.verify_bytes(dans)["decoded_sha256"] == reader.verify_bytes(daw)["decoded_sha256"]
    paw, pans = _section_bytes(haw), _section_bytes(hans)
    assert paw.keys() == pans.keys()
    assert all(pans[k] <= paw[k] for k in paw), {k: (paw[k], pans[k]) for k in paw if pans[k] > paw[k]}
    forms = [("mv_rans" in e["sections"]) for e in hans["entries"] if e["kind"] == "moments"]
    assert any(forms) and not all(forms)          # big matrices rANS-coded, tiny vectors packed
    assert sum(pans.values()) < sum(paw.values()) and sans["payload_bytes"] == sum(pans.values())


def test_rate_pass_keeps_the_widths_and_escapes_no_more_and_stores_less():
    """With the rate pass (the default): the same widths and block parameters as without it
    (logrel-ans's width search), other codes, no more escapes, fewer bytes than without it and
    than logrel-aw; the payload stat is the sections' size."""
    b = _both()
    (daw, saw, haw), (dans, sans, hans) = b["ans-no-rate"], b[ANS]
    assert sans["escapes"] <= saw["escapes"] and sans["coordinates"] == saw["coordinates"]
    assert reader.verify_bytes(dans)["decoded_sha256"] != reader.verify_bytes(daw)["decoded_sha256"]
    assert sans["payload_bytes"] < 0.97 * b[AW][1]["payload_bytes"]
    paw, pans = _section_bytes(haw), _section_bytes(hans)
    _, pa = reader.parse(daw)
    _, pn = reader.parse(dans)
    for ea, en in zip(haw["entries"], hans["entries"]):
        if en["kind"] == "moments":
            for k in ("widths", "v_params"):
                (a0, a1), (n0, n1) = ea["sections"][k], en["sections"][k]
                assert bytes(pa[a0:a1]) == bytes(pn[n0:n1]), (en["name"], k)
    assert sum(pans.values()) < sum(paw.values()) and sans["payload_bytes"] == sum(pans.values())


def test_encoded_arrays_equal_logrel_aw_and_jax_decode_matches_the_reader():
    rng = np.random.default_rng(11)
    n = 256 * 30 + 17
    v = rng.lognormal(-14, 1.5, n).astype(np.float32)
    m = (rng.normal(0, 1, n) * np.sqrt(v) * 0.3).astype(np.float32)
    m[[4, 999]] = np.nan
    p = rng.normal(0, 0.05, n).astype(np.float32)
    ea = G.encode(m, v, p, G.GuardConfig(lr=1e-3, step=100, codec=AW))
    off = _without_rate_pass(lambda: G.encode(m, v, p, G.GuardConfig(lr=1e-3, step=100, codec=ANS)))
    en = G.encode(m, v, p, G.GuardConfig(lr=1e-3, step=100, codec=ANS))
    own = _rounds_off(lambda: G.encode(m, v, p, G.GuardConfig(lr=1e-3, step=100, codec=ANS)))
    assert en.codec == ANS
    keep = np.ones(n, bool)
    keep[ea.arrays["escape_index"]] = False        # escaped codes are free: the pass sets them
    for k, a in ea.arrays.items():
        b = off.arrays[k]
        if k in ("m_codes", "v_codes"):
            a, b = np.asarray(a)[keep], np.asarray(b)[keep]
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)), k
    for k in ("widths", "v_params", "m_params"):      # the rate pass keeps the block parameters
        assert np.array_equal(own.arrays[k], en.arrays[k]), k
    hdr, pay = reader.parse(container.build([container.Moments("x", en, {})], {}))
    assert "mv_rans" in hdr["entries"][0]["sections"]
    rm, rv = reader.read_moments(hdr["entries"][0], pay, {})
    gm, gv = G.decode(en)
    assert np.array_equal(rm.view(np.uint32), np.asarray(gm).view(np.uint32))
    assert np.array_equal(rv.view(np.uint32), np.asarray(gv).view(np.uint32))
    assert en.stats["payload_bytes"] == sum(b - a for a, b in hdr["entries"][0]["sections"].values())


def test_torch_compat_round_trip_real_torch_adam_audit(tmp_path):
    ck, grads = _trained()
    data, s, header = _both()[ANS]
    path = tmp_path / "ans.jg"
    container.atomic_write(path, data)
    restored, header = torch_compat.restore_tree(path)
    a = torch_compat.audit(ck, restored, tau=TAU, clip=0.2, grads=grads)
    assert a["violations"] == 0 and a["max_gap_lr"] <= TAU, a
    assert all(torch.equal(restored["model"][k], t) for k, t in ck["model"].items())


def test_torch_compat_save_load_into_a_real_adam(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Tanh(), torch.nn.Linear(96, 8))
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3)
    x, y = torch.randn(128, 64), torch.randn(128, 8)
    for _ in range(15):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    path = tmp_path / "opt.jg"
    torch_compat.save(path, opt, codec=ANS)
    header, _ = reader.parse(path.read_bytes())
    assert {e["codec"] for e in header["entries"] if e["kind"] == "moments"} == {ANS}
    assert any("mv_rans" in e["sections"] for e in header["entries"] if e["kind"] == "moments")
    opt2 = torch.optim.Adam(model.named_parameters(), lr=1e-3)
    torch_compat.load(path, opt2)
    orig = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    back = {"model": model.state_dict(), "optimizer": opt2.state_dict()}
    a = torch_compat.audit(orig, back, tau=TAU, clip=0.2)
    assert a["violations"] == 0, a


def test_cli_compress_verify_restore_audit(tmp_path):
    ck, _ = _trained()
    src = tmp_path / "ckpt.pt"
    torch.save(ck, src)
    out = tmp_path / "ckpt.jg"
    r, verify, a, restore = run_cli_batch([["compress", src, "-o", out, "--codec", ANS, "--json"], ["verify", out],
                                           ["audit", src, out, "--json"], ["restore", out, "-o", tmp_path / "back.pt"]])
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["payload_bytes"] == _both()[ANS][1]["payload_bytes"]
    assert verify.returncode == 0
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["violations"] == 0
    assert restore.returncode == 0
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert set(back) == set(ck)


def test_optax_adapter_real_jitted_optax_audit(tmp_path):
    import jax
    import jax.numpy as jnp
    import optax

    import jaxguard as jg
    from jaxguard import optax_adapter as oa
    lr = 1e-3
    key = jax.random.PRNGKey(0)
    p = {"a": {"w": jax.random.normal(key, (64, 80)) * 0.1, "b": jnp.zeros(80)}}
    tx = optax.adam(lr)
    st = tx.init(p)
    for i in range(6):
        g = jax.tree_util.tree_map(lambda x: jnp.sin(x * (i + 3.0)) + 0.01 * (i + 1), p)
        u, st = tx.update(g, st, p)
        p = optax.apply_updates(p, u)
    s = jg.save(tmp_path / "o.jg", st, p, lr=lr, codec=ANS)
    saw = jg.save(tmp_path / "aw.jg", st, p, lr=lr, codec=AW)
    header, _ = reader.parse((tmp_path / "o.jg").read_bytes())
    assert any("mv_rans" in e["sections"] for e in header["entries"] if e["kind"] == "moments")
    assert s["payload_bytes"] <= saw["payload_bytes"] and s["escapes"] == saw["escapes"]
    r = jg.load(tmp_path / "o.jg", like=tx.init(p))
    res = oa.audit(tx, st, r, p, lr=lr)
    assert res["violations"] == 0 and s["coordinates"] == 64 * 80 + 80, (res, s)


# ---------------------------------------------------------------- corrupted mv_rans sections
def _reseal(header, payload):
    return container.seal(header, payload, payload_digest=True)


def _replace_section(data, name, section, new):
    """`data` with entry `name`'s `section` replaced by the bytes `new` (any length; later
    offsets shifted)."""
    hdr, pay = reader.parse(data)
    e = next(x for x in hdr["entries"] if x["name"] == name)
    b, end = e["sections"][section]
    shift = len(new) - (end - b)
    for x in hdr["entries"]:
        rngs = x["sections"].values() if x["kind"] == "moments" else [x["offsets"]]
        for r in rngs:
            if r[0] >= end:
                r[0] += shift
                r[1] += shift
    for r in hdr["tables"].values():
        if r[0] >= end:
            r[0] += shift
            r[1] += shift
    e["sections"][section] = [b, b + len(new)]
    return _reseal(hdr, bytes(pay[:b]) + bytes(new) + bytes(pay[end:]))


@functools.lru_cache(maxsize=None)
def _two_entry_container():
    rng = np.random.default_rng(12)
    ents = []
    for name, n in (("a", 256 * 9 + 3), ("b", 256 * 6)):
        v = rng.lognormal(-14, 1, n).astype(np.float32)
        m = (rng.normal(0, 1, n) * np.sqrt(v) * 0.3).astype(np.float32)
        e = G.encode(m, v, rng.normal(0, .05, n).astype(np.float32), G.GuardConfig(lr=1e-3, step=100, codec=ANS))
        ents.append(container.Moments(name, e, {}))
    data = container.build(ents, {})
    hdr, _ = reader.parse(data)
    assert all("mv_rans" in e["sections"] for e in hdr["entries"])
    return data


def _mv(data, name):
    hdr, pay = reader.parse(data)
    e = next(x for x in hdr["entries"] if x["name"] == name)
    b, end = e["sections"]["mv_rans"]
    w = np.frombuffer(bytes(pay[slice(*e["sections"]["widths"])]), np.uint8)
    return bytes(pay[b:end]), packed.split_widths(w), int(np.prod(e["shape"]))


def _all_max_m_code_buffer(data, name):
    """A valid rANS buffer whose m fields are all 2^bm - 1 (a code the format forbids)."""
    _, (bm, bv), n = _mv(data, name)
    nb = bm.size
    qm = np.repeat(((1 << bm) - 1)[:, None], 256, axis=1)
    qv = np.zeros((nb, 256), np.int64)
    return rans.encode_streams(np.stack([qm, qv]), np.stack([bm, bv]), n, lane_tails=np.full(nb, 0x3F80))


CORRUPT = {
    "kind byte without lane tails": lambda buf, d: bytes([0x01]) + buf[1:],
    "kind byte unknown": lambda buf, d: bytes([0x15]) + buf[1:],
    "truncated words": lambda buf, d: buf[:-2],
    "odd length": lambda buf, d: buf[:-1],
    "extra words": lambda buf, d: buf + b"\x00\x00",
    "empty": lambda buf, d: b"",
    "m code 2^bm - 1": lambda buf, d: _all_max_m_code_buffer(d, "b"),
}
MESSAGES = {"kind byte without lane tails": "lane tails", "kind byte unknown": "kind byte",
            "truncated words": "", "odd length": "whole", "extra words": "", "empty": "kind byte",
            "m code 2^bm - 1": "outside its"}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupted_mv_rans_refused_in_one_line_naming_the_entry(case):
    data = _two_entry_container()
    buf, _, _ = _mv(data, "b")
    bad = _replace_section(data, "b", "mv_rans", CORRUPT[case](buf, data))
    with pytest.raises(reader.ReaderError) as exc:
        reader.verify_bytes(bad)
    text = str(exc.value)
    assert "\n" not in text and "b.mv_rans" in text and MESSAGES[case] in text, text
    with pytest.raises(container.ContainerError):      # the loader path (decode_many pre-pass) too
        hdr, pay = reader.parse(bad)
        container.entries_by_name(hdr, pay, {})


def test_lane_tails_carry_the_m_scales_and_the_hash_covers_them():
    """A changed tail is a different (valid) m-scale: the rANS checks pass, the decoded-moments
    SHA-256 refuses the file."""
    data = _two_entry_container()
    buf, (bm, bv), n = _mv(data, "a")
    (sym, tails) = rans.decode_streams(buf, np.stack([bm, bv]), n, lane_tails=True)
    hdr, pay = reader.parse(data)
    e = next(x for x in hdr["entries"] if x["name"] == "a")
    m, _ = reader.read_moments(e, pay, {})
    assert tails.dtype == np.uint16 and tails.size == bm.size
    mod = rans.encode_streams(sym.astype(np.int64), np.stack([bm, bv]), n, lane_tails=tails ^ np.uint16(1))
    bad = _replace_section(data, "a", "mv_rans", mod)
    with pytest.raises(reader.ReaderError, match="decoded moments BLAKE3 mismatch"):
        reader.verify_bytes(bad)


def test_decode_many_prepass_equals_one_entry_at_a_time():
    data = _two_entry_container()
    hdr, pay = reader.parse(data)
    pre = reader.decode_rans_entries(hdr["entries"], pay)
    assert sorted(pre) == [0, 1]
    for k, e in enumerate(hdr["entries"]):
        a = reader.read_moments(e, pay, {}, pre[k])
        b = reader.read_moments(e, pay, {})
        assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32)) for x, y in zip(a, b))


def test_mixed_or_foreign_section_sets_refused():
    """The section names say which form an entry has: mv_rans with m_params, or an mv_rans
    under logrel-aw, are refused in one line."""
    data = _two_entry_container()
    hdr, pay = reader.parse(data)
    e = hdr["entries"][0]
    e["sections"]["m_params"] = e["sections"].pop("v_params")
    with pytest.raises(reader.ReaderError, match="must have exactly the sections") as exc:
        reader.verify_bytes(_reseal(hdr, bytes(pay)))
    assert "mv_rans" in str(exc.value) and "\n" not in str(exc.value)
    hdr, pay = reader.parse(data)
    hdr["entries"][0]["codec"] = AW
    with pytest.raises(reader.ReaderError, match="must have exactly the sections"):
        reader.verify_bytes(_reseal(hdr, bytes(pay)))


# ---------------------------------------------------------------- 9..12-bit blocks (issue 17, H17-wide)
def _two_populations(n, seed=5, ratio=0.9):
    """Half the coordinates with sqrt(v) near 2**-7, half near 2**-22 (v spans ~30 binades),
    |m|/sqrt(v) in 0.05..ratio: 8-bit log-v steps are too coarse for the optax-style update
    (and with ratio 12 8-bit m steps too)."""
    rng = np.random.default_rng(seed)
    sv = np.where(rng.random(n) < 0.5, 2.0**-7, 2.0**-22) * rng.uniform(0.5, 2.0, n)
    v = (sv * sv).astype(np.float32)
    m = (rng.choice([-1.0, 1.0], n) * rng.uniform(0.05, ratio, n) * sv).astype(np.float32)
    return m, v, rng.normal(0, 0.05, n).astype(np.float32)


def _optax_state(m, v, p, count):
    import jax.numpy as jnp
    import optax
    tx = optax.adam(1e-3)
    st = tx.init({"w": jnp.asarray(p)})
    adam = st[0]._replace(count=jnp.asarray(count, jnp.int32), mu={"w": jnp.asarray(m)}, nu={"w": jnp.asarray(v)})
    return tx, (adam,) + tuple(st[1:]), {"w": jnp.asarray(p)}


def test_two_population_block_fewer_escapes_with_wide_widths_and_real_optax_audit(tmp_path, monkeypatch):
    """Fails before the 9..12-bit widths: a block whose v spans ~30 binades escapes >5% of
    its coordinates at <= 8 bits; the wide widths certify almost all of them, the payload
    shrinks, and the real jitted optax.adam first update stays within tau*lr."""
    import jaxguard as jg
    from jaxguard import optax_adapter as oa
    from jaxguard.core import adaptive
    m, v, p = _two_populations(256 * 6 + 77)
    tx, st, params = _optax_state(m, v, p, 100)
    s = jg.save(tmp_path / "wide.jg", st, params, lr=1e-3, codec=ANS)
    header, _ = reader.parse((tmp_path / "wide.jg").read_bytes())
    e = next(x for x in header["entries"] if x["kind"] == "moments")
    res = oa.audit(tx, st, jg.load(tmp_path / "wide.jg", like=tx.init(params)), params, lr=1e-3, tau=TAU)
    assert res["violations"] == 0 and res["max_gap_lr"] <= TAU, res
    assert "mv_rans" in e["sections"] and not {"m_low", "v_low"} & set(e["sections"])   # whole fields (kind 4)
    # the width search alone (the rate pass off: it rescues escapes of its own)
    wide = _without_rate_pass(lambda: jg.save(tmp_path / "wide0.jg", st, params, lr=1e-3, codec=ANS))
    monkeypatch.setattr(adaptive, "WIDE_PAIRS", ())       # the same search, widths 4..8 only
    narrow = _without_rate_pass(lambda: jg.save(tmp_path / "narrow.jg", st, params, lr=1e-3, codec=ANS))
    assert narrow["escapes"] > 0.05 * m.size and wide["escapes"] < narrow["escapes"] // 10, (wide, narrow)
    assert wide["payload_bytes"] < narrow["payload_bytes"] and s["payload_bytes"] < wide["payload_bytes"]


@functools.lru_cache(maxsize=None)
def _wide_container():
    ents = []
    for name, n in (("a", 256 * 9 + 3), ("b", 40)):   # b: too few codes for rANS to pay (packed)
        m, v, p = _two_populations(n, seed=len(name) + n, ratio=12.0 if name == "a" else 0.9)
        e = G.encode(m, v, p, G.GuardConfig(lr=1e-3, step=100, codec=ANS))
        assert (np.maximum(*packed.split_widths(e.arrays["widths"])) > 8).any()
        ents.append(container.Moments(name, e, {}))
    return container.build(ents, {}), ents


def test_wide_blocks_decode_bit_identically_in_numpy_jax_and_torch():
    from torch_compat import codes_torch
    data, ents = _wide_container()
    hdr, pay = reader.parse(data)
    forms = {e["name"]: sorted(set(e["sections"]) & {"mv_rans", "m_low", "v_low", "m_codes"}) for e in hdr["entries"]}
    assert forms == {"a": ["mv_rans"], "b": ["m_codes"]}, forms   # both forms hold wide fields
    a = next(e for e in hdr["entries"] if e["name"] == "a")
    assert pay[a["sections"]["mv_rans"][0]] == rans.KIND_COMPACT_WIDE | rans.TAILS_FLAG   # rANS codes whole fields
    assert reader.verify_bytes(data)["ok"]
    for entry, (_, enc, _) in zip(hdr["entries"], ents):
        bm, bv = packed.split_widths(enc.arrays["widths"])     # 16-bit codes where a block is wider than 8
        assert enc.arrays["m_codes"].dtype == (np.int16 if bm.max() > 8 else np.int8)
        assert enc.arrays["v_codes"].dtype == (np.uint16 if bv.max() > 8 else np.uint8)
        codes = reader.read_codes(entry, pay, {})
        assert np.array_equal(codes["m_codes"], enc.arrays["m_codes"]) and np.array_equal(codes["v_codes"], enc.arrays["v_codes"])
        rm, rv = reader.read_moments(entry, pay, {})
        gm, gv = G.decode(enc)
        tm, tv = codes_torch.read_moments(entry, pay, {})
        for a, b in ((rm, gm), (rv, gv), (rm, tm.numpy()), (rv, tv.numpy())):
            assert np.array_equal(np.asarray(a, np.float32).view(np.uint32), np.asarray(b, np.float32).view(np.uint32))
        assert enc.stats["payload_bytes"] == sum(b - a for a, b in entry["sections"].values())


def _drop_section(data, name, section):
    hdr, pay = reader.parse(data)
    e = next(x for x in hdr["entries"] if x["name"] == name)
    b, end = e["sections"].pop(section)
    for x in hdr["entries"]:
        for r in (x["sections"].values() if x["kind"] == "moments" else [x["offsets"]]):
            if r[0] >= end:
                r[0] -= end - b
                r[1] -= end - b
    return _reseal(hdr, bytes(pay[:b]) + bytes(pay[end:]))


def test_wide_low_sections_checked_in_one_line():
    """The m_low / v_low sections of files written before rANS kind 4 (the golden file
    keeps that layout) are checked; a kind-4 entry carrying one is refused."""
    with open(os.path.join(os.path.dirname(__file__), "..", "golden", "containers", "logrel-ans-wide.jaxguard"), "rb") as f:
        old = f.read()
    for bad, msg in ((_drop_section(old, "layer/w", "m_low"), "has no m_low section"),
                     (_replace_section(old, "layer/w", "v_low", b"\x00" * 3), "v_low"),
                     (_replace_section(old, "layer/w", "widths", b"\xd9" + _section(old, "layer/w", "widths")[1:]),
                      "widths must be 4..12")):
        with pytest.raises(reader.ReaderError, match=msg) as exc:
            reader.verify_bytes(bad)
        assert "\n" not in str(exc.value)
    narrow = _two_entry_container()          # no block wider than 8 bits: a low section is refused
    hdr, pay = reader.parse(narrow)
    e = hdr["entries"][0]
    e["sections"]["m_low"] = [len(pay), len(pay)]
    with pytest.raises(reader.ReaderError, match="no block is wider than 8 bits") as exc:
        reader.verify_bytes(_reseal(hdr, bytes(pay)))
    assert "\n" not in str(exc.value)
    wide, _ = _wide_container()              # kind 4 codes whole fields: a low section is refused
    hdr, pay = reader.parse(wide)
    e = next(x for x in hdr["entries"] if x["name"] == "a")
    e["sections"]["v_low"] = [len(pay), len(pay)]
    with pytest.raises(reader.ReaderError, match="no block is wider than 12 bits") as exc:
        reader.verify_bytes(_reseal(hdr, bytes(pay)))
    assert "\n" not in str(exc.value)


def _section(data, name, section):
    hdr, pay = reader.parse(data)
    e = next(x for x in hdr["entries"] if x["name"] == name)
    return bytes(pay[slice(*e["sections"][section])])


def test_each_tensor_is_rans_encoded_once_per_save(monkeypatch):
    """The guard's payload stat builds the sections; the writer stores those (no second
    encode), and the payload is byte for byte the one of an unwatched save."""
    ck, _ = _trained()
    calls = []
    real = rans.encode_streams_many

    def counted(items, *a, **k):
        items = list(items)
        calls.append(len(items))
        return real(items, *a, **k)

    monkeypatch.setattr(rans, "encode_streams_many", counted)
    data, s = torch_compat.compress_checkpoint(ck, tau=TAU, codec=ANS)
    header = reader.parse(data)[0]
    n_moments = sum(e["kind"] == "moments" for e in header["entries"])
    assert sum(calls) == n_moments and len(calls) <= 2, calls     # one lane loop per guard group
    assert any("mv_rans" in e["sections"] for e in header["entries"] if e["kind"] == "moments")
    monkeypatch.undo()
    assert header["payload_sha256"] == _both()[ANS][2]["payload_sha256"]      # the same bytes either way
