"""torch's foreach=True and fused=True CPU Adam/AdamW: bit-exact replay against the real
torch, the enclosure audit per implementation, and the guard certifying against the
implementation recorded in the param group (issue 16). The >= 5M-coordinate and
131k-case runs are in bench/replay_impls.py (results in bench/results/replay_impls.md)."""
import numpy as np
import pytest

from jaxguard.core.config import GuardSpec
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import torch_compat  # noqa: E402
from torch_compat.enclosure import audit_enclosure  # noqa: E402
from jaxguard.audit import gradient_grid  # noqa: E402
from jaxguard.errors import ConfigError, UnsupportedOptimizerError  # noqa: E402
from torch_compat import replay  # noqa: E402
from torch_compat.state import check_optimizer_state, implementation_of  # noqa: E402

CONFIGS = (
    dict(step=0, lr=6e-4, weight_decay=0.01, decoupled=False),   # coupled decay: add(alpha=) fusing shows
    dict(step=999, lr=1e-3, weight_decay=0.1, decoupled=True),
)


def _tensors(rng, long_n=150_001, n_short=300):
    out = []
    for n in [long_n] + list(rng.integers(1, 200, n_short)):
        g = (rng.standard_normal(n) * 0.02).astype(np.float32)
        g[rng.random(n) < 0.05] = 0
        m = (rng.standard_normal(n) * 1e-3).astype(np.float32)
        v = (10.0 ** rng.uniform(-16, -2, n)).astype(np.float32)
        p = (rng.standard_normal(n) * 0.05).astype(np.float32)
        extreme = rng.random(n) < 0.001  # numpy-path coordinates: subnormal / huge
        v[extreme] = rng.choice(np.array([1e-44, 2e-39, 1e30], np.float32), int(extreme.sum()))
        out.append((p, g, m, v))
    return out


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_replay_is_bit_exact_against_real_torch(implementation):
    variant = replay.detect_implementation_variant(implementation)
    assert variant.matched, variant.detail
    width = variant.vector_width if implementation == "fused" else 8
    rng = np.random.default_rng(16)
    counted = control = 0
    for kw in CONFIGS:
        ts = _tensors(rng)
        tail = np.concatenate([np.arange(t[0].size) >= t[0].size - t[0].size % width for t in ts])
        want = [np.concatenate(x) for x in replay.torch_adam_step_many(*zip(*ts), implementation=implementation, **kw)]
        flat = [np.concatenate(x) for x in zip(*ts)]
        extra = dict(tail_mask=tail) if implementation == "fused" else {}
        got = replay.adam_step(*flat, implementation=implementation, **kw, **extra)
        # negative control: single-tensor model for fused; fused model (tails as if one tensor) for foreach
        other = ("single", {}) if implementation == "fused" else ("fused", dict(tail_mask=tail))
        ctl = replay.adam_step(*flat, implementation=other[0], **kw, **other[1])
        for name, w, g_, c in zip("pmv", want, got, ctl):
            bad = w.view(np.int32) != g_.view(np.int32)
            assert (int(bad[~tail].sum()), int(bad[tail].sum())) == (0, 0), (implementation, kw, name, "body, tail")
            control += int(np.count_nonzero(w.view(np.int32) != c.view(np.int32)))
        counted += tail.size
        assert tail.sum() > 500  # the scalar tails were exercised
    assert counted >= 300_000
    assert control > 0  # the comparison can fail: the other implementation's model does not match


def test_single_tensor_jax_and_numpy_fused_models_agree_on_one_tensor():
    """adam_step's default tail (last size % width) and the numpy model agree; a tensor
    whose size is not a multiple of the width keeps its scalar tail."""
    rng = np.random.default_rng(3)
    p, g, m, v = _tensors(rng, long_n=1003, n_short=0)[0]
    a = replay.adam_step(p, g, m, v, step=5, lr=1e-3, implementation="fused")
    b = replay.numpy_adam_step(p, g, m, v, step=5, lr=1e-3, implementation="fused")
    want = replay.torch_adam_step(p, g, m, v, step=5, lr=1e-3, implementation="fused")
    for x, y, w in zip(a, b, want):
        assert np.array_equal(x.view(np.int32), w.view(np.int32)) and np.array_equal(y.view(np.int32), w.view(np.int32))


