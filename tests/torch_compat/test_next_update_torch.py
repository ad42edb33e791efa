"""The next update and the parameters a torch file is certified for (issue 55).

Every check of a restore runs the real ``torch.optim.AdamW`` over the real parameters:
a fresh optimizer over the same tensors, grouped as the run grouped them, loads the
original or the restored state_dict through torch's own ``load_state_dict`` (its own
index-to-parameter map, never jaxguard's), and both take one step for every gradient
of a grid.  One weight holds |w| ~ 500, where the final ``p + step`` rounding (2**-24 *
500 ~ 3e-5, three times tau * lr at lr 1e-3) makes a certificate against the wrong
parameter visible.  On the code before this change, the unnamed-q/k/v and stale-name
cases compress without a word (or refuse with no way through) and the warmup-from-zero
case is refused: every test here fails there.
"""
import json
import os
import subprocess
import sys
import warnings

import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import torch_compat  # noqa: E402
from jaxguard.audit import AuditTally, gradient_grid  # noqa: E402
from jaxguard.errors import CheckpointError, JaxguardWarning  # noqa: E402
from helpers import one_torch_thread  # noqa: E402,F401 - autouse fixture

TAU, CLIP, LR, D = 0.01, 0.2, 1e-3, 24
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Attention(torch.nn.Module):
    """q, k, v projections of one shape (no bias), an output head."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(D, D, bias=False) for _ in range(3))
        self.out = torch.nn.Linear(D, 4)

    def forward(self, x):
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / D ** 0.5, -1) @ self.v(x)
        return self.out(a)


def groups_of(model):
    """Grouped by weight decay as training scripts do: q and v decay, k and the head do
    not; in optimizer order q, v, k, ... while the model's order is q, k, v."""
    return [{"params": [model.q.weight, model.v.weight], "weight_decay": 0.1},
            {"params": [model.k.weight, model.out.weight, model.out.bias], "weight_decay": 0.0}]


def trained(steps=60, named=False, model=None):
    torch.manual_seed(0)
    model = model or Attention()
    with torch.no_grad():
        model.v.weight[0, :4] = torch.tensor([500.0, -480.0, 512.0, 499.0])   # where the final rounding matters
    if named:
        opt = torch.optim.AdamW(model.named_parameters(), lr=LR, weight_decay=0.1)
    else:
        opt = torch.optim.AdamW(groups_of(model), lr=LR)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 6, D)).pow(2).mean().backward()
        opt.step()
    return model, opt


def real_first_update(params, groups, original_sd, restored_sd, lr=None):
    """`groups`: per param group, the indices into `params` (the live tensors) in the
    optimizer's order.  Returns the `AuditSummary` of both branches' first step, every
    gap in units of the group's learning rate (or `lr`)."""
    tally = AuditTally(TAU)
    grid = list(gradient_grid(CLIP))
    gen = torch.Generator().manual_seed(3)
    rand = [(torch.rand(p.shape, generator=gen) * 2 - 1) * CLIP for p in params]
    for gi, g in enumerate(grid + ["random"]):
        out = []
        for sd in (original_sd, restored_sd):
            ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
            opt = torch.optim.AdamW([{**{k: v for k, v in grp.items() if k != "params"},
                                      "params": [ps[i] for i in grp["params"]]} for grp in groups], lr=LR)
            opt.load_state_dict(sd)
            if lr is not None:
                for group in opt.param_groups:
                    group["lr"] = lr
            for p, r in zip(ps, rand):
                p.grad = r.clone() if g == "random" else torch.full_like(p, float(g))
            opt.step()
            out.append([p.detach().numpy() for p in ps])
        for i, (a, b) in enumerate(zip(*out)):
            rate = lr if lr is not None else next(grp.get("lr", LR) for grp in groups if i in grp["params"])
            tally.add(i, a, b, rate, label=g)
    return tally.summary(len(grid) + 1)


def _spec(groups, params):
    ids = [id(p) for p in params]
    return [{**{k: v for k, v in g.items() if k != "params"}, "params": [ids.index(id(p)) for p in g["params"]]}
            for g in groups]


def _cli(*args):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "jaxguard", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=600)


def _error_line(r):
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "%|" not in ln and "it/s" not in ln]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("jaxguard: error:"), r.stderr[-2000:]
    return lines[0]


