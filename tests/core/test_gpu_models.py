"""GPU op models (simulated on CPU: no test needs a GPU): the bound encloses each kernel's
simulation under adversarial rounding, the simulations are the documented arithmetic,
and the model is chosen as torch chooses it."""
import numpy as np
import pytest

from jaxguard.core.config import GuardSpec
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import torch_compat
from jaxguard.core.bound import CONST_REL, RHO_MAX
from jaxguard.core.opmodel import (CPU_OP_MODELS, GPU_OP_MODELS, OP_MODELS, resolve_op_model, stage2_budget,
                                   step_constants)
from jaxguard.errors import ConfigError, UnsupportedOptimizerError
from torch_compat.enclosure import audit_enclosure
from torch_compat.gpu_sim import GpuArithmetic, simulate_step
from torch_compat.float32 import fma_float32_numpy

F = np.float32


@pytest.mark.parametrize("op_model", list(GPU_OP_MODELS))
def test_bound_encloses_gpu_simulation(op_model):
    """Adversarial rounding of every approximate op, FMA drawn per case, a quarter of the
    cases at float32's edges, odd hyperparameter groups, subnormal p and g."""
    rep = audit_enclosure(8192, op_model=op_model, seed=11)
    assert rep["cases"] == 8192 and rep["nan_bounds"] == 0
    examples = rep["failure_examples"] + rep["fast"]["failure_examples"]
    assert rep["failures"] == 0 and rep["fast"]["failures"] == 0, examples
    assert 0 < rep["max_ratio"] <= 1 and rep["edge_finite"] > 0
    assert rep["variant"]["approx"] == "adversarial"


@pytest.mark.parametrize("op_model", ["torch-adamw-cuda-foreach-capturable", "optax-adam-gpu"])
def test_gpu_audit_detects_radius_removal(op_model):
    rep = audit_enclosure(8192, op_model=op_model, seed=11, no_radius=True)
    assert rep["failures"] > 0 and rep["max_ratio"] > 1


def test_gpu_audit_detects_an_approximate_op_beyond_its_allowance(monkeypatch):
    """div.full.f32 rounded 4096 ulp away instead of 2: the same audit must find failures."""
    import dataclasses
    import jaxguard.core.opmodel as om
    wide = dataclasses.replace(GPU_OP_MODELS["optax-adam-gpu"], div_ulps=4096.0)
    monkeypatch.setitem(om.GPU_OP_MODELS, "optax-adam-gpu", wide)
    rep = audit_enclosure(8192, op_model="optax-adam-gpu", seed=11)
    assert rep["failures"] > 0


def test_stage2_covers_every_gpu_kernel_without_widening():
    for name in GPU_OP_MODELS:
        for chain, (need, allowed) in stage2_budget(name).items():
            assert need <= allowed / 2, (name, chain, need, allowed)
        c = step_constants(name, lr=1e-3, step=0)
        assert CONST_REL <= c.const_rel < RHO_MAX / 2    # worst at t = 1 (b2^t / (1 - b2^t) = 999)
    assert set(CPU_OP_MODELS) | set(GPU_OP_MODELS) == set(OP_MODELS)


def test_cpu_models_constants_unchanged():
    c = step_constants("torch-adam", lr=1e-3, step=9)
    assert (c.S, c.B, c.const_rel) == (F(1e-3 / (1 - 0.9**10)), F((1 - 0.999**10) ** 0.5), 2.0**-20)
    for cpu, gpu in (("torch-adam", "torch-adam-cuda"), ("torch-adamw", "torch-adamw-cuda-foreach")):
        a, b = step_constants(cpu, lr=3e-4, step=41, weight_decay=0.1), step_constants(gpu, lr=3e-4, step=41,
                                                                                        weight_decay=0.1)
        assert {k: v for k, v in a.to_json().items() if k != "op_model"} == \
               {k: v for k, v in b.to_json().items() if k != "op_model"}


