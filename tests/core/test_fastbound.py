"""The closed-form tier (jaxguard.core.fastbound): it encloses the real native difference over
the whole gradient range, refuses the edges, agrees with the cell partition, and the
variant cache is keyed so that a changed environment recomputes."""
import json

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

from jaxguard.core import bound, fastbound, guard  # noqa: E402
from torch_compat.enclosure import audit_enclosure, draw_cases  # noqa: E402
from jaxguard.core.opmodel import step_constants  # noqa: E402


def _k(op_model="torch-adam", lr=1e-3, step=100, tau=0.01, wd=0.0, betas=(0.9, 0.999), eps=1e-8):
    c = step_constants(op_model, lr=lr, step=step, betas=betas, eps=eps, weight_decay=wd)
    return bound.pack_constants(c, tau)


def _fast(k, m, v, mt, vt, p, clip):
    f = lambda x: np.asarray(x, np.float32)  # noqa: E731
    b, ok = fastbound.fast_bound(np.asarray(k, np.float32)[:, None], f(m), f(v), f(mt), f(vt), np.abs(f(p)), f(clip))
    return np.asarray(b), np.asarray(ok)


def _whole_range_points(clip, v, b2f, c2):
    """64 gradients over [-clip, clip]: 0, +-clip, geometric down to clip*2**-40, and
    around the peak of the coupling term (c2 g^2 ~ b2f v)."""
    geo = clip[:, None] * 2.0 ** -np.linspace(0, 40, 21)[None]
    peak = np.sqrt(b2f * v / c2)[:, None] * np.array([0.25, 0.5, 0.71, 1.0, 1.41, 2.0, 4.0])[None]
    lin = clip[:, None] * np.linspace(0.05, 0.95, 3)[None]
    pos = np.minimum(np.concatenate([geo, peak, lin], 1), clip[:, None])
    g = np.concatenate([np.zeros((clip.size, 1)), pos, -pos], 1).astype(np.float32)
    return g


@pytest.mark.parametrize("op_model,wd,lr", [("torch-adam", 0.0, 1e-3), ("torch-adamw", 0.1, 3e-3),
                                            ("torch-adamw", 1000.0, 3e-3)],   # lr*wd = 3: |1 - lr wd| > 1
                         ids=["adam", "adamw", "adamw-lr-wd-3"])
def test_closed_form_encloses_replay_over_whole_range(op_model, wd, lr):
    """Every usable closed-form bound >= |p1' - p2'| of the bit-exact torch replay at 64
    gradients spanning [-clip, clip] (the closed form claims the whole range)."""
    from torch_compat.replay import adam_step
    rng = np.random.default_rng(11)
    n = 1000
    d = draw_cases(rng, n)
    k = _k(op_model, lr=lr, step=7, wd=wd)
    b, ok = _fast(k, d["m"], d["v"], d["mt"], d["vt"], d["p"], d["clip"])
    assert ok.mean() > 0.99
    g = _whole_range_points(d["clip"].astype(np.float64), d["v"].astype(np.float64), float(k[2]), float(k[3]))
    P = g.shape[1]
    rep = lambda x: np.repeat(x, P)  # noqa: E731
    args = dict(step=7, lr=lr, weight_decay=wd, decoupled=op_model == "torch-adamw")
    p1 = adam_step(rep(d["p"]), g.reshape(-1), rep(d["m"]), rep(d["v"]), **args)[0].astype(np.float64)
    p2 = adam_step(rep(d["p"]), g.reshape(-1), rep(d["mt"]), rep(d["vt"]), **args)[0].astype(np.float64)
    actual = np.abs(p1 - p2).reshape(n, P).max(1)
    bad = ok & ~(actual <= b)
    assert not bad.any(), [(d["m"][i], d["v"][i], d["mt"][i], d["vt"][i], actual[i], b[i]) for i in np.flatnonzero(bad)[:3]]
    assert np.max(np.where(ok, actual / b, 0)) > 0.5   # not vacuous: some cases come close


