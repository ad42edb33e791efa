"""A tied weight (one tensor under two state_dict keys) is stored once and restored tied.

`torch.save` keeps one storage for GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``;
`jaxguard compress` now stores one raw entry for both (the tree names it twice) and
`jaxguard restore` writes one storage, so the restored file is what torch itself would write.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import torch_compat  # noqa: E402
from jaxguard.format import container  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class TiedLM(torch.nn.Module):
    def __init__(self, vocab=300, d=48):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.mid = torch.nn.Linear(d, d)
        self.head = torch.nn.Linear(d, vocab, bias=False)
        self.head.weight = self.wte.weight            # tied, as in GPT-2

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.wte(x))))


def _checkpoint():
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        x = torch.randint(0, 300, (8, 5))
        torch.nn.functional.cross_entropy(model(x).reshape(-1, 300), x.reshape(-1)).backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxguard", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT})


def test_a_tied_weight_is_one_entry_and_restores_as_one_storage(tmp_path):
    ckpt = _checkpoint()
    sd = ckpt["model"]
    assert sd["head.weight"].data_ptr() == sd["wte.weight"].data_ptr()
    torch.save(ckpt, tmp_path / "c.pt")
    r = _cli("compress", str(tmp_path / "c.pt"), "-o", str(tmp_path / "c.jg"))
    assert r.returncode == 0, r.stderr
    header, payload, _ = container.read(str(tmp_path / "c.jg"))
    raw_names = [e["name"] for e in header["entries"] if e["kind"] == "raw"]
    assert "model/wte.weight" in raw_names and "model/head.weight" not in raw_names
    tree = dict(header["meta"]["tree"]["__dict__"])["model"]["__dict__"]
    assert dict(tree)["head.weight"] == {"__tensor__": "model/wte.weight"}

    r = _cli("restore", str(tmp_path / "c.jg"), "-o", str(tmp_path / "back.pt"))
    assert r.returncode == 0, r.stderr
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    bsd = back["model"]
    assert bsd["head.weight"].data_ptr() == bsd["wte.weight"].data_ptr()      # tied again
    for k, t in sd.items():
        assert torch.equal(bsd[k], t), k
    # the restored file holds the weight once, as torch.save's does
    plain = tmp_path / "plain.pt"
    torch.save(torch.load(tmp_path / "c.pt", weights_only=True), plain)
    assert abs(os.path.getsize(tmp_path / "back.pt") - os.path.getsize(plain)) < 4 * sd["wte.weight"].numel()

    # the in-process reader gives the same tensors for both keys, and the optimizer loads
    tree_back, _ = torch_compat.restore_tree(str(tmp_path / "c.jg"))
    assert torch.equal(tree_back["model"]["head.weight"], sd["wte.weight"])
    model = TiedLM()
    model.load_state_dict(tree_back["model"])
    assert model.head.weight is model.wte.weight


def test_views_of_one_storage_that_differ_are_stored_apart(tmp_path):
    base = torch.arange(24, dtype=torch.float32)
    ckpt = _checkpoint()
    ckpt["extra"] = {"a": base[:12].reshape(3, 4), "b": base[12:].reshape(3, 4), "c": base[:12].reshape(4, 3),
                     "e0": torch.empty(0), "e1": torch.empty(0)}
    torch.save(ckpt, tmp_path / "v.pt")
    assert _cli("compress", str(tmp_path / "v.pt"), "-o", str(tmp_path / "v.jg")).returncode == 0
    header = container.read(str(tmp_path / "v.jg"))[0]
    names = {e["name"] for e in header["entries"]}
    assert {"extra/a", "extra/b", "extra/c", "extra/e0", "extra/e1"} <= names
    back, _ = torch_compat.restore_tree(str(tmp_path / "v.jg"))
    for k in ("a", "b", "c"):
        assert torch.equal(back["extra"][k], torch.load(tmp_path / "v.pt", weights_only=True)["extra"][k])
    assert json.dumps(header["meta"]).count('"extra/a"') == 1