# ---------------------------------------------------------------- unnamed, reordered, same-shaped
def test_unnamed_reordered_qkv_is_refused_and_an_asserted_order_restores_within_tau(tmp_path):
    model, opt = trained()
    params = list(model.parameters())                   # q.w, k.w, v.w, out.w, out.b
    groups = _spec(groups_of(model), params)
    sd = opt.state_dict()
    assert all("param_names" not in g for g in sd["param_groups"])
    torch.save({"model": model.state_dict(), "optimizer": sd}, tmp_path / "c.pt")
    line = _error_line(_cli("compress", tmp_path / "c.pt", "-o", tmp_path / "c.jg"))
    assert "cannot be proven" in line and "named_parameters()" in line and "--param-order" in line
    assert not (tmp_path / "c.jg").exists()
    # the user asserts the names in the optimizer's order: certified against the right weights
    names = ["q.weight", "v.weight", "k.weight", "out.weight", "out.bias"]
    (tmp_path / "order.txt").write_text("\n".join(names) + "\n")
    r = _cli("compress", tmp_path / "c.pt", "-o", tmp_path / "c.jg", "--param-order", tmp_path / "order.txt",
             "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    restored, header = torch_compat.restore_tree(tmp_path / "c.jg")
    cfgs = [e["config"] for e in header["entries"] if e["kind"] == "moments"]
    assert [c["param"] for c in cfgs] == names and {c["param_map"] for c in cfgs} == {"asserted-names"}
    res = real_first_update(params, groups, sd, restored["optimizer"])
    assert res.violations == 0, res
    # the audit never maps by an order it cannot prove: refused without the assertion
    line = _error_line(_cli("audit", tmp_path / "c.pt", tmp_path / "c.jg"))
    assert "cannot be proven" in line
    a = _cli("audit", tmp_path / "c.pt", tmp_path / "c.jg", "--param-order", tmp_path / "order.txt", "--json")
    assert a.returncode == 0 and json.loads(a.stdout)["violations"] == 0, a.stderr[-2000:]


def test_the_model_order_the_code_before_took_puts_the_first_update_over_tau(tmp_path):
    """The map the code before took by model order, asserted here on purpose: the real
    first update lands over tau (what `jaxguard audit` agreed with then)."""
    model, opt = trained()
    params = list(model.parameters())
    sd = opt.state_dict()
    data, _ = torch_compat.compress_checkpoint({"model": model.state_dict(), "optimizer": sd},
                                               param_order="model")
    (tmp_path / "w.jg").write_bytes(data)
    restored, _ = torch_compat.restore_tree(tmp_path / "w.jg")
    res = real_first_update(params, _spec(groups_of(model), params), sd, restored["optimizer"])
    assert res.violations > 0 and res.max_gap_lr > 2 * TAU, res


def test_named_parameters_restore_within_tau(tmp_path):
    model, opt = trained(named=True)
    params = list(model.parameters())
    sd = opt.state_dict()
    data, _ = torch_compat.compress_checkpoint({"model": model.state_dict(), "optimizer": sd})
    (tmp_path / "n.jg").write_bytes(data)
    restored, _ = torch_compat.restore_tree(tmp_path / "n.jg")
    res = real_first_update(params, [{"params": list(range(len(params))), "weight_decay": 0.1}], sd,
                            restored["optimizer"])
    assert res.violations == 0, res


def test_a_tied_weight_counts_once_by_storage():
    torch.manual_seed(0)
    emb = torch.nn.Embedding(50, D)
    head = torch.nn.Linear(D, 50, bias=False)
    head.weight = emb.weight                             # nanoGPT's wte / lm_head
    model = torch.nn.ModuleDict({"wte": emb, "mid": torch.nn.Linear(D, D), "lm_head": head})
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    x = torch.randint(0, 50, (4, 7))
    for _ in range(3):
        opt.zero_grad()
        model["lm_head"](torch.tanh(model["mid"](model["wte"](x)))).pow(2).mean().backward()
        opt.step()
    names = torch_compat.state.infer_param_names(opt.state_dict(), model.state_dict())
    assert names == [["wte.weight", "mid.weight", "mid.bias"]]


# ---------------------------------------------------------------- stale names after a rename
class Renamed(torch.nn.Module):
    """The same network after a refactor: its projections live under ``attn``."""

    def __init__(self):
        super().__init__()
        self.attn = torch.nn.ModuleDict({n: torch.nn.Linear(D, D, bias=False) for n in "qkv"})
        self.out = torch.nn.Linear(D, 4)

    def forward(self, x):
        q, k, v = (self.attn[n](x) for n in "qkv")
        return self.out(torch.softmax(q @ k.transpose(-1, -2) / D ** 0.5, -1) @ v)


def test_stale_names_are_refused_in_one_line_with_a_way_through(tmp_path):
    old, old_opt = trained(named=True)
    new = Renamed()
    new.load_state_dict({k.replace("q.", "attn.q.").replace("k.", "attn.k.").replace("v.", "attn.v."): v
                         for k, v in old.state_dict().items()})
    opt = torch.optim.AdamW(new.named_parameters(), lr=LR, weight_decay=0.1)
    opt.load_state_dict(old_opt.state_dict())            # torch keeps the old run's param_names
    assert opt.state_dict()["param_groups"][0]["param_names"][0] == "q.weight"
    params = list(new.parameters())
    sd = opt.state_dict()
    torch.save({"model": new.state_dict(), "optimizer": sd}, tmp_path / "r.pt")
    line = _error_line(_cli("compress", tmp_path / "r.pt", "-o", tmp_path / "r.jg"))
    assert "stale" in line and "'q.weight'" in line and "--param-order model" in line
    r = _cli("compress", tmp_path / "r.pt", "-o", tmp_path / "r.jg", "--param-order", "model")
    assert r.returncode == 0, r.stderr[-2000:]
    restored, _ = torch_compat.restore_tree(tmp_path / "r.jg")
    assert real_first_update(params, [{"params": list(range(len(params))), "weight_decay": 0.1}], sd,
                             restored["optimizer"]).violations == 0
    # torch_compat.save keeps the stale names; a fresh optimizer over the renamed model refuses
    # them by name, and match="position" is the explicit way through
    torch_compat.save(tmp_path / "s.jg", opt)
    fresh = torch.optim.AdamW(new.named_parameters(), lr=LR, weight_decay=0.1)
    with pytest.raises(CheckpointError) as exc:
        torch_compat.load(tmp_path / "s.jg", fresh)
    assert "match='position'" in str(exc.value) and "\n" not in str(exc.value)
    torch_compat.load(tmp_path / "s.jg", fresh, match="position")
    assert [n for g in fresh.state_dict()["param_groups"] for n in g["param_names"]][0] == "attn.q.weight"
    assert real_first_update(params, [{"params": list(range(len(params))), "weight_decay": 0.1}], sd,
                             fresh.state_dict()).violations == 0


# ---------------------------------------------------------------- next lr 0, --lr, the comparison at load
def test_warmup_from_zero_stores_the_moments_exactly(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.named_parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0, s - 3) / 10)   # 0 for 4 steps
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    torch.save(ckpt, tmp_path / "z.pt")
    r = _cli("compress", tmp_path / "z.pt", "-o", tmp_path / "z.jg", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    back, header = torch_compat.restore_tree(tmp_path / "z.jg")
    for idx, st in ckpt["optimizer"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back["optimizer"]["state"][idx][k], st[k])
    info = json.loads(_cli("inspect", tmp_path / "z.jg", "--json").stdout)
    assert len(info["stored_exactly"]) == 4 and "learning rate is 0" in info["stored_exactly"][0]["why"]


def test_a_given_lr_is_recorded_and_an_optimizer_stepping_otherwise_warns_or_refuses(tmp_path):
    model, opt = trained(named=True, steps=10)
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "g.pt")
    r = _cli("compress", tmp_path / "g.pt", "-o", tmp_path / "g.jg", "--lr", "5e-4")
    assert r.returncode == 0, r.stderr[-2000:]
    info = json.loads(_cli("inspect", tmp_path / "g.jg", "--json").stdout)
    (group,) = info["certified_for"]
    assert group["lr"] == 5e-4 and group["source"] == "param_groups+given" and group["weight_decay"] == 0.1
    target = torch.optim.AdamW(model.named_parameters(), lr=LR, weight_decay=0.1)
    with pytest.raises(CheckpointError) as exc:           # the loaded groups say 1e-3: not what was certified
        torch_compat.load(tmp_path / "g.jg", target, strict=True)
    assert "lr=0.001" in str(exc.value) and "lr=0.0005" in str(exc.value) and "\n" not in str(exc.value)
    assert not target.state                                # refused before anything was written
    with pytest.warns(JaxguardWarning, match="certified for lr=0.0005"):
        torch_compat.load(tmp_path / "g.jg", target)
    for g in target.param_groups:                          # the run steps with the certified rate: no warning
        g["lr"] = 5e-4
    model(torch.randn(2, 6, D)).pow(2).mean().backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error", JaxguardWarning)
        target.step()


