"""The signed cells tier (`fastbound.signed_cells_bound`, run by the guard after the cells
tier and before the adaptive partitions): it encloses the bit-exact torch replay over the
whole gradient range, a partition's bound is the largest of its cells' bounds (so its range
checks at the first and last edge accept nothing that checking every edge would refuse), the
enclosure audit checks it (and catches it without its rounding budget and stage 2), and the margin
that ends the rate pass's candidates only refuses.  tests/core/test_fast_cells.py checks that it
refuses float32's edges and gives a row the same bits at every call size."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

from jaxguard.core import bound, certify, fastbound, guard, programs  # noqa: E402
from torch_compat.enclosure import audit_enclosure, draw_cases  # noqa: E402
from test_fast_cells import _adversarial, _row_per_case, adversarial_partitions, check_encloses_replay  # noqa: E402
from test_fastbound import _k  # noqa: E402


def _signed(k, d, gammas=fastbound.FAST_CELLS_GAMMAS):
    n = d["m"].size
    return np.asarray(fastbound.batch_signed_cells_pc(_row_per_case(k, n), d["m"], d["v"], d["mt"], d["vt"],
                                                      np.abs(d["p"]), d["clip"], gammas=gammas))


def _moved(rng, d, share=0.5, rel_m=0.05, log2_v=0.2):
    """Decodings moved a few percent (the rate pass's candidates): where the signs matter."""
    n = d["m"].size
    far = rng.random(n) < share
    d = dict(d)
    with np.errstate(over="ignore"):   # moved past float32's max: inf, which the tier must refuse
        d["mt"] = np.where(far, d["mt"] + rng.uniform(-rel_m, rel_m, n) * np.abs(d["m"]), d["mt"]).astype(np.float32)
        d["vt"] = np.where(far, d["vt"] * np.exp2(rng.uniform(-log2_v, log2_v, n)), d["vt"]).astype(np.float32)
    return d


def _cancelling(rng, d, lo=0.002, hi=0.03):
    """m~ and v~ scaled together so that m~ / sqrt(v~) = m / sqrt(v): the two terms of the
    difference cancel, as on the rate pass's moves (where the signs matter most)."""
    n = d["m"].size
    scale = (1 + rng.choice([-1, 1], n) * rng.uniform(lo, hi, n)).astype(np.float32)
    d = dict(d)
    with np.errstate(over="ignore"):
        d["mt"] = (d["m"] * scale).astype(np.float32)
        d["vt"] = (d["v"] * scale * scale).astype(np.float32)
    return d


@pytest.mark.parametrize("op_model,wd,lr,step", [("torch-adam", 0.0, 1e-3, 7), ("torch-adamw", 0.1, 3e-3, 2),
                                                 ("torch-adamw", 1000.0, 3e-3, 7), ("torch-adam", 0.0, 1e-4, 40000)],
                         ids=["adam", "adamw-step2", "adamw-lr-wd-3", "adam-late"])
def test_signed_cells_enclose_replay_over_whole_range(op_model, wd, lr, step):
    """Every finite bound >= |p1' - p2'| of the bit-exact torch replay at 64 gradients over
    [-clip, clip], on each partition, for decodings as the guard proposes them and moved as
    the rate pass moves them (at random, and so that the two terms cancel); and it is not
    vacuous (some come close)."""
    rng = np.random.default_rng(23)
    n = 1000
    base = draw_cases(rng, n)
    for d in (_moved(rng, base), _cancelling(rng, base)):
        check_encloses_replay(_signed, d, op_model, wd, lr, step, usable=0.95)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_partition_bound_is_the_largest_cell_bound_and_its_checks_refuse_what_a_cell_refuses(seed):
    """The tier range-checks its monotone intermediates at a partition's first and last
    edge only; checking every intermediate at every edge (`check_every_edge`) must accept
    wherever it accepts.  And its bound is, bit for bit, the largest of its cells' bounds,
    each cell taken alone (a max over cells, then monotone roundings), where all are
    usable.  Positive control: the edge draws make both refuse many cases."""
    d = _moved(np.random.default_rng(100 + seed), _adversarial(seed))
    n = d["m"].size
    for op_model, K, args, pabs, clip, edges in adversarial_partitions(d):
        bound_of = lambda e, **kw: (np.asarray(x) for x in fastbound.signed_cells_bound(  # noqa: E731
            K, *args, pabs, clip, e, **kw))
        whole, ok = bound_of(edges)
        _, checked = bound_of(edges, check_every_edge=True)
        assert not (ok & ~checked).any(), (op_model, int((ok & ~checked).sum()))
        assert (~ok).sum() > 0.1 * n and ok.sum() > 0.1 * n
        every = np.ones(n, bool)
        largest = np.zeros(n, np.float32)
        for lo, hi in zip(edges[:-1], edges[1:]):
            b, cell_ok = bound_of((lo, hi))
            every &= cell_ok
            largest = np.maximum(largest, np.where(cell_ok, b, 0))
        both = ok & every
        assert both.sum() > 0.1 * n
        np.testing.assert_array_equal(whole[both].view(np.uint32), largest[both].view(np.uint32))


def test_enclosure_audit_checks_the_signed_cells_tier():
    """On the case's own cell and on the whole partition: 0 failures for the CPU kernels and
    a simulated GPU kernel; without the rounding budget and stage 2 the audit finds
    failures in the cells (it can see an under-estimate)."""
    for op_model, seed in (("torch-adam", 0), ("torch-adamw", 1), ("torch-adamw-cuda-fused-f32", 2)):
        rep = audit_enclosure(8192, op_model=op_model, seed=seed)
        sc = rep["signed_cells"]
        assert sc["cell_failures"] == 0 and sc["failures"] == 0, (op_model, sc["failure_examples"])
        assert sc["cell_usable"] > 0.5 * rep["cases"] and sc["finite"] > 0.5 * rep["cases"]   # GPU model: 0.52, 0.53
        assert 0.5 < sc["max_ratio"] <= 1 and sc["certified_at_tau_0.01"] > 0
    nr = audit_enclosure(8192, seed=3, no_radius=True)
    assert nr["signed_cells"]["cell_failures"] > 0


def test_the_guard_runs_the_tier_on_candidates_and_the_margin_only_refuses(monkeypatch):
    """certify_pc certifies candidates (max_level -1, as the width search and the rate pass
    ask) with the signed tier (level SIGNED_CELLS_TIER) where the triangle-form cells tier
    refused; the final certificate (max_level None) does not run it; every candidate it
    certifies the final certificate certifies too; and the margin only refuses: without it
    (SIGNED_MARGIN = inf) every coordinate certified with it is certified at the same level."""
    rng = np.random.default_rng(31)
    n = 6000
    d = _cancelling(rng, draw_cases(rng, n))
    K = bound.stack_rows([_k(lr=1e-3, step=100), _k(lr=3e-4, step=7, wd=0.1, op_model="torch-adamw")])
    gidx = (np.arange(n) % 2).astype(np.int32)
    pabs = np.abs(d["p"])

    def levels(max_level):
        return guard.certify_pc(K, gidx, d["m"], d["v"], d["mt"], d["vt"], pabs, d["clip"], np.arange(n), "shared",
                                "mixed", max_level=max_level, reject_first=max_level == -1)
    full, cand = levels(None), levels(-1)
    signed = cand == certify.SIGNED_CELLS_TIER
    assert signed.sum() > 0.01 * n, int(signed.sum())
    assert not (full == certify.SIGNED_CELLS_TIER).any()
    cells = np.asarray(fastbound.batch_fast_cells_pc(K.take(gidx), d["m"], d["v"], d["mt"], d["vt"], pabs, d["clip"]))
    assert not (cells[signed] <= np.asarray(K.threshold)[gidx][signed]).any()
    assert not ((cand >= 0) & (full < 0)).any()
    walked = []
    real = bound.batch_bound_adaptive_pc
    monkeypatch.setattr(programs, "enabled", lambda: False)   # the kernels looked up, not loaded from the cache
    monkeypatch.setattr(bound, "batch_bound_adaptive_pc", lambda k, m, *a, **kw: walked.append(np.size(m))
                        or real(k, m, *a, **kw))
    levels(-1)
    with_margin, walked[:] = sum(walked), []
    monkeypatch.setattr(certify, "SIGNED_MARGIN", np.inf)
    unlimited = levels(-1)
    assert sum(walked) > 2 * with_margin                       # the margin spared the partitions most rows ...
    assert not ((cand >= 0) & (unlimited < 0)).any()
    np.testing.assert_array_equal(cand[cand >= 0], unlimited[cand >= 0])   # ... and only refused