def test_enclosure_audit_checks_the_closed_form():
    rep = audit_enclosure(4096, seed=3)
    assert rep["failures"] == 0 and rep["fast"]["failures"] == 0, rep["fast"]["failure_examples"]
    # the edge draws (float32 extremes, issue 10) go to the cells; the ordinary ones use the tier
    assert rep["fast"]["usable"] > 0.99 * (rep["cases"] - rep["edge_cases"]) and 0.5 < rep["fast"]["max_ratio"] <= 1
    nr = audit_enclosure(4096, seed=3, no_radius=True)   # ideal stage only: must be caught
    assert nr["fast"]["failures"] > 0


def test_closed_form_subset_of_cell_partition_at_default_tau():
    """At the default tau the closed form certifies nothing the cell partition (levels
    0-4) rejects; on random certifiable cases it takes a large share."""
    rng = np.random.default_rng(3)
    n = 8192
    d = draw_cases(rng, n)
    pabs = np.abs(d["p"])
    for lr, step in ((1e-3, 100), (1e-4, 0), (3e-2, 5000)):
        K = bound.stack_rows([_k(lr=lr, step=step)])
        gidx = np.zeros(n, np.int32)
        fast = guard.fast_accept(K, gidx, d["m"], d["v"], d["mt"], d["vt"], pabs, d["clip"])
        full = guard.certify_pc(K, gidx, d["m"], d["v"], d["mt"], d["vt"], pabs, d["clip"], np.arange(n), "shared",
                                "mixed", fast=False) >= 0
        assert not (fast & ~full).any()
        assert fast.sum() > 0.25 * full.sum()


def test_cell_levels_with_mixed_and_uniform_groups_per_chunk():
    """certify_pc with three constant rows: coordinates interleaved (chunks mixing groups)
    and grouped (chunks of one group, whose rows are built once) give, coordinate for
    coordinate, the levels each group gets alone with its single row."""
    rng = np.random.default_rng(5)
    n = 3000
    d = draw_cases(rng, n)
    pabs = np.abs(d["p"])
    ks = [_k(lr=1e-3, step=100), _k(lr=3e-4, step=7, wd=0.1, op_model="torch-adamw"), _k(lr=1e-2, step=2000)]
    K = bound.stack_rows(ks)

    def levels(gidx, rows, idx):
        return guard.certify_pc(rows, gidx, d["m"], d["v"], d["mt"], d["vt"], pabs, d["clip"], idx, "shared",
                                "mixed", fast=False)
    alone = np.empty(n, np.int8)
    for g, k in enumerate(ks):
        alone[g::3] = levels(np.zeros(n, np.int32), bound.stack_rows([k]), np.arange(g, n, 3))
    interleaved = np.arange(n, dtype=np.int32) % 3
    np.testing.assert_array_equal(levels(interleaved, K, np.arange(n)), alone)
    order = np.concatenate([np.arange(g, n, 3) for g in range(3)])   # one group after another
    np.testing.assert_array_equal(levels(interleaved, K, order), alone[order])
    assert (alone >= 0).any() and (alone < 0).any()


EDGE = [  # (name, m, v, mt, vt, p, constants overrides): the closed form must refuse
    ("huge-m", 2.0**61, 1e-6, 2.0**61 * 1.01, 1e-6, 0.1, {}),
    ("huge-v", 1e-3, 2.0**62, 1e-3, 2.0**62 * 1.1, 0.1, {}),
    ("huge-p", 1e-3, 1e-6, 1.01e-3, 1e-6, 2.0**61, {}),
    ("tiny-eps", 1e-3, 1e-6, 1.01e-3, 1.1e-6, 0.1, {"eps": 2.0**-70}),
    ("tiny-difference", 2.0**-79, 1e-6, 2.0**-79 * (1 + 2.0**-22), 1e-6, 0.1, {}),   # keep*|dm| < 2**-100
]


@pytest.mark.parametrize("name,m,v,mt,vt,p,over", EDGE, ids=[e[0] for e in EDGE])
def test_closed_form_refuses_edges(name, m, v, mt, vt, p, over):
    k = _k(**over)
    _, ok = _fast(k, [m], [v], [mt], [vt], [p], [0.2])
    assert not ok[0]