def test_a_learning_rate_changed_after_load_is_caught_at_the_first_step(tmp_path):
    model, opt = trained(named=True, steps=5)
    torch_compat.save(tmp_path / "h.jg", opt)
    target = torch.optim.AdamW(model.named_parameters(), lr=LR, weight_decay=0.1)
    torch_compat.load(tmp_path / "h.jg", target, strict=True)
    for g in target.param_groups:
        g["lr"] = 3e-3
    model(torch.randn(2, 6, D)).pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(CheckpointError, match="will step with lr=0.003"):
        target.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))   # the step did not happen


# ---------------------------------------------------------------- torch.distributed.checkpoint
def test_dcp_load_compares_the_installed_groups_with_the_certified_update(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch_compat.dcp import GuardedLoadPlanner, GuardedSavePlanner
    model, opt = trained(named=True, steps=5)
    for name, lr, exact in (("given", 5e-4, False), ("zero", 0.0, True)):
        msd, osd = get_state_dict(model, opt)
        planner = GuardedSavePlanner(lr=lr)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / name), planner=planner, no_dist=True)
        man = planner.metadata.planner_data["__jaxguard__"]
        assert (len(man["stored_exactly"]) == 5) == exact and (len(man["moments"]) == 0) == exact
        msd, osd = get_state_dict(model, opt)
        target = {"model": msd, "optim": osd}
        if exact:     # nothing certified: nothing to compare; the moments come back bit for bit
            dcp.load(target, checkpoint_id=str(tmp_path / name), planner=GuardedLoadPlanner(str(tmp_path / name),
                                                                                          strict=True), no_dist=True)
            continue
        from torch.distributed.checkpoint.api import CheckpointException
        with pytest.raises(CheckpointException, match="certified for lr=0.0005"):   # DCP wraps the planner's error
            dcp.load(target, checkpoint_id=str(tmp_path / name),
                     planner=GuardedLoadPlanner(str(tmp_path / name), strict=True), no_dist=True)
        with pytest.warns(JaxguardWarning, match="will step with lr=0.001 but its moments were certified for "
                                                 "lr=0.0005"):
            dcp.load(target, checkpoint_id=str(tmp_path / name), planner=GuardedLoadPlanner(str(tmp_path / name)),
                     no_dist=True)