def _inputs(n=4096, seed=0):
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 5, n))).astype(F)
    m = (rng.standard_normal(n) * np.exp(rng.uniform(-20, 0, n))).astype(F)
    v = np.exp(rng.uniform(-40, 2, n)).astype(F)
    p = rng.standard_normal(n).astype(F)
    return p, g, m, v


def test_simulations_are_the_documented_arithmetic():
    """fma=False, nearest: each simulation equals its op sequence written out as plain numpy
    float32 (the op models' own arithmetic), bit for bit; with fma=True the contracted ops
    are correctly rounded FMAs."""
    p, g, m, v = _inputs()
    lr, step, b1, b2, eps, wd = 1e-3, 99, 0.9, 0.999, 1e-8, 0.01
    t = step + 1
    w, c2 = F(1 - b1), F(1 - b2)
    m1 = m + w * (g - m)
    v1 = v * F(b2) + c2 * (g * g)
    S = F(-(lr / (1 - b1**t)))
    Bsq = F((1 - b2**t) ** 0.5)
    p_dec = p * F(1 - lr * wd)
    want = {
        "torch-adamw-cuda": p_dec + S * (m1 / (np.sqrt(v1) * (F(1) / Bsq) + F(eps))),
        "torch-adamw-cuda-foreach": p_dec + S * (m1 / (np.sqrt(v1) / Bsq + F(eps))),
    }
    b1t, b2t = np.float32(np.float64(F(b1)) ** t), np.float32(np.float64(F(b2)) ** t)
    neg_step = F(1) / ((b1t - F(1)) / F(lr))
    den = (np.sqrt(v1) / np.sqrt(-(b2t - F(1))) + F(eps)) / neg_step
    want["torch-adamw-cuda-foreach-capturable"] = p_dec + m1 / den
    for name, ref in want.items():
        out = simulate_step(name, p, g, m, v, step=step, lr=lr, eps=eps, weight_decay=wd)
        np.testing.assert_array_equal(out[0], ref, err_msg=name)
        np.testing.assert_array_equal(out[1], m1)
        np.testing.assert_array_equal(out[2], v1)
    # fused-f64: double moments rounded once
    out = simulate_step("torch-adam-cuda-fused-f64", p, g, m, v, step=step, lr=lr)
    np.testing.assert_array_equal(out[1], (b1 * m.astype(np.float64) + (1 - b1) * g.astype(np.float64)).astype(F))
    # fused-f32: explicit fma(b1, m, fma(-b1, g, g)) whatever the contraction flag
    for fma in (False, True):
        out = simulate_step("torch-adam-cuda-fused-f32", p, g, m, v, step=step, lr=lr, fma=fma)
        np.testing.assert_array_equal(out[1], fma_float32_numpy(F(b1), m, fma_float32_numpy(-F(b1), g, g)))
    # foreach's division by the host scalar: true division, or (recip) the reciprocal multiply
    out = simulate_step("torch-adamw-cuda-foreach", p, g, m, v, step=step, lr=lr, eps=eps, weight_decay=wd, recip=True)
    np.testing.assert_array_equal(out[0], p_dec + S * (m1 / (np.sqrt(v1) * (F(1) / Bsq) + F(eps))))
    # contraction: torch's addcmul as fma(c2, g*g, v*b2)
    out = simulate_step("torch-adam-cuda-foreach", p, g, m, v, step=step, lr=lr, fma=True)
    np.testing.assert_array_equal(out[2], fma_float32_numpy(c2, g * g, v * F(b2)))
    assert np.any(out[2] != v1)     # the contraction changes bits somewhere


