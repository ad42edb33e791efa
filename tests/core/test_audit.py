"""jaxguard.audit: the pieces every first-update audit shares (numpy only).

The adapters' audits run real frameworks (tests/optax/test_optax.py, test_torch_e2e.py,
test_dcp.py); here the shared gap, tally and totals are checked against values worked out
by hand, including the NaN and equal-float edges where a wrong `same` mask would either
hide a real gap or report one that is not there.
"""
import numpy as np
import pytest

from jaxguard import audit


def test_gradient_grid_spans_the_clip_range_with_zero_and_tiny_values():
    g = audit.gradient_grid(0.2, n_linear=4, n_log=8)
    assert g.dtype == np.float32
    assert np.all(np.diff(g) >= 0)
    assert g[0] == np.float32(-0.2) and g[-1] == np.float32(0.2) and 0.0 in g
    assert np.min(np.abs(g[g != 0])) == np.float32(0.2 * 2.0 ** -40)
    assert g.size == 24                     # 9 linear (0 among them) + 8 log magnitudes per sign - 1
    # distinct in float64, so +-0.1 (linear and 0.2 / 2) appear twice in float32: the count the
    # docs and bench results report (44 gradients at the defaults) depends on it
    assert audit.gradient_grid(0.2).size == 44


@pytest.mark.parametrize("a, b, want", [
    (1.0, 1.0, 0.0),
    (1.0, 1.0 + 2 ** -23, 2 ** -23 / 1e-3),
    (np.nan, np.nan, 0.0),                 # NaN state stored exactly: both runs NaN
    (np.nan, 1.0, np.inf),                 # only one NaN: a real difference
    (np.inf, np.inf, 0.0),
    (np.inf, -np.inf, np.finfo(np.float64).max),   # an infinite gap: the largest float64
    (0.0, -0.0, 0.0),                      # equal floats
], ids=["equal", "one-ulp", "both-nan", "one-nan", "same-inf", "opposite-inf", "signed-zero"])
def test_gap_lr_edges(a, b, want):
    got = audit.gap_lr(np.float32([a]), np.float32([b]), 1e-3)
    assert got.dtype == np.float64
    np.testing.assert_allclose(got, [want], rtol=1e-15)


def test_tally_counts_a_coordinate_once_over_all_gradients_and_keeps_the_worst():
    lr, tau = 1.0, 0.5
    t = audit.AuditTally(tau)
    t.add("w", np.float32([0, 0, 0]), np.float32([0.6, 0.0, 0.1]), lr, label=0.1)
    t.add("w", np.float32([0, 0, 0]), np.float32([0.7, 0.0, 0.2]), lr, label=-0.1)   # coordinate 0 again
    t.add("b", np.float32([0, 0]), np.float32([0.0, 0.9]), lr, label="random")
    s = t.summary(3)
    assert (s.violations, s.coordinates, s.gradients) == (2, 5, 3)
    assert s.max_gap_lr == pytest.approx(0.9) and s.worst == ("random", "b")
    assert not s.passed
    assert s.to_json() == {"max_gap_lr": s.max_gap_lr, "violations": 2, "coordinates": 5, "gradients": 3}
    assert s.to_json(with_worst=True, with_clamped=True)["worst"] == ("random", "b")
    assert audit.AuditTally(tau).summary(0).passed


def test_compression_summary_ratios():
    t = audit.new_totals()
    audit.add_stats(t, {"coordinates": 300, "escapes": 3, "payload_bytes": 700, "raw_fp32_bytes": 2400,
                        "exact": 1, "uncertifiable": 0, "encode_seconds": 9.0})
    audit.add_stats(t, {"coordinates": 100, "escapes": 1, "payload_bytes": 100, "raw_fp32_bytes": 800,
                        "exact": 0, "uncertifiable": 1})
    assert t == {"coordinates": 400, "escapes": 4, "payload_bytes": 800, "raw_fp32_bytes": 3200, "exact": 1,
                 "uncertifiable": 1}
    s = audit.compression_summary(t, 1000, raw_state_bytes=4000)
    assert s["escape_rate"] == 0.01 and s["payload_ratio"] == 0.25
    assert s["container_bytes"] == 1000 and s["container_ratio"] == 0.25
    assert "container_ratio" not in audit.compression_summary(t, 1000)
