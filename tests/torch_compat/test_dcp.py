"""torch.distributed.checkpoint with guarded moments: FSDP2 on 2 gloo ranks (CPU), saved
with GuardedSavePlanner (and dcp.async_save), loaded at 2 ranks and into one plain
process, audited with the real Adam step; corrupt/missing rank files; the CLI on DCP dirs.

Tolerances: none. Weights, steps and param groups must be bit-identical to a plain DCP
save; moments must keep every first update within tau*lr (the contract itself).
"""
import json
import os
import shutil

import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

import _dcp_worker as W  # noqa: E402
import torch_compat  # noqa: E402
from jaxguard import cli  # noqa: E402
from jaxguard.audit import gradient_grid  # noqa: E402
from jaxguard.errors import CheckpointError  # noqa: E402
from torch_compat import dcp as tdcp  # noqa: E402

WORLD = 2


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("dcp"))
    mp.start_processes(W.run, args=(WORLD, W.free_port(), root), nprocs=WORLD, start_method="spawn", join=True)
    ranks = [json.load(open(os.path.join(root, f"rank{r}.json"))) for r in range(WORLD)]
    return root, ranks


def test_same_size_resume_is_within_tau_and_weights_are_bit_identical(saved):
    _, ranks = saved
    for r, res in enumerate(ranks):
        assert res["plain_equals_original"], r
        assert res["weights_bit_identical"] and res["steps_identical"], r
        assert res["async_equals_sync"], r
        assert res["moments_changed"] > 0, r          # the moments really went through the codec
        assert res["lr_betas"] == [W.LR, [0.9, 0.999]]
        a = res["audit"]
        assert a["violations"] == 0 and a["max_gap_lr"] <= W.TAU, (r, a)
        assert a["gradients"] == len(gradient_grid(W.CLIP, n_linear=4, n_log=8)) + 1
        assert res["real_step_gap_lr"] <= W.TAU, (r, res["real_step_gap_lr"])


@pytest.mark.parametrize("case", ["flip", "truncate", "missing"])
def test_bad_rank_file_is_one_line_error_and_nothing_is_loaded(saved, case):
    _, ranks = saved
    seen = []
    for r, res in enumerate(ranks):
        c = res["corruption"][case]
        assert c["untouched"], (r, case)                # on every rank, not only the failing one
        assert c["errors"], (r, case)
        seen += c["errors"]
    for e in seen:
        assert "\n" not in e and "__1_0.distcp" in e, e


def _load_plain(path, planner):
    return W.load_into(path, None, planner)   # one process, no mesh


def _guarded_save_error(tmp_path, state, **planner):
    """The one error a GuardedSavePlanner save of `state` fails with (DCP wraps it)."""
    with pytest.raises(BaseException) as info:
        dcp.save(state, checkpoint_id=str(tmp_path / "x"), planner=tdcp.GuardedSavePlanner(**planner))
    (err, _), = info.value.failures.values()
    return err


def test_resharded_load_into_one_plain_process(saved):
    root, _ = saved
    ref = _load_plain(f"{root}/plain", None)
    test = _load_plain(f"{root}/guarded", tdcp.GuardedLoadPlanner(f"{root}/guarded"))
    for a, b in zip(ref[0].parameters(), test[0].parameters()):
        assert torch.equal(a, b)
        assert torch.equal(ref[1].state[a]["step"], test[1].state[b]["step"])
    x, y = W.batch(W.STEPS, 0, 1)
    torch.nn.functional.mse_loss(ref[0](x), y).backward()
    grads = [p.grad.clone() for p in ref[0].parameters()]
    ref[1].zero_grad(set_to_none=True)
    grid = gradient_grid(W.CLIP, n_linear=4, n_log=8)
    a = tdcp.first_update_audit(ref, test, tau=W.TAU, clip=W.CLIP, grid=grid, grads=[grads])
    assert a["violations"] == 0 and a["max_gap_lr"] <= W.TAU, a
    assert a["coordinates"] == sum(p.numel() for p in ref[0].parameters())