def test_adversarial_rounding_stays_within_the_allowance():
    rng = np.random.default_rng(3)
    x = np.concatenate([np.exp(rng.uniform(-100, 85, 20000)), [0.0, 2.0**-149, 2.0**-130, 3.0e38]])
    x = x * rng.choice([-1.0, 1.0], x.size)
    ar = GpuArithmetic(approx="adversarial", rng=rng)
    for ulps in (1.0, 2.0, 8.0):
        r = ar.approx(x, ulps).astype(np.float64)
        ulp = np.ldexp(1.0, np.maximum(np.frexp(np.abs(x))[1] - 1, -126) - 23)
        assert np.all(np.abs(r - x) <= ulps * ulp)
        assert np.all((np.sign(r) == np.sign(x)) | (r == 0))
        # ulps >= 2: mostly beyond what round-to-nearest gives; 1: the far bracketing float half the time
        assert np.mean(np.abs(r - x) > 0.5 * ulp) > (0.8 if ulps >= 2 else 0.35)
        np.testing.assert_array_equal(r, ar.approx(x, ulps))   # a function of the value
    assert ar.approx(np.array([0.0]), 2.0)[0] == 0


def test_simulate_step_rejects_bad_input():
    p, g, m, v = _inputs(8)
    with pytest.raises(ConfigError, match="not a GPU op model"):
        simulate_step("torch-adam", p, g, m, v, step=0, lr=1e-3)
    with pytest.raises(ConfigError, match="float32"):
        simulate_step("torch-adam-cuda", p.astype(np.float64), g, m, v, step=0, lr=1e-3)
    with pytest.raises(ConfigError, match="rng="):
        simulate_step("optax-adam-gpu", p, g, m, v, step=0, lr=1e-3, approx="adversarial")
    with pytest.raises(ConfigError, match="2\\*\\*24"):
        step_constants("torch-adam-cuda-fused-f32", lr=1e-3, step=2**24)
    with pytest.raises(ConfigError, match="rounds to 1.0"):
        step_constants("torch-adam-cuda-foreach-capturable", lr=1e-3, step=3, betas=(0.9, 0.99999999))
    step_constants("torch-adam-cuda-foreach", lr=1e-3, step=3, betas=(0.9, 0.99999999))   # host double: legal


# ---------------------------------------------------------------- choosing the model
@pytest.mark.parametrize("device,flags,version,want", [
    ("cpu", {}, "2.13.0", "torch-adam"),
    ("cpu", dict(foreach=True), "2.13.0", "torch-adam-foreach"),
    ("cpu", dict(fused=True), "2.8.0", "torch-adam-fused"),
    ("cuda", {}, "2.13.0+cu128", "torch-adam-cuda-foreach"),
    ("cuda", dict(foreach=False), "2.13.0", "torch-adam-cuda"),
    ("cuda", dict(foreach=None, fused=False), "2.13.0", "torch-adam-cuda"),
    ("cuda", dict(capturable=True), "2.13.0", "torch-adam-cuda-foreach-capturable"),
    ("cuda", dict(differentiable=True), "2.13.0", "torch-adam-cuda"),
    ("cuda", dict(lr_is_tensor=True), "2.13.0", "torch-adam-cuda"),
    ("cuda", dict(lr_is_tensor=True, capturable=True), "2.13.0", "torch-adam-cuda-foreach-capturable"),
    ("cuda", dict(fused=True), "2.8.0+cu126", "torch-adam-cuda-fused-f64"),
    ("cuda", dict(fused=True), "2.10.1", "torch-adam-cuda-fused-f64"),
    ("cuda", dict(fused=True), "2.13.0+cu128", "torch-adam-cuda-fused-f32"),
    ("cuda", dict(fused=True, capturable=True), "2.14.1", "torch-adam-cuda-fused-f32"),
])
@pytest.mark.parametrize("decoupled", [False, True])
def test_resolve_as_torch_does(device, flags, version, want, decoupled):
    got = resolve_op_model(device, decoupled=decoupled, torch_version=version, **flags)
    assert got == (want.replace("torch-adam", "torch-adamw", 1) if decoupled else want)