# ---------------------------------------------------------------- the request value below the edge
def test_state_records_takes_the_next_update_as_one_request_and_refuses_what_torch_reads_itself():
    """Below `torch_compat.save` the next update travels as one `UpdateRequest`: its lr
    replaces the groups' (recorded as given), and weight decay, betas, eps or tx, which
    torch reads from ``param_groups``, are refused in one line instead of ignored."""
    from jaxguard.core.config import UpdateRequest
    from jaxguard.errors import ConfigError
    from torch_compat import state as tstate
    model, opt = trained(named=True, steps=3)
    sd, params = opt.state_dict(), dict(model.named_parameters())
    _, records = tstate.state_records(sd, params, update=UpdateRequest(lr=5e-4))
    configs = {r.config for r in records if hasattr(r, "config")}
    assert configs and {c.lr for c in configs} == {5e-4} and {c.source for c in configs} == {"param_groups+given"}
    assert {c.weight_decay for c in configs} == {0.1}                      # from the group, not the request
    _, records = tstate.state_records(sd, params)                          # no request: the groups' own
    assert {r.config.lr for r in records if hasattr(r, "config")} == {LR}
    for field, value in (("weight_decay", 0.0), ("betas", (0.9, 0.99)), ("eps", 1e-6)):
        with pytest.raises(ConfigError, match=f"reads {field} from the optimizer's param_groups") as exc:
            tstate.state_records(sd, params, update=UpdateRequest(**{field: value}))
        assert "\n" not in str(exc.value)
    with pytest.raises(ConfigError, match="either as update= or as lr="):
        tstate.torch_update_request(UpdateRequest(), lr=1e-3)