def test_wrong_variant_or_implementation_is_refused():
    single = replay.detect_variant()
    with pytest.raises(ConfigError, match="FusedAdamVariant"):
        replay.adam_step(*(np.zeros(3, np.float32),) * 4, step=0, lr=1e-3, implementation="fused", variant=single)
    with pytest.raises(ConfigError, match="implementation='cuda-fused'"):
        replay.adam_step(*(np.zeros(3, np.float32),) * 4, step=0, lr=1e-3, implementation="cuda-fused")


@pytest.mark.parametrize("op_model", ["torch-adam-fused", "torch-adamw-fused", "torch-adam-foreach",
                                      "torch-adamw-foreach"])
def test_bound_encloses_each_implementation(op_model):
    rep = audit_enclosure(4096, op_model=op_model, seed=7)
    assert rep["implementation"] == op_model.rsplit("-", 1)[1]
    assert rep["failures"] == 0 and rep["nan_bounds"] == 0, rep["failure_examples"]
    assert 0 < rep["max_ratio"] <= 1
    if op_model.endswith("fused"):
        assert rep["tail_cases"] > 1000  # the scalar tail's op order is audited too


def test_no_radius_is_detected_on_fused():
    rep = audit_enclosure(4096, op_model="torch-adam-fused", no_radius=True, seed=7)
    assert rep["failures"] > 0 and rep["max_ratio"] > 1


# ---------------------------------------------------------------- the guard
def _train(flags, decoupled, steps=25):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.Tanh(), torch.nn.Linear(37, 5))  # odd sizes: tails
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(model.named_parameters(), lr=3e-3, weight_decay=0.05 if decoupled else 0.01, **flags)
    x, y = torch.randn(64, 13), torch.randn(64, 5)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


@pytest.mark.parametrize("implementation,decoupled", [("fused", False), ("fused", True), ("foreach", True)])
def test_guard_certifies_recorded_implementation_real_torch_audit(implementation, decoupled, tmp_path):
    ckpt = _train(replay.TORCH_FLAGS[implementation], decoupled)
    group = ckpt["optimizer"]["param_groups"][0]
    assert implementation_of(group) == implementation
    data, summary = torch_compat.compress_checkpoint(ckpt, codec="log8")
    path = tmp_path / "c.jg"
    path.write_bytes(data)
    restored, header = torch_compat.restore_tree(path)
    want = ("torch-adamw" if decoupled else "torch-adam") + "-" + implementation
    assert header["op_model"] == want
    assert restored["optimizer"]["param_groups"][0][implementation] is True
    assert summary["escape_rate"] < 0.5, summary
    grid = gradient_grid(0.2, n_linear=4, n_log=8)
    a = torch_compat.audit(ckpt, restored, tau=0.01, clip=0.2, grid=grid)  # real optimizer, the group's flags
    assert a["violations"] == 0 and a["max_gap_lr"] <= 0.01, a


def test_foreach_none_is_the_single_tensor_path_on_cpu():
    from torch.optim.optimizer import _default_to_fused_or_foreach

    p = torch.zeros(3)
    assert _default_to_fused_or_foreach([p], differentiable=False, use_fused=False) == (False, False)
    assert implementation_of({"foreach": None, "fused": None}) == "single"
    cfg = torch_compat.state.guard_config({"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "foreach": None}, 3,
                                          spec=GuardSpec(codec="log8"))
    assert cfg.op_model == "torch-adam"


@pytest.mark.parametrize("change,message", [
    (dict(fused=True, foreach=True), "fused=True and foreach=True"),
    (dict(capturable=True), "capturable=True"),
])
def test_unmodelled_implementations_are_one_line_errors(change, message):
    ckpt = _train(dict(fused=True), False, steps=2)
    ckpt["optimizer"]["param_groups"][0].update(change)
    with pytest.raises(UnsupportedOptimizerError, match=message) as e:
        check_optimizer_state(ckpt["optimizer"])
    assert "\n" not in str(e.value)


def test_fused_state_on_another_device_is_refused():
    """The fused/foreach CUDA kernels are not the CPU ones: state living on a non-CPU device
    (here 'meta', which every torch build has) is named, never certified as CPU."""
    ckpt = _train(dict(fused=True), True, steps=2)
    for st in ckpt["optimizer"]["state"].values():
        st["exp_avg"] = st["exp_avg"].to("meta")
    with pytest.raises(UnsupportedOptimizerError, match="fused=True with its state on meta") as e:
        check_optimizer_state(ckpt["optimizer"])
    assert "\n" not in str(e.value)
