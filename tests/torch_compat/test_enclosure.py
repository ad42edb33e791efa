"""The enclosure audit: the bound holds against the bit-exact replay, and the audit can fail."""
import json
import subprocess
import sys

import numpy as np
import pytest

from jaxguard.core import bound
pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
from torch_compat.enclosure import POINTS_PER_CASE, audit_enclosure, cell_points, draw_cases  # noqa: E402


def test_bound_encloses_replay():
    rep = audit_enclosure(20000)
    assert rep["cases"] == 20000 and rep["points_per_case"] == POINTS_PER_CASE >= 16
    assert rep["nan_bounds"] == 0
    assert rep["failures"] == 0, rep["failure_examples"]
    assert 0 < rep["max_ratio"] <= 1
    # a quarter of the cases at float32's edges: most escape (+inf), some are bounded
    assert rep["edge_cases"] > 0.2 * rep["cases"] and 0 < rep["edge_finite"] < rep["edge_cases"]
    assert rep["escaped"] >= rep["edge_cases"] - rep["edge_finite"]


def test_bound_encloses_replay_adamw():
    """Includes groups with lr*wd in [0.5, 30]: torch decays p first, by |1 - lr wd| > 1."""
    rep = audit_enclosure(5000, op_model="torch-adamw", seed=1)
    assert rep["failures"] == 0, rep["failure_examples"]
    assert rep["edge_finite"] > 0


@pytest.mark.parametrize("op_model", ["torch-adam", "torch-adamw"])
def test_an_lr_interval_row_encloses_the_replay_at_every_rate_in_it(op_model):
    """Groups certified for [lo, hi] (hi/lo up to 1000) and replayed at lo, hi or between:
    the scaled difference stays under the row's bound; without the radius it does not."""
    rep = audit_enclosure(16384, op_model=op_model, seed=5, lr_interval=True)
    assert rep["lr_interval"] and rep["failures"] == 0 and rep["fast"]["failures"] == 0, rep["failure_examples"][:2]
    assert rep["adaptive"]["failures"] == 0 and rep["max_ratio"] <= 1.0
    control = audit_enclosure(16384, op_model=op_model, seed=5, lr_interval=True, no_radius=True)
    assert control["failures"] > 0


def test_no_radius_is_detected():
    rep = audit_enclosure(20000, no_radius=True)
    assert rep["no_radius"] is True
    assert rep["failures"] > 0 and rep["max_ratio"] > 1
    ex = rep["failure_examples"][0]
    assert ex["actual"] > ex["bound"]


def test_points_cover_ends_ulp_and_mid():
    rng = np.random.default_rng(0)
    gl = np.array([0.0, 1.0, 2.0**-40], np.float32)
    gh = np.array([2.0**-40, 1.0625, 2.0**-39], np.float32)
    pts = cell_points(rng, gl, gh)
    assert pts.shape == (3, POINTS_PER_CASE) and pts.dtype == np.float32
    assert np.all(pts >= gl[:, None]) and np.all(pts <= gh[:, None])
    for i in range(3):
        for x in (gl[i], gh[i], np.nextafter(gl[i], gh[i]), np.nextafter(gh[i], gl[i])):
            assert x in pts[i]


def test_generated_cases_are_certifiable():
    d = draw_cases(np.random.default_rng(5), 50000)
    for name in ("m", "v", "mt", "vt"):
        x = d[name]
        assert x.dtype == np.float32 and np.all(np.isfinite(x))
        assert np.all((x == 0) | (np.abs(x) >= bound.TINY_MOMENT))
    assert np.all(d["v"] >= 0) and np.all(d["vt"] >= 0)
    assert set(np.unique(d["level"])) == {1, 2, 3, 4}


def test_cli_json():
    out = subprocess.run([sys.executable, "-m", "jaxguard", "audit-enclosure", "--cases", "5000", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["cases"] == 5000 and rep["failures"] == 0


def test_cli_gpu_op_model():
    """A GPU op model is audited against its CPU simulation (torch_compat.gpu_sim)."""
    out = subprocess.run([sys.executable, "-m", "jaxguard", "audit-enclosure", "--cases", "3000", "--json",
                          "--op-model", "torch-adamw-cuda-fused-f32"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["op_model"] == "torch-adamw-cuda-fused-f32" and rep["failures"] == 0
    assert rep["variant"]["approx"] == "adversarial"


def test_adaptive_tier_encloses_replay_and_its_cells_are_audited():
    """Half the cases take a cell of their own adaptive partition; every case's whole
    adaptive bound must enclose the replay as well.  Without the radius the audit finds
    failures in those cells too (it can see an under-estimate there)."""
    for op_model, seed in (("torch-adam", 0), ("torch-adamw", 1), ("torch-adam-fused", 2)):
        rep = audit_enclosure(8192, op_model=op_model, seed=seed)
        a = rep["adaptive"]
        assert rep["failures"] == 0 and a["failures"] == 0, (op_model, rep["failure_examples"], a["failure_examples"])
        assert 0.4 * rep["cases"] < a["cell_cases"] < 0.6 * rep["cases"]
        assert a["finite"] > 0.5 * rep["cases"] and a["certified_at_tau_0.01"] > 0
    rep = audit_enclosure(8192, no_radius=True)
    assert rep["adaptive"]["cell_failures"] > 0


def _adaptive_edges(row, v, vt, clip):
    import jax
    return np.asarray(jax.vmap(lambda a, b, c: bound.adaptive_unit_edges(row, a, b, c))(v, vt, clip))


def test_adaptive_edges_cover_zero_to_one_whatever_the_inputs():
    """The partition decides tightness, not soundness: its edges start at exactly 0, end at
    exactly 1 and never decrease, for zero, subnormal, huge, infinite and NaN inputs."""
    from jaxguard.core.opmodel import step_constants
    f32 = np.float32
    vals = np.array([0.0, 1e-45, 1e-38, 2.0**-80, 1e-12, 1e-6, 1.0, 1e30, 3.4e38, np.inf, np.nan], f32)
    v, vt, clip = (x.reshape(-1) for x in np.meshgrid(vals, vals, np.array([1e-30, 1e-4, 0.2, 1e30, np.inf], f32)))
    for step, eps in ((0, 1e-8), (1000, 1e-45), (5, 1e-30)):
        row = bound.pack_constants(step_constants("torch-adam", lr=1e-3, step=step, eps=eps), 0.01)
        e = _adaptive_edges(row, v, vt, clip)
        assert e.shape == (v.size, len(bound.ADAPTIVE_GAMMAS) + 1)
        assert (e[:, 0] == 0).all() and (e[:, -1] == 1).all()
        assert (np.diff(e, axis=1) >= 0).all() and np.isfinite(e).all()