def test_closed_form_exact_zero_and_equal_moments_are_usable():
    k = _k()
    b, ok = _fast(k, [0.0, 1e-3, 1e-3], [0.0, 1e-6, 1e-6], [0.0, 1e-3, 1.001e-3], [0.0, 1e-6, 1e-6], [0.1] * 3, [0.2] * 3)
    assert ok.all() and np.all(b > 0) and np.all(b < k[9])   # only rounding terms remain, far below tau*lr


def test_decayed_parameter_term():
    """torch-adamw with lr*wd > 2 scales p by |1 - lr wd| > 1 before the update: the final
    rounding term must grow with it."""
    args = ([1e-3], [1e-6], [1.001e-3], [1e-6], [1e4], [0.2])
    b_small, _ = _fast(_k("torch-adamw", lr=1e-3, wd=0.0), *args)
    b_big, _ = _fast(_k("torch-adamw", lr=1e-3, wd=5000.0), *args)   # |1 - lr wd| = 4
    assert b_big[0] >= b_small[0] + 2 * bound.U * 3 * 1e4 * 0.99


def test_real_torch_audit_on_trained_checkpoint(tmp_path, monkeypatch):
    """A small trained model: the closed form takes most coordinates, and the real
    torch.optim.Adam audit finds no coordinate over tau."""
    monkeypatch.setattr(guard, "SPEED_TIERS_ABOVE", 0)   # the full ladder, as a larger group's
    monkeypatch.setattr(guard, "CELLS_TIERS_ABOVE", 0)
    from helpers import byte_transformer_round_trip
    summary, stats, res = byte_transformer_round_trip(tmp_path, seed=0, steps=15, lr=3e-3, weight_decay=0.1)
    assert sum(s["certified_fast"] for s in stats) > 0.5 * summary["coordinates"]
    assert res["violations"] == 0 and res["max_gap_lr"] <= 0.01


def test_a_small_groups_ladder_certifies_what_the_full_one_does(tmp_path, monkeypatch):
    """A model of fewer than `certify.SPEED_TIERS_ABOVE` coordinates certifies without the
    speed tiers (none of its coordinates is the closed form's or the cells tier's), the real
    torch.optim.AdamW audit finds none over tau, and the full ladder keeps the same codes."""
    from helpers import byte_transformer_round_trip
    from jaxguard.format import reader
    small, stats, res = byte_transformer_round_trip(tmp_path, seed=2, steps=5, lr=1e-3, weight_decay=0.01)
    assert small["coordinates"] <= guard.SPEED_TIERS_ABOVE
    assert sum(s["certified_fast"] + s["certified_fast_cells"] for s in stats) == 0
    assert sum(s["certified_adaptive"] for s in stats) > 0.5 * small["coordinates"]
    assert res["violations"] == 0 and res["max_gap_lr"] <= 0.01
    small_header, small_payload = reader.parse((tmp_path / "c.jg").read_bytes())
    monkeypatch.setattr(guard, "SPEED_TIERS_ABOVE", 0)
    monkeypatch.setattr(guard, "CELLS_TIERS_ABOVE", 0)
    full, stats, _ = byte_transformer_round_trip(tmp_path, seed=2, steps=5, lr=1e-3, weight_decay=0.01)
    assert sum(s["certified_fast"] for s in stats) > 0
    full_header, full_payload = reader.parse((tmp_path / "c.jg").read_bytes())
    assert full["escapes"] == small["escapes"]
    assert full_header["decoded_sha256"] == small_header["decoded_sha256"]
    assert bytes(full_payload) == bytes(small_payload)


