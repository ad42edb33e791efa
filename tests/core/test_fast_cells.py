"""The closed form on the coordinate's own cells (`fastbound.fast_cells_bound`, the guard's
tier between the closed form and the adaptive cell bound): it encloses the bit-exact torch
replay over the whole gradient range, its range checks at a partition's first and last
cells accept nothing that checking every cell would refuse, it refuses float32's edges,
it gives a row the same bits at every call size, and the enclosure audit checks it (and
catches it without its stage 2)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

from jaxguard.core import bound, fastbound, guard  # noqa: E402
from jaxguard.core.opmodel import step_constants  # noqa: E402
from torch_compat.enclosure import draw_edge_cases, audit_enclosure, draw_cases  # noqa: E402
from test_fastbound import EDGE, _k, _whole_range_points  # noqa: E402


def _row_per_case(k, n):
    return bound.StepRow(*(np.full(n, x, np.float32) for x in bound.as_step_row(np.asarray(k, np.float32))))


def _cells(k, d, gammas=fastbound.FAST_CELLS_GAMMAS):
    n = d["m"].size
    out = fastbound.batch_fast_cells_pc(_row_per_case(k, n), d["m"], d["v"], d["mt"], d["vt"], np.abs(d["p"]),
                                        d["clip"], gammas=gammas)
    return np.asarray(out)


@pytest.mark.parametrize("op_model,wd,lr,step", [("torch-adam", 0.0, 1e-3, 7), ("torch-adamw", 0.1, 3e-3, 2),
                                                 ("torch-adamw", 1000.0, 3e-3, 7), ("torch-adam", 0.0, 1e-4, 40000)],
                         ids=["adam", "adamw-step2", "adamw-lr-wd-3", "adam-late"])
def test_cells_enclose_replay_over_whole_range(op_model, wd, lr, step):
    """Every finite cells bound >= |p1' - p2'| of the bit-exact torch replay at 64 gradients
    over [-clip, clip], on each partition; and it is not vacuous (some come close)."""
    rng = np.random.default_rng(17)
    check_encloses_replay(_cells, draw_cases(rng, 1000), op_model, wd, lr, step, usable=0.99)


def check_encloses_replay(tier, d, op_model, wd, lr, step, usable):
    """`tier(k, d, gammas)` (bounds, +inf where not usable) >= the replay's largest difference
    on the 28-cell and the 8-cell partitions, at least `usable` of them finite, some close."""
    from torch_compat.replay import adam_step
    n = d["m"].size
    k = _k(op_model, lr=lr, step=step, wd=wd)
    g = _whole_range_points(d["clip"].astype(np.float64), d["v"].astype(np.float64), float(k[2]), float(k[3]))
    P = g.shape[1]
    rep = lambda x: np.repeat(x, P)  # noqa: E731
    args = dict(step=step, lr=lr, weight_decay=wd, decoupled=op_model == "torch-adamw")
    p1 = adam_step(rep(d["p"]), g.reshape(-1), rep(d["m"]), rep(d["v"]), **args)[0].astype(np.float64)
    p2 = adam_step(rep(d["p"]), g.reshape(-1), rep(d["mt"]), rep(d["vt"]), **args)[0].astype(np.float64)
    actual = np.abs(p1 - p2).reshape(n, P).max(1)
    for gammas in (fastbound.FAST_CELLS_GAMMAS, bound.ADAPTIVE_GAMMAS_DOUBLING):
        b = tier(k, d, gammas).astype(np.float64)
        fin = np.isfinite(b)
        assert fin.mean() > usable
        bad = fin & ~(actual <= b)
        assert not bad.any(), [(d["m"][i], d["v"][i], d["mt"][i], d["vt"][i], actual[i], b[i])
                               for i in np.flatnonzero(bad)[:3]]
        assert np.max(np.where(fin, actual / b, 0)) > 0.5


def _adversarial(seed, n=20000):
    rng = np.random.default_rng(seed)
    d = draw_cases(rng, n)
    draw_edge_cases(rng, d, np.arange(0, n, 2))   # half at float32's edges
    tiny = np.arange(1, n, 7)                 # and some near the certifiable floor 2**-80
    d["m"][tiny] *= np.float32(2.0**-60)
    d["mt"][tiny] *= np.float32(2.0**-60)
    return d


def adversarial_partitions(d):
    """(op model, constants per case, [m, v, mt, vt], |p|, clip, edges) of draws `d` under
    three odd hyperparameter sets, each on the 28-cell and the 8-cell partitions."""
    n = d["m"].size
    for op_model, lr, step, eps in (("torch-adam", 1e-3, 3, 1e-8), ("torch-adamw", 3e-2, 5000, 1e-16),
                                    ("torch-adam", 1e-5, 0, 1e-12)):
        k = bound.pack_constants(step_constants(op_model, lr=lr, step=step, eps=eps, weight_decay=0.01), 0.01)
        K = _row_per_case(k, n)
        clip = d["clip"]
        for gammas in (fastbound.FAST_CELLS_GAMMAS, bound.ADAPTIVE_GAMMAS_DOUBLING):
            yield (op_model, K, [d[x] for x in ("m", "v", "mt", "vt")], np.abs(d["p"]), clip,
                   fastbound.adaptive_edge_list(K, d["v"], d["vt"], clip, gammas))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_first_and_last_cell_checks_accept_nothing_every_cell_check_refuses(seed):
    """`fast_cells_bound` range-checks the monotone intermediates at a partition's first
    and last cell only (`fastbound.RISING_LO`); checking every cell in full
    (`fast_cell_ideal`) must agree wherever it accepts.  Positive control: the edge
    draws make both refuse many cases."""
    import jax.numpy as jnp
    d = _adversarial(seed)
    n = d["m"].size
    for op_model, K, args, pabs, clip, edges in adversarial_partitions(d):
        _, fast_ok = fastbound.fast_cells_bound(K, *args, pabs, clip, edges, no_radius=True)
        every = np.ones(n, bool)
        for lo, hi in zip(edges[:-1], edges[1:]):
            _, ok = fastbound.fast_cell_ideal(K, *args, clip * lo, clip * hi)
            every &= np.asarray(ok)
        fast_ok = np.asarray(fast_ok)
        assert not (fast_ok & ~every).any(), (op_model, int((fast_ok & ~every).sum()))
        assert (~fast_ok).sum() > 0.1 * n and fast_ok.sum() > 0.1 * n
        assert jnp.asarray(edges[0]).shape == (n,)


# both tiers on the coordinate's own cells (the signed one: tests/core/test_signed_cells.py)
CELL_KERNELS = pytest.mark.parametrize("kernel", [fastbound.batch_fast_cells_pc, fastbound.batch_signed_cells_pc],
                                       ids=["cells", "signed"])


@CELL_KERNELS
@pytest.mark.parametrize("name,m,v,mt,vt,p,over", EDGE, ids=[e[0] for e in EDGE])
def test_cells_refuse_edges(name, m, v, mt, vt, p, over, kernel):
    k = _k(**over)
    f = lambda x: np.asarray([x], np.float32)  # noqa: E731
    d = {"m": f(m), "v": f(v), "mt": f(mt), "vt": f(vt), "p": f(p), "clip": f(0.2)}
    out = kernel(_row_per_case(k, 1), d["m"], d["v"], d["mt"], d["vt"], np.abs(d["p"]), d["clip"])
    assert np.asarray(out)[0] == np.inf


@CELL_KERNELS
def test_cells_give_a_row_the_same_bits_at_every_call_size(kernel):
    from test_certify_pieces import CALL_SIZES, _call, _rows, _starts
    for seed in range(3):
        rows = _rows(seed, 4096)
        whole = _call(rows, kernel, np.arange(4096)).view(np.uint32)
        for size in CALL_SIZES + (2048,):
            for start in _starts(size):
                sel = np.arange(start, start + size)
                np.testing.assert_array_equal(_call(rows, kernel, sel).view(np.uint32),
                                              whole[sel], err_msg=f"{size} rows from {start}")


def test_enclosure_audit_checks_the_cells_tier():
    """On the case's own cell and on the whole partition: 0 failures for the CPU kernels;
    without stage 2 the audit finds failures in the cells (it can see an under-estimate)."""
    for op_model, seed in (("torch-adam", 0), ("torch-adamw", 1), ("torch-adam-fused", 2)):
        rep = audit_enclosure(8192, op_model=op_model, seed=seed)
        fc = rep["fast_cells"]
        assert fc["cell_failures"] == 0 and fc["failures"] == 0, (op_model, fc["failure_examples"])
        assert fc["cell_usable"] > 0.6 * rep["cases"] and fc["finite"] > 0.6 * rep["cases"]
        assert 0.5 < fc["max_ratio"] <= 1 and fc["certified_at_tau_0.01"] > 0
    nr = audit_enclosure(8192, seed=3, no_radius=True)
    assert nr["fast_cells"]["cell_failures"] > 0


def test_a_smaller_ladder_is_the_full_one_without_the_cells_tiers():
    """Without the cells tiers (a small group, `certify.SPEED_TIERS_ABOVE`, or a small state,
    `certify.CELLS_TIERS_ABOVE`) the stages are the full ladder's less the cells tiers and
    the 8- and 20-cell adaptive partitions, in the same order; the fixed levels and the
    rejects stay (the rate pass's setting too)."""
    from jaxguard.core import certify
    coarse = set(bound.ADAPTIVE_PARTITIONS[:-1])
    for settings in ({}, {"max_level": -1, "reject_first": True}):
        full = certify.stages("shared", "mixed", **settings)
        small = certify.stages("shared", "mixed", cells_tiers=False, **settings)
        kept = [st for st in full if st.kernel is not fastbound.batch_fast_cells_pc
                and dict(st.static).get("gammas") not in coarse]
        assert list(small) == kept and len(kept) == len(full) - 4


def test_early_checkpoint_uses_the_cells_tier_and_the_real_torch_audit_holds(tmp_path, monkeypatch):
    """A model three AdamW steps in (where the closed form leaves the most): the cells tier
    certifies coordinates, and the real torch.optim.AdamW audit finds none over tau."""
    monkeypatch.setattr(guard, "SPEED_TIERS_ABOVE", 0)   # the full ladder, as a larger group's
    monkeypatch.setattr(guard, "CELLS_TIERS_ABOVE", 0)
    from helpers import byte_transformer_round_trip
    summary, stats, res = byte_transformer_round_trip(tmp_path, seed=1, steps=3, lr=1e-3, weight_decay=0.01)
    cells = sum(s["certified_fast_cells"] for s in stats)
    assert cells > 0.005 * summary["coordinates"], cells
    assert res["violations"] == 0 and res["max_gap_lr"] <= 0.01
