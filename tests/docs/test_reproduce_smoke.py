"""Smoke test of bench/reproduce.py at tiny settings (--tiny: the CNN, 1 seed, 20 steps, 2
codecs, 5 continuation steps, no ablation; optax MLP 1 seed 20 steps), into a tmp dir;
then a second run must resume every condition from the JSON-lines cache."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the reproduction trains torch models (pip install -e '.[torch]')")

ROOT = Path(__file__).resolve().parents[2]


def run(out, cache):
    return subprocess.run([sys.executable, str(ROOT / "bench" / "reproduce.py"), "--tiny", "--out", str(out),
                           "--cache", str(cache)], capture_output=True, text=True, timeout=900)


def test_tiny_run_outputs_and_resume(tmp_path):
    out, cache = tmp_path / "results", tmp_path / "cache"
    p = run(out, cache)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    res = json.loads((out / "guarded_reproduction.json").read_text())
    rows = res["rows"]
    assert {r["codec"] for r in rows} == {"log8", "block8-unguarded"}
    assert len(rows) == 6 and {r["fraction"] for r in rows} == {0.1, 0.5, 1.0}
    keys = {"model", "seed", "fraction", "codec", "coordinates", "escapes", "payload_ratio", "container_ratio",
            "first_update_max_gap_lr", "audit_violations", "encode_seconds", "restore_seconds",
            "continuation_loss_delta"}
    assert all(keys <= set(r) for r in rows)
    for r in rows:  # the continuation's parameter difference, against the exact state's own move
        assert r["continuation_param_moved"] > 0 and r["continuation_param_distance"] >= 0
        if r["guarded"]:
            assert r["continuation_param_distance"] < r["continuation_param_moved"]
        assert r["continuation_param_distance_rel"] == r["continuation_param_distance"] / r["continuation_param_moved"]
    for r in rows:
        if r["guarded"]:
            assert r["audit_violations"] == 0 and r["first_update_max_gap_lr"] <= 0.01
        assert r["model_params_exact"]
    assert any(r["audit_violations"] > 0 for r in rows if not r["guarded"])  # the unguarded baseline breaks tau
    assert res["acceptance"]["guarded_violating_rows"] == 0
    assert {"machine", "versions", "timing", "settings"} <= set(res)
    if res["optax_rows"] is not None:
        assert all(r["audit_violations"] == 0 for r in res["optax_rows"] if r["guarded"])
    md = (out / "guarded_reproduction.md").read_text()
    assert "| cnn | 10% (2) | log8 |" in md and "Acceptance" in md and "exact continuation's move |" in md
    for png in ("guarded_reproduction_payload.png", "guarded_reproduction_escapes.png", "guarded_reproduction_gaps.png"):
        assert (out / png).stat().st_size > 1000
    assert list(cache.glob("cnn-seed701-steps20.pt"))

    # resumable: every condition comes from the cache, rows unchanged
    p2 = run(out, cache)
    assert p2.returncode == 0, p2.stderr[-4000:]
    res2 = json.loads((out / "guarded_reproduction.json").read_text())
    assert res2["timing"]["conditions_resumed"] == 3
    assert [r["escapes"] for r in res2["rows"]] == [r["escapes"] for r in rows]