def test_the_cells_tiers_follow_the_whole_state_not_a_slab(tmp_path, monkeypatch):
    """A state of at most `certify.CELLS_TIERS_ABOVE` coordinates skips the cells tiers (the
    closed form still runs on its groups above `certify.SPEED_TIERS_ABOVE`), the real torch
    audit holds, and the full ladder keeps the same codes.  The writer decides for the whole
    state: with the threshold below the state and slabs below the threshold, every slab runs
    the cells tiers."""
    import torch_compat
    from torch_compat import models
    from jaxguard import writer
    from jaxguard.format import reader
    torch.manual_seed(3)
    model = models.ByteTransformer(d=64, layers=2, heads=2, ctx=64)
    sample = models.text_batches(3)
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3, weight_decay=0.01, foreach=False)
    for _ in range(3):   # early: the closed form leaves the most
        opt.zero_grad()
        models.loss_fn(model, sample(True)).backward()
        opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}

    def compress(name):
        out = tmp_path / name
        summary = torch_compat.state.compress_checkpoint_to(out, ckpt)
        header, payload = reader.parse(out.read_bytes())
        stats = [e["stats"] for e in header["entries"] if e["kind"] == "moments"]
        return summary, stats, header["decoded_sha256"], bytes(payload), out

    small, stats, decoded, payload, out = compress("state.jg")
    assert guard.SPEED_TIERS_ABOVE < small["coordinates"] <= guard.CELLS_TIERS_ABOVE
    assert sum(s["certified_fast"] for s in stats) > 0
    assert sum(s["certified_fast_cells"] for s in stats) == 0
    restored, _ = torch_compat.restore_tree(out)
    res = torch_compat.audit(ckpt, restored)
    assert res["violations"] == 0 and res["max_gap_lr"] <= 0.01
    monkeypatch.setattr(guard, "CELLS_TIERS_ABOVE", small["coordinates"] - 1)
    # slabs above the small group's limit and below the state's threshold, the state above it
    monkeypatch.setattr(writer, "SLAB", guard.SPEED_TIERS_ABOVE + 4096)
    assert small["coordinates"] > writer.SLAB
    full, stats, full_decoded, full_payload, _ = compress("full.jg")
    assert sum(s["certified_fast_cells"] for s in stats) > 0
    assert (full["escapes"], full_decoded, full_payload) == (small["escapes"], decoded, payload)


def test_stream_writer_matches_build(tmp_path):
    """`write_stream` (entries one at a time) writes the same bytes as `build`."""
    from jaxguard.format import container
    rng = np.random.default_rng(0)
    m = rng.standard_normal(5000).astype(np.float32) * 1e-3
    v = (m * m * 3).astype(np.float32)
    p = rng.standard_normal(5000).astype(np.float32)
    entries = []
    for codec in ("log8-rel", "block8"):
        enc = guard.encode(m, v, p, guard.GuardConfig(lr=1e-3, step=10, codec=codec))
        entries.append(container.Moments(f"x/{codec}", enc, {"codec": codec}))
    entries.append(container.Raw("p", p, None))
    data = container.build(entries, {"framework": "test"})
    size = container.write_stream(tmp_path / "s.jg", iter(entries), {"framework": "test"})
    got = (tmp_path / "s.jg").read_bytes()
    assert size == len(got)
    from jaxguard.format import reader
    assert reader.verify_bytes(got)["ok"] and reader.verify_bytes(data)["ok"]
    # same entries and hashes; only the tables' position may differ (a stream meets them late)
    hs, _ = reader.parse(got)
    hb, _ = reader.parse(data)
    assert hs["decoded_sha256"] == hb["decoded_sha256"]


def test_variant_cache_is_keyed(tmp_path, monkeypatch):
    from torch_compat import variant, variant_cache
    from torch_compat.replay import detect_variant
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []

    def counted():
        calls.append(1)
        return detect_variant()

    variant.environment_fingerprint.cache_clear()
    v1, cached1 = variant_cache.cached_detect_variant(detect=counted)
    v2, cached2 = variant_cache.cached_detect_variant(detect=counted)
    assert (cached1, cached2, len(calls)) == (False, True, 1) and v1 == v2
    path = variant_cache.cache_path()
    assert path.exists() and json.loads(path.read_text())["variant"]["sqrt"] == v1.sqrt
    # another kernel setting is another environment: a different key, detected again
    monkeypatch.setenv("MKL_CBWR", "COMPATIBLE")
    variant.environment_fingerprint.cache_clear()
    try:
        assert variant_cache.cache_path() != path
        _, cached3 = variant_cache.cached_detect_variant(detect=counted)
        assert cached3 is False and len(calls) == 2
    finally:
        monkeypatch.delenv("MKL_CBWR")
        variant.environment_fingerprint.cache_clear()
    # a corrupt entry is ignored and rewritten
    path.write_text("{not json")
    _, cached4 = variant_cache.cached_detect_variant(detect=counted)
    assert cached4 is False and len(calls) == 3 and json.loads(path.read_text())["key"]


