"""torch <-> optax migration: Python functions and the `jaxguard migrate` verb; the first
update after migration matches the source framework's within tau * lr."""
import jax.numpy as jnp
import numpy as np
import optax
import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import torch_compat  # noqa: E402
from jaxguard import cli, optax_adapter  # noqa: E402
from jaxguard.errors import CheckpointError  # noqa: E402
from torch_compat import migrate  # noqa: E402

LR, TAU, CLIP = 1e-3, 0.01, 0.2
GRID = [-0.2, -0.05, -1e-4, -1e-7, 0.0, 1e-7, 1e-4, 0.05, 0.2]


def torch_ckpt(decoupled, steps=5):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(model.named_parameters(), lr=LR, weight_decay=1e-2 if decoupled else 0.0, foreach=False)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(16, 12)).pow(2).mean().backward()
        opt.step()
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}, "optimizer": opt.state_dict()}


def torch_first_update(ckpt, g):
    """{name: new param} after one real torch step with gradient value g everywhere."""
    out = {}
    sd = ckpt["optimizer"]
    for idx, (name, group) in torch_compat.state.param_index(sd).items():
        st = sd["state"][idx]
        p = ckpt["model"][name].float()
        grad = g[name] if isinstance(g, dict) else torch.full_like(p, g)
        out[name] = torch_compat.state.torch_step(p, st["exp_avg"], st["exp_avg_sq"], grad, int(st["step"]),
                                                  group, bool(group.get("decoupled_weight_decay", False))).numpy()
    return out


def optax_first_update(tx, st, params, g):
    gt = {k: jnp.full(jnp.shape(p), g, jnp.float32) for k, p in params.items()} if not isinstance(g, dict) else g
    u, _ = tx.update(gt, st, params)
    return {k: np.asarray(v) for k, v in optax.apply_updates(params, u).items()}


def max_gap(a, b):
    return max(float(np.max(np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)))) / LR for k in a)


@pytest.mark.parametrize("decoupled", [False, True], ids=["adam", "adamw"])
def test_torch_to_optax_and_back(decoupled, tmp_path):
    ckpt = torch_ckpt(decoupled)
    # exact moments: Python function
    params = {k: v.numpy() for k, v in ckpt["model"].items()}
    st, tx = torch_compat.to_optax(ckpt["optimizer"], params)
    jp = {k: jnp.asarray(v) for k, v in params.items()}
    for g in GRID:
        assert max_gap(torch_first_update(ckpt, g), optax_first_update(tx, st, jp, g)) <= TAU
    # nested params give the same dotted names
    nested = {"0": {"weight": params["0.weight"], "bias": params["0.bias"]},
              "2": {"weight": params["2.weight"], "bias": params["2.bias"]}}
    st_n, _ = torch_compat.to_optax(ckpt["optimizer"], nested)
    assert np.array_equal(np.asarray(st_n[0].mu["0"]["weight"]), np.asarray(st[0].mu["0.weight"]))
    # back to torch: exact
    back = torch_compat.from_optax(st, jp, lr=LR, weight_decay=1e-2 if decoupled else None)
    for idx, (name, _) in torch_compat.state.param_index(back["optimizer"]).items():
        src = ckpt["optimizer"]["state"][ckpt["optimizer"]["param_groups"][0]["param_names"].index(name)]
        assert torch.equal(back["optimizer"]["state"][idx]["exp_avg"], src["exp_avg"])
        assert int(back["optimizer"]["state"][idx]["step"]) == int(src["step"])
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    model = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3))
    model.load_state_dict(back["model"])
    cls(model.named_parameters(), lr=LR).load_state_dict(back["optimizer"])

    # CLI: torch checkpoint -> guarded optax container -> torch checkpoint
    src = tmp_path / "ckpt.pt"
    torch.save(ckpt, src)
    out = tmp_path / "opt.jg"
    assert cli.main(["migrate", str(src), "--to", "optax", "-o", str(out), "--json"]) == 0
    mp, mst, mtx = migrate.load_migrated(out)
    worst = 0.0
    for g in GRID:
        worst = max(worst, max_gap(torch_first_update(ckpt, g), optax_first_update(mtx, mst, mp, g)))
    rng = np.random.default_rng(0)
    rg = {k: rng.uniform(-CLIP, CLIP, np.shape(v)).astype(np.float32) for k, v in params.items()}
    worst = max(worst, max_gap(torch_first_update(ckpt, {k: torch.from_numpy(v) for k, v in rg.items()}),
                               optax_first_update(mtx, mst, mp, {k: jnp.asarray(v) for k, v in rg.items()})))
    print("torch -> optax (guarded) worst gap / lr:", worst)
    assert worst <= TAU
    back_pt = tmp_path / "back.pt"
    assert cli.main(["migrate", str(out), "--to", "torch", "-o", str(back_pt)]) == 0
    back2 = torch.load(back_pt, weights_only=True)
    worst2 = max(max_gap(optax_first_update(mtx, mst, mp, g), torch_first_update(back2, g)) for g in GRID)
    print("optax -> torch worst gap / lr:", worst2)
    assert worst2 <= TAU


def test_migrate_errors(tmp_path, capsys):
    p = tmp_path / "x.pt"
    torch.save({"model": {}}, p)
    assert cli.main(["migrate", str(p), "--to", "optax", "-o", str(tmp_path / "o")]) == 2
    assert cli.main(["migrate", str(p), "--to", "torch", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(e.startswith("jaxguard: error: ") for e in err)
    params = {"w": jnp.zeros(3)}
    st = optax.adam(LR).init(params)
    jg_path = tmp_path / "np.jg"
    optax_adapter.save(jg_path, st, params, lr=LR)
    with pytest.raises(CheckpointError, match="include_params=True"):
        migrate.container_to_torch(jg_path)