def test_resolution_agrees_with_torchs_own_default_on_cpu():
    from torch.optim.optimizer import _default_to_fused_or_foreach
    assert _default_to_fused_or_foreach([torch.zeros(3)], differentiable=False, use_fused=False) == (False, False)
    assert resolve_op_model("cpu") == "torch-adam"


@pytest.mark.parametrize("device,flags,message", [
    ("cuda", dict(fused=True), "2.11.0: .* is not known; pass op_model="),
    ("cuda", dict(fused=True, foreach=True), "torch rejects"),
    ("cuda", dict(foreach=False, capturable=True), "not modelled"),
    ("cpu", dict(capturable=True), "capturable=True on CPU"),
    ("mps", {}, "cpu and cuda only"),
    ("cuda", dict(op_model="torch-adamw-cuda"), "param group is Adam"),
    ("cuda", dict(op_model="optax-adam-gpu"), "not a torch op model"),
])
def test_resolution_refuses_in_one_line(device, flags, message):
    with pytest.raises(ConfigError, match=message) as e:
        resolve_op_model(device, torch_version="2.11.0", **flags)
    assert "\n" not in str(e.value)


def test_named_kernel_overrides_the_resolution():
    assert resolve_op_model("cuda", fused=True, torch_version="2.11.0",
                            op_model="torch-adam-cuda-fused-f32") == "torch-adam-cuda-fused-f32"
    assert resolve_op_model("cpu", op_model="torch-adam-cuda-foreach") == "torch-adam-cuda-foreach"


def test_guard_config_on_cuda_state_and_named_kernel():
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "foreach": None, "fused": None,
             "decoupled_weight_decay": True, "weight_decay": 0.01}
    kw = dict(spec=GuardSpec(codec="log8"))
    assert torch_compat.state.guard_config(group, 3, **kw).op_model == "torch-adamw"          # CPU: unchanged
    assert torch_compat.state.guard_config(group, 3, device_type="cuda", **kw).op_model == "torch-adamw-cuda-foreach"
    assert torch_compat.state.guard_config(group, 3, op_model="torch-adamw-cuda-fused-f32",
                                           **kw).op_model == "torch-adamw-cuda-fused-f32"
    with pytest.raises(UnsupportedOptimizerError, match="param group 0: .*not modelled"):
        torch_compat.state.guard_config({**group, "foreach": False, "capturable": True}, 3, device_type="cuda", **kw)


def test_save_certifies_for_the_named_gpu_kernel(tmp_path):
    """A CPU run's state certified for the CUDA kernel it will resume on: the header says
    which; the certificate differs from the CPU one only where the constants do."""
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(16, 64)).square().mean().backward()
        opt.step()
    for name in ("torch-adamw-cuda-foreach", "torch-adamw-cuda-fused-f32"):
        path = tmp_path / f"{name}.jg"
        summary = torch_compat.save(path, opt, op_model=name)
        _, header = torch_compat.restore_tree(path)
        assert header["op_model"] == name
        assert summary["escape_rate"] < 0.5
    with pytest.raises(UnsupportedOptimizerError, match="param group is AdamW"):
        torch_compat.save(tmp_path / "x.jg", opt, op_model="torch-adam-cuda")


def test_cli_compress_help_lists_the_op_models():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "jaxguard", "compress", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for name in ("torch-adam-cuda-foreach-capturable", "torch-adamw-cuda-fused-f64"):
        assert name in text.replace("- ", "-")


def test_cli_compress_for_the_gpu_kernel(tmp_path):
    import subprocess
    import sys
    torch.manual_seed(1)
    model = torch.nn.Linear(32, 8)
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt)
    out = subprocess.run([sys.executable, "-m", "jaxguard", "compress", str(ckpt), "-o", str(tmp_path / "c.jg"),
                          "--op-model", "torch-adam-cuda-foreach", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    _, header = torch_compat.restore_tree(tmp_path / "c.jg")
    assert header["op_model"] == "torch-adam-cuda-foreach"