@pytest.mark.parametrize("max_level", [-1, None])
def test_reject_first_changes_no_level(max_level):
    """certify_pc's `reject_first` (the probes before the adaptive tier, for candidates most
    of which are refused: the rate pass's moves) refuses only coordinates the tiers refuse:
    every coordinate gets the same level, on adversarial cases (and their moves a few
    percent further off) where the probes refuse many and the tiers certify many."""
    rng = np.random.default_rng(11)
    n = 6000
    d = draw_cases(rng, n)
    far = rng.random(n) < 0.5     # moved decodings: as the rate pass tries them
    mt = np.where(far, d["mt"] + rng.uniform(-0.05, 0.05, n) * np.abs(d["m"]), d["mt"]).astype(np.float32)
    vt = np.where(far, d["vt"] * np.exp2(rng.uniform(-0.2, 0.2, n)), d["vt"]).astype(np.float32)
    pabs = np.abs(d["p"])
    ks = [_k(lr=1e-3, step=100), _k(lr=3e-4, step=7, wd=0.1, op_model="torch-adamw"), _k(lr=1e-2, step=2000)]
    K = bound.stack_rows(ks)
    gidx = (np.arange(n) % 3).astype(np.int32)

    def levels(reject_first):
        return guard.certify_pc(K, gidx, d["m"], d["v"], mt, vt, pabs, d["clip"], np.arange(n), "shared", "mixed",
                                max_level=max_level, reject_first=reject_first)
    before, after = levels(False), levels(True)
    np.testing.assert_array_equal(after, before)
    lower = np.asarray(bound.batch_lower_pc(K.take(gidx), d["m"], d["v"], mt, vt, d["clip"]))
    probed_out = lower > np.asarray(K.threshold)[gidx]
    assert probed_out.sum() > 0.3 * n and (before >= 0).sum() > 0.2 * n
    assert (before[probed_out] < 0).all()



def test_reject_first_changes_no_level_at_float32_edges():
    """The same with moments near float32's max, among its subnormals, and spread over
    both, decoded a few ulps to 2**-6 off: the probes refuse only what the tiers refuse,
    where the adaptive tier certifies and refuses many."""
    rng = np.random.default_rng(12)
    n = 4000

    def loguniform(lo, hi):
        return np.exp2(rng.uniform(np.log2(lo), np.log2(hi), n)).astype(np.float32)
    families = {"big": (loguniform(1e10, 3e38), loguniform(1e20, 3e38), loguniform(1e5, 1e19)),
                "subnormal": (loguniform(2.0**-149, 2.0**-126), loguniform(2.0**-149, 2.0**-126),
                              loguniform(1e-45, 1e-30)),
                "spread": (loguniform(2.0**-140, 1e30), loguniform(2.0**-140, 3e38), loguniform(1e-30, 1e10))}
    K = bound.stack_rows([_k(lr=1e-3, step=100), _k(lr=1e-2, step=2000, eps=1e-30)])
    gidx = (np.arange(n) % 2).astype(np.int32)
    adaptive = refused = 0
    for name, (m, v, clip) in families.items():
        m = m * rng.choice([-1, 1], n).astype(np.float32)
        with np.errstate(over="ignore"):
            mt = (m * rng.choice([1, 1 + 2.0**-20, 1 - 2.0**-14, 1 + 2.0**-8], n)).astype(np.float32)
            vt = (v * rng.choice([1, 1 + 2.0**-18, 1 + 2.0**-10, 1 + 2.0**-6], n)).astype(np.float32)
        pabs = np.abs(rng.standard_normal(n)).astype(np.float32)
        for max_level in (-1, None):
            without, with_ = (guard.certify_pc(K, gidx, m, v, mt, vt, pabs, clip, np.arange(n), "shared", "mixed",
                                               max_level=max_level, reject_first=r) for r in (False, True))
            np.testing.assert_array_equal(with_, without, err_msg=name)
        adaptive += int((without == guard.ADAPTIVE_TIER).sum())
        refused += int((without < 0).sum())
    assert adaptive > 1000 and refused > 1000
