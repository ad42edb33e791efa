"""torch checkpoints as users write them: an optimizer built from ``model.parameters()``
(no ``param_names``) goes through the CLI, a load into another layout is refused before
anything is written, and the audit of an unrelated pair says so in one line."""
import os
import subprocess
import sys

import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import torch_compat  # noqa: E402
from jaxguard.errors import CheckpointError  # noqa: E402
from torch_compat.state import infer_param_names  # noqa: E402
from cli_batch import run_cli_batch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _trained(model, steps=3, named=False, seed=0):
    torch.manual_seed(seed)
    opt = torch.optim.Adam(model.named_parameters() if named else model.parameters(), lr=1e-3)
    n_in = next(model.parameters()).shape[-1]
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, n_in)).pow(2).mean().backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}, opt


def _env():
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "jaxguard", *args], capture_output=True, text=True, env=_env(),
                          timeout=600)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def test_cli_takes_an_optimizer_built_from_model_parameters(tmp_path):
    ckpt, _ = _trained(_mlp())
    assert "param_names" not in ckpt["optimizer"]["param_groups"][0]
    torch.save(ckpt, tmp_path / "c.pt")
    compress, audit, restore = run_cli_batch([["compress", tmp_path / "c.pt", "-o", tmp_path / "c.jg", "--json"],
                                              ["audit", tmp_path / "c.pt", tmp_path / "c.jg", "--json"],
                                              ["restore", tmp_path / "c.jg", "-o", tmp_path / "r.pt"]], env=_env())
    assert compress.returncode == 0, compress.stderr[-2000:]
    assert audit.returncode == 0 and '"violations": 0' in audit.stdout, audit.stderr[-2000:]
    assert restore.returncode == 0, restore.stderr[-2000:]
    back = torch.load(tmp_path / "r.pt", weights_only=True)
    # the names were used to certify, not written into the state: it loads where it came from
    assert back["optimizer"]["param_groups"] == ckpt["optimizer"]["param_groups"]
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    opt.load_state_dict(back["optimizer"])
    assert opt.state[next(model.parameters())]["exp_avg"].shape == (16, 12)