def test_cli_restore_compress_inspect_verify(saved, tmp_path, capsys):
    root, _ = saved
    full = tmp_path / "full.pt"
    assert cli.main(["restore", f"{root}/guarded", "-o", str(full)]) == 0
    ckpt = torch.load(full, weights_only=True)
    assert sorted(ckpt) == ["model", "optimizer"]
    names = ckpt["optimizer"]["param_groups"][0]["param_names"]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    ref = _load_plain(f"{root}/plain", None)
    for (n, p), name in zip(ref[0].named_parameters(), names):
        assert torch.equal(ckpt["model"][name], p)
    # the consolidated file is a CKPT of the single-file flows: audit it against the plain one
    plain_ckpt = {"model": ref[0].state_dict(), "optimizer": ref[1].state_dict()}
    for g in plain_ckpt["optimizer"]["param_groups"]:
        g["param_names"] = names
    a = torch_compat.audit(plain_ckpt, ckpt, tau=W.TAU, clip=W.CLIP,
                           grid=gradient_grid(W.CLIP, n_linear=4, n_log=8))
    assert a["violations"] == 0, a

    out = tmp_path / "converted"
    assert cli.main(["compress", f"{root}/plain", "-o", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["coordinates"] == sum(p.numel() for p in ref[0].parameters())
    assert cli.main(["verify", str(out)]) == 0
    assert cli.main(["inspect", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert info["format"] == tdcp.FORMAT and info["world_size"] == 1 and info["coordinates"] == s["coordinates"]
    test = _load_plain(str(out), tdcp.GuardedLoadPlanner(str(out)))
    for a_, b in zip(ref[0].parameters(), test[0].parameters()):
        assert torch.equal(a_, b)

    # verify names the altered file; restore refuses it and writes nothing
    bad = tmp_path / "bad"
    shutil.copytree(f"{root}/guarded", bad)
    victim = bad / "__0_0.distcp"
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 1
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli.main(["verify", str(bad)]) == 1
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and "__0_0.distcp" in line, line
    assert cli.main(["restore", str(bad), "-o", str(tmp_path / "x.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "__0_0.distcp" in err, err
    assert not (tmp_path / "x.pt").exists()


def test_save_refuses_moments_without_their_parameters(tmp_path):
    model, opt = W.build(None, seed=5)
    msd, osd = get_state_dict(model, opt)
    err = _guarded_save_error(tmp_path, {"optim": osd})
    assert isinstance(err, CheckpointError) and "found no model entries for parameter '0.weight'" in str(err)


@pytest.mark.parametrize("flag", ["amsgrad", "maximize"])
def test_save_refuses_optimizer_options_outside_the_op_model(tmp_path, flag):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), foreach=False, **{flag: True})
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    err = _guarded_save_error(tmp_path, {"model": msd, "optim": osd}, uncertifiable="refuse")
    assert f"{flag}=True" in str(err) and "\n" not in str(err)


@pytest.mark.parametrize("case", ["amsgrad", "sgd", "bfloat16"])
def test_state_the_guard_cannot_certify_is_stored_exactly_with_one_warning(tmp_path, case):
    """The planner's default (uncertifiable="exact"): the save is written, what the guard
    cannot certify stays plain DCP tensors (the manifest says why), one warning line; the
    load gives it back bit for bit."""
    import warnings
    from jaxguard.errors import JaxguardWarning
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    if case == "bfloat16":
        model[0].to(torch.bfloat16)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if case == "sgd" else
           torch.optim.Adam(model.parameters(), lr=1e-3, foreach=False, amsgrad=case == "amsgrad"))
    x = torch.randn(4, 6, dtype=torch.bfloat16 if case == "bfloat16" else torch.float32)
    model[1](model[0](x).float()).pow(2).mean().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", JaxguardWarning)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "x"), planner=tdcp.GuardedSavePlanner(),
                 no_dist=True)
    msgs = [str(w.message) for w in seen if issubclass(w.category, JaxguardWarning)]
    assert len(msgs) == 1 and "\n" not in msgs[0] and "stored exactly, not compressed" in msgs[0], msgs
    why = {"amsgrad": "amsgrad=True", "sgd": "not Adam or AdamW", "bfloat16": "bfloat16"}[case]
    assert why in msgs[0], msgs
    man = tdcp.read_metadata(str(tmp_path / "x"))[1]
    assert man["stored_exactly"] and all(why in s["why"] for s in man["stored_exactly"]), man["stored_exactly"]
    assert len(man["moments"]) == (2 if case == "bfloat16" else 0)      # the float32 layer's weight and bias: guarded
    fresh_model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 2))
    if case == "bfloat16":
        fresh_model[0].to(torch.bfloat16)
    fresh = type(opt)(fresh_model.parameters(), **{k: v for k, v in opt.defaults.items()
                                                   if k in ("lr", "momentum", "amsgrad", "foreach")})
    fmsd, fosd = get_state_dict(fresh_model, fresh)
    state = {"model": fmsd, "optim": fosd}
    dcp.load(state, checkpoint_id=str(tmp_path / "x"), planner=tdcp.GuardedLoadPlanner(), no_dist=True)
    exact = {s["param"].split(".", 2)[-1] for s in man["stored_exactly"]}
    for fqn, st in osd["state"].items():
        if fqn in exact:
            for k, t in st.items():
                assert torch.equal(state["optim"]["state"][fqn][k], t), (fqn, k)   # bit for bit


def test_save_refuses_a_non_adam_optimizer(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    err = _guarded_save_error(tmp_path, {"model": msd, "optim": osd}, uncertifiable="refuse")
    assert "not Adam or AdamW" in str(err) and "\n" not in str(err)


def test_plain_dcp_directory_verify_says_how_to_convert(saved, capsys):
    root, _ = saved
    assert cli.main(["verify", f"{root}/plain"]) == 1
    assert "jaxguard compress" in capsys.readouterr().out
