"""The Python examples in the docs and README's quickstarts run as written (a renamed
public name or a changed default breaks them here)."""
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _block_under(doc, heading):
    """The first ```python block after `heading` in `doc`."""
    text = (ROOT / doc).read_text()
    start = text.index(heading)
    m = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert m, f"no python block under {heading!r} in {doc}"
    return m.group(1)


def _quickstarts():
    """README's "## Quickstart" code blocks by the bold label above them:
    {label: [(language, code), ...]} in the order they appear."""
    text = (ROOT / "README.md").read_text()
    start = text.index("## Quickstart")
    end = text.index("\n## ", start + 1)
    out, label = {}, None
    for m in re.finditer(r"\*\*(.+?)\*\*|```(python|bash)\n(.*?)```", text[start:end], re.S):
        if m.group(1):
            label = m.group(1)
        else:
            out.setdefault(label, []).append((m.group(2), m.group(3)))
    return out


QUICK = _quickstarts()


def _run(label, ns=None):
    ns = {} if ns is None else ns
    for lang, code in QUICK[label]:
        if lang == "python":
            exec(compile(code, f"README.md:{label}", "exec"), ns)
    return ns


@pytest.mark.parametrize("doc, heading", [("docs/optax.md", "## The core API: one moment pair")])
def test_snippet_runs(doc, heading, capsys):
    exec(compile(_block_under(doc, heading), f"{doc}:{heading}", "exec"), {})
    lines = capsys.readouterr().out.split()
    assert lines[-1] == "1"          # the jitted hook compiled once for two steps
    assert "block8-unguarded" in lines


@pytest.mark.parametrize("heading", ["## NNX", "## linen"])
def test_flax_doc_examples_run(heading, tmp_path, monkeypatch, capsys):
    pytest.importorskip("flax")
    monkeypatch.chdir(tmp_path)
    exec(compile(_block_under("docs/flax.md", heading), f"docs/flax.md:{heading}", "exec"), {})
    words = capsys.readouterr().out.split()
    assert words[:2] == ["step", "3"] and np.isfinite(float(words[3]))   # resumed at the saved step, trains on


def test_readme_has_the_five_quickstarts():
    assert list(QUICK) == ["torch", "optax", "orbax", "Hugging Face Trainer", "torch.distributed.checkpoint"]


def test_readme_torch_quickstart_and_cli(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    _run("torch")
    assert (tmp_path / "opt.jg").stat().st_size > 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    commands = [line.split() for lang, code in QUICK["torch"] if lang == "bash" for line in code.splitlines()]
    assert [c[:2] for c in commands] == [["jaxguard", "compress"], ["jaxguard", "restore"]]
    for cmd in commands:  # `python -m jaxguard` is the console script of this checkout
        done = subprocess.run([sys.executable, "-m", *cmd], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
    src, back = (torch.load(tmp_path / f, weights_only=False) for f in ("ckpt.pt", "ckpt2.pt"))
    assert back["model"].keys() == src["model"].keys()
    assert all(torch.equal(back["model"][k], src["model"][k]) for k in src["model"])
    import torch_compat
    audit = torch_compat.audit(src, back)          # the real torch.optim.AdamW, first update
    assert audit["violations"] == 0 and audit["coordinates"] == 520, audit


def test_readme_optax_and_orbax_quickstarts(tmp_path, monkeypatch):
    import jax
    monkeypatch.chdir(tmp_path)
    ns = _run("optax")
    import jaxguard as jg
    assert int(ns["state"][0].count) == 3
    mu, nu = np.asarray(ns["state"][0].mu["w"]), np.asarray(ns["state"][0].nu["w"])
    assert mu.shape == (4096,) and np.all(nu >= 0) and np.any(mu != 0)
    pytest.importorskip("orbax.checkpoint")
    # what the orbax example saves (the state jg.load returned), through jg.save
    jg.save("again.jg", ns["state"], ns["params"], tx=ns["tx"])
    again = jg.load("again.jg", like=ns["tx"].init(ns["params"]))
    ns = _run("orbax", ns)
    # the orbax handler certifies the same codes as jg.save: the restores agree bit for bit
    for a, b in zip(jax.tree_util.tree_leaves(ns["state"]), jax.tree_util.tree_leaves(again)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_readme_hf_trainer_quickstart(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    _run("Hugging Face Trainer")
    ckpt = tmp_path / "hf_run" / "checkpoint-2"
    assert (ckpt / "optimizer.jg").stat().st_size > 0 and not (ckpt / "optimizer.pt").exists()


def test_readme_dcp_quickstart(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    monkeypatch.chdir(tmp_path)
    ns = _run("torch.distributed.checkpoint")
    from jaxguard.cli import main
    assert main(["verify", "dcp_ckpt"]) == 0
    assert main(["inspect", "dcp_ckpt", "--json"]) == 0
    state = ns["opt"].state_dict()["state"]
    assert len(state) == 2 and all(bool(s["exp_avg_sq"].ge(0).all()) for s in state.values())