def test_order_mapping_is_refused_when_buffers_make_it_ambiguous(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    ckpt, _ = _trained(model)
    with pytest.raises(CheckpointError, match=r"5 tensors of the model have the shape \(8,\)") as exc:
        infer_param_names(ckpt["optimizer"], ckpt["model"])
    assert "named_parameters()" in str(exc.value) and "\n" not in str(exc.value)
    torch.save(ckpt, tmp_path / "bn.pt")
    r = _cli("compress", str(tmp_path / "bn.pt"), "-o", str(tmp_path / "bn.jg"))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "named_parameters()" in r.stderr, r.stderr
    assert not (tmp_path / "bn.jg").exists()


def test_unnamed_parameters_map_by_shape_only_when_every_shape_names_one_tensor():
    ckpt, _ = _trained(_mlp())
    names = [["0.weight", "0.bias", "2.weight", "2.bias"]]
    assert infer_param_names(ckpt["optimizer"], ckpt["model"]) == names
    # every shape is the model's only tensor of that shape: the map is proven whatever the order
    swapped = dict(reversed(list(ckpt["model"].items())))
    assert infer_param_names(ckpt["optimizer"], swapped) == names
    # the asserted model order is checked against the shapes, naming the parameter
    with pytest.raises(CheckpointError, match="parameter 0 would be '2.bias'"):
        infer_param_names(ckpt["optimizer"], swapped, param_order="model")
    # a frozen parameter left out of the optimizer: proven by shape; the asserted order's count differs
    model = _mlp()
    model[0].bias.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    for p in opt.param_groups[0]["params"]:
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    assert infer_param_names(opt.state_dict(), model.state_dict()) == [["0.weight", "2.weight", "2.bias"]]
    with pytest.raises(CheckpointError, match="3 parameters, but the model state_dict has 4"):
        infer_param_names(opt.state_dict(), model.state_dict(), param_order="model")


def test_load_into_another_layout_is_refused_before_writing(tmp_path):
    model = _mlp()
    _, opt = _trained(model, named=True)
    torch_compat.save(tmp_path / "o.jg", opt)
    other = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    target = torch.optim.Adam(other.named_parameters(), lr=1e-3)
    before = target.state_dict()
    with pytest.raises(CheckpointError, match=r"'2.weight' has exp_avg of shape \(3, 16\), this optimizer's "
                                              r"parameter is \(4, 16\)"):
        torch_compat.load(tmp_path / "o.jg", target)
    assert target.state_dict() == before   # nothing written
    renamed = torch.optim.Adam([(f"x{n}", p) for n, p in _mlp().named_parameters()], lr=1e-3)
    with pytest.raises(CheckpointError, match="parameter 0 is '0.weight', this optimizer's is 'x0.weight'"):
        torch_compat.load(tmp_path / "o.jg", renamed)
    half = _mlp().half()
    with pytest.raises(CheckpointError, match="torch.float32, this optimizer's parameter is torch.float16"):
        torch_compat.load(tmp_path / "o.jg", torch.optim.Adam(half.named_parameters()))
    same = torch.optim.Adam(_mlp().named_parameters(), lr=1e-3)   # the same layout, fresh weights
    from jaxguard.errors import JaxguardWarning
    with pytest.warns(JaxguardWarning, match="certified against other weights"):
        torch_compat.load(tmp_path / "o.jg", same)
    assert len(same.state_dict()["state"]) == 4


def test_audit_of_an_unrelated_pair_is_one_line(tmp_path):
    a, _ = _trained(_mlp(), named=True)
    torch.manual_seed(1)
    b, _ = _trained(torch.nn.Sequential(torch.nn.Linear(12, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)), named=True)
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    compress, r = run_cli_batch([["compress", tmp_path / "b.pt", "-o", tmp_path / "b.jg"],
                                 ["audit", tmp_path / "a.pt", tmp_path / "b.jg"]], env=_env())
    assert compress.returncode == 0
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-2000:]
    assert "does not hold this checkpoint's optimizer state" in r.stderr and "Traceback" not in r.stderr


def test_migrate_takes_an_optimizer_built_from_model_parameters():
    from jaxguard.format import reader
    from torch_compat import migrate
    ckpt, _ = _trained(_mlp())
    data, summary = migrate.torch_to_container(ckpt)
    assert summary["coordinates"] == sum(t.numel() for t in ckpt["model"].values())
    header, _ = reader.parse(data)
    assert sorted(e["config"]["param"] for e in header["entries"] if e["kind"] == "moments") == \
        sorted(ckpt["model"]), header["entries"]   # one moments entry per parameter, by its model name
    assert "param_names" not in ckpt["optimizer"]["param_groups"][0]   # the caller's dict is not modified


def test_a_copied_snapshot_saves_the_state_of_its_moment(tmp_path):
    """`torch_compat.state.snapshot(copy=True)` (the HF background save's host copy): the
    optimizer may step on while the snapshot is saved, and the file is the one `save`
    would have written at the snapshot's moment (same decoded moments and payload).
    Negative control: a snapshot without copy shares the live tensors, so the step shows."""
    from torch_compat import state
    from helpers import container_canon
    model = _mlp()
    _, opt = _trained(model, named=True)
    torch_compat.save(tmp_path / "now.jg", opt)
    copied = state.snapshot(opt, copy=True)
    shared = state.snapshot(opt)
    before = {k: v["exp_avg"].clone() for k, v in copied[0]["state"].items()}
    opt.zero_grad()
    model(torch.randn(4, 12)).pow(2).mean().backward()
    opt.step()                                   # the training loop goes on
    assert all(torch.equal(copied[0]["state"][k]["exp_avg"], before[k]) for k in before)
    assert not all(torch.equal(shared[0]["state"][k]["exp_avg"], before[k]) for k in before)
    state.save_snapshot(tmp_path / "later.jg", *copied)
    assert container_canon((tmp_path / "later.jg").read_bytes()) == container_canon((tmp_path / "now.jg").read_bytes())
