"""Portability: the replay, its variant detection, the enclosure audit and the guard's
real-torch audit under the kernel choices torch and MKL take from the environment
(``ATEN_CPU_CAPABILITY``, ``MKL_ENABLE_INSTRUCTIONS``, ``MKL_CBWR``), each in a fresh
subprocess; and the guard's soundness when the replay's variant is wrong.

The full-size matrix is ``python bench/portability.py`` (bench/results/portability.md).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench" / "portability.py"


def _load_bench():
    """bench/portability.py as a module, by its path (bench/ is scripts, not a package)."""
    spec = importlib.util.spec_from_file_location("bench_portability", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


portability = _load_bench()

import torch_compat  # noqa: E402
from torch_compat.enclosure import audit_enclosure  # noqa: E402
from jaxguard.errors import CheckpointError  # noqa: E402
from torch_compat.replay import AdamVariant, adam_step, detect_variant, torch_adam_step  # noqa: E402


def _label(cell):
    return ",".join(f"{k}={v}" for k, v in cell.items()) or "defaults"


@pytest.mark.slow
@pytest.mark.parametrize("cell", portability.quick_cells(), ids=_label)
def test_matrix_cell(cell):
    env = {k: v for k, v in os.environ.items() if k not in portability.FACTORS}
    env.update(cell)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, str(BENCH), "--cell", "--mode", "quick"],
                          env=env, capture_output=True, text=True, timeout=900)
    reason = portability.unrunnable(cell, done.returncode, portability.cpu_flags())
    if reason:  # reported, not skipped: it passes only because the CPU really lacks the flags
        print(f"{_label(cell)}: {reason}")
        assert portability.missing_flags(cell, portability.cpu_flags())
        return
    assert done.returncode == 0, done.stderr[-3000:]
    row = json.loads(done.stdout.strip().splitlines()[-1])
    # a request this CPU cannot honour still runs (torch/MKL fall back); say so, do not skip
    print(f"{_label(cell)}: torch runs {row['torch_capability']}, honoured={row['honoured']} {row['note']}; "
          f"variant {row['variant']}; own sqrt binades {row['sqrt_own_binades']}")
    assert row["variant"]["matched"], row["variant"]["detail"]
    assert row["parity"]["coordinates"] >= 250_000
    assert row["parity"]["fallback"] > 0  # the edge inputs did reach the numpy model
    assert row["parity"]["total_mismatches"] == 0, row["parity"]
    assert row["enclosure"]["failures"] == 0 and row["enclosure"]["nan_bounds"] == 0, row["enclosure"]
    assert row["guard_audit"]["violations"] == 0, row["guard_audit"]


def _wrong_variant(variant: AdamVariant) -> AdamVariant:
    """A variant that is not this machine's: IEEE sqrt where torch is not (or the reverse
    fusing choice where torch's sqrt happens to be IEEE)."""
    if variant.sqrt != "ieee":
        return AdamVariant(**{**variant.to_dict(), "sqrt": "ieee", "sqrt_table_sha256": ""})
    return AdamVariant(**{**variant.to_dict(), "lerp_fma": not variant.lerp_fma, "addcmul_fma": not variant.addcmul_fma})


def test_guard_is_sound_whatever_variant_the_replay_assumes(tmp_path):
    variant = detect_variant()
    wrong = _wrong_variant(variant)
    # negative control: the wrong variant really is wrong here
    rng = np.random.default_rng(2)
    n = 50_000
    p, g, m = (rng.standard_normal(n) * s for s in (0.05, 0.02, 1e-3))
    v = 10.0 ** rng.uniform(-12, -2, n)
    p, g, m, v = (x.astype(np.float32) for x in (p, g, m, v))
    want = torch_adam_step(p, g, m, v, step=9, lr=1e-3)[0]
    got = adam_step(p, g, m, v, step=9, lr=1e-3, variant=wrong)[0]
    assert np.count_nonzero(want.view(np.int32) != got.view(np.int32)) > 0
    # the bound covers every variant: the enclosure audit replayed with the wrong one passes
    report = audit_enclosure(2048, seed=3, variant=wrong)
    assert report["failures"] == 0, report["failure_examples"][:2]
    # and a guarded checkpoint recorded under the wrong variant audits clean with real torch
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(32, 96), torch.nn.Tanh(), torch.nn.Linear(96, 32))
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3, foreach=False)
    x = torch.randn(128, 32)
    for _ in range(20):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    data, summary = torch_compat.compress_checkpoint(ckpt, variant=wrong.to_dict())
    path = tmp_path / "wrong.jg"
    path.write_bytes(data)
    restored, header = torch_compat.restore_tree(path)
    assert header["variant"]["sqrt"] == wrong.sqrt and summary["coordinates"] > 6000
    audit = torch_compat.audit(ckpt, restored)
    assert audit["violations"] == 0, audit


def test_variant_detection_runs_only_after_the_checkpoint_validates():
    calls = []

    def detect():
        calls.append(1)
        return {"matched": False, "detail": "never reached"}

    with pytest.raises(CheckpointError, match="param_names"):
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        ambiguous = {**model.state_dict(), "running_mean": torch.zeros(2)}   # no param_names, a float buffer
        torch_compat.compress_checkpoint({"model": ambiguous, "optimizer": opt.state_dict()}, variant=detect)
    assert calls == []
