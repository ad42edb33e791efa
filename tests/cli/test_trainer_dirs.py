"""The CLI on Hugging Face Trainer and accelerate checkpoint directories (issue 56, item 4).

A real ``transformers.Trainer`` and a real ``accelerate.Accelerator`` write their usual
directories; ``jaxguard compress DIR -o OUT`` compresses the optimizer file(s) and copies
the rest; ``GuardedTrainer`` / the accelerate integration resume from OUT as it is;
``jaxguard restore OUT -o DIR2`` gives a directory the plain Trainer and
``Accelerator.load_state`` resume from.  Every verb names the kind it saw.

Tolerances: the first update after the restore is within tau * lr of the original's for
every gradient |g| <= C (the real torch first-update audit: the guarantee itself); every
file other than the optimizer's comes back byte for byte.
"""
from __future__ import annotations

import filecmp
import json
import os

import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
from helpers import ByteDataset, tiny_gpt2  # noqa: E402
from helpers import one_torch_thread  # noqa: E402,F401 - an autouse fixture

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import torch_compat  # noqa: E402
from jaxguard.cli.inputs import DESCRIPTIONS, recognise  # noqa: E402
from jaxguard.cli.main import main  # noqa: E402
from jaxguard.cli.torch_load import load_checkpoint  # noqa: E402
from jaxguard.cli.trainer_dirs import load_weights, trainer_param_order  # noqa: E402

SEQ, N, MORE, LR = 16, 4, 3, 1e-3


def _args(out, steps):
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, learning_rate=LR, optim="adamw_torch",
        lr_scheduler_type="constant", weight_decay=0.01, max_grad_norm=0.2, save_strategy="steps", save_steps=N,
        logging_steps=1, report_to="none", use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0,
        disable_tqdm=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("trainer_dirs")
    tr = transformers.Trainer(model=tiny_gpt2(SEQ), args=_args(root / "run", N), train_dataset=ByteDataset(SEQ, 96))
    tr.train()
    true_order = {id(p): n for n, p in tr.model.named_parameters()}
    true_order = [true_order[id(p)] for g in tr.optimizer.param_groups for p in g["params"]]
    acc = accelerate.Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))
    opt = torch.optim.AdamW(model.named_parameters(), lr=LR, foreach=False)
    model, opt = acc.prepare(model, opt)
    for _ in range(3):
        acc.backward(model(torch.randn(8, 12)).pow(2).mean())
        opt.step()
        opt.zero_grad()
    acc.save_state(str(root / "acc"))
    return {"hf": root / "run" / f"checkpoint-{N}", "acc": root / "acc", "root": root, "true_order": true_order}


def test_trainer_order_is_the_trainers_own(dirs):
    sd = load_checkpoint(str(dirs["hf"] / "optimizer.pt"))
    assert trainer_param_order(str(dirs["hf"]), sd) == dirs["true_order"]


def test_hf_directory_compress_restore_resume(dirs, tmp_path, capsys):
    from jaxguard.integrations.hf import GuardedTrainer
    src, out, back = dirs["hf"], tmp_path / "c", tmp_path / "r"
    assert recognise(src).kind == "hf-checkpoint"
    # the Trainer's optimizer has no param_names and tiny GPT-2's shapes repeat: the map is asserted, not guessed
    assert main(["compress", str(src), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "cannot be proven" in err and "--param-order trainer" in err and err.count("\n") == 1, err
    assert not out.exists()
    assert main(["compress", str(src), "-o", str(out), "--param-order", "trainer", "--json"]) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["input_kind"] == "hf-checkpoint" and s["optimizer_files"] == ["optimizer.jg"]
    assert sorted(os.listdir(out)) == sorted(n if n != "optimizer.pt" else "optimizer.jg" for n in os.listdir(src))
    assert s["container_bytes"] < 0.35 * os.path.getsize(src / "optimizer.pt")
    for name in os.listdir(src):
        if name != "optimizer.pt":
            assert filecmp.cmp(src / name, out / name, shallow=False), name
    # GuardedTrainer resumes from the compressed directory as it is
    g = GuardedTrainer(model=tiny_gpt2(SEQ), args=_args(tmp_path / "g", N + MORE), train_dataset=ByteDataset(SEQ, 96))
    g.train(resume_from_checkpoint=str(out))
    assert g.state.global_step == N + MORE
    # restore: the plain Trainer resumes from it
    assert main(["restore", str(out), "-o", str(back)]) == 0
    assert "(a Hugging Face Trainer checkpoint directory)" in capsys.readouterr().out
    assert sorted(os.listdir(back)) == sorted(os.listdir(src))
    p = transformers.Trainer(model=tiny_gpt2(SEQ), args=_args(tmp_path / "p", N + MORE), train_dataset=ByteDataset(SEQ, 96))
    p.train(resume_from_checkpoint=str(back))
    assert p.state.global_step == N + MORE
    # the real torch first update from the original and the restored optimizer.pt: within tau
    weights = load_weights(str(src))
    orig = {"model": weights, "optimizer": load_checkpoint(str(src / "optimizer.pt"))}
    rest = {"model": weights, "optimizer": load_checkpoint(str(back / "optimizer.pt"))}
    a = torch_compat.audit(orig, rest, param_order=dirs["true_order"])
    assert a["violations"] == 0 and a["coordinates"] == s["coordinates"], a


def test_accelerate_directory_compress_restore_resume(dirs, tmp_path, capsys):
    from jaxguard.integrations import accelerate as jg_acc
    src, out, back = dirs["acc"], tmp_path / "c", tmp_path / "r"
    assert recognise(src).kind == "accelerate-checkpoint"
    assert main(["compress", str(src), "-o", str(out)]) == 0
    assert "accelerate save_state directory" in capsys.readouterr().out
    assert (out / "optimizer.jg").is_file() and not (out / "optimizer.bin").exists()
    assert recognise(out).kind == "accelerate-checkpoint"      # an optimizer.jg beside weights: not the Trainer's

    def fresh():
        acc = accelerate.Accelerator(cpu=True)
        model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))
        opt = torch.optim.AdamW(model.named_parameters(), lr=LR, foreach=False)
        model, opt = acc.prepare(model, opt)
        return acc, opt

    acc, opt = fresh()
    jg_acc.load_state(acc, str(out))                 # the integration reads the compressed directory
    assert opt.state_dict()["state"]
    assert main(["restore", str(out), "-o", str(back)]) == 0
    assert "(an accelerate save_state directory)" in capsys.readouterr().out
    acc, opt = fresh()
    acc.load_state(str(back))                         # plain accelerate reads the restored one
    orig = load_checkpoint(str(src / "optimizer.bin"))
    got = opt.state_dict()
    assert orig["state"].keys() == got["state"].keys()
    weights = load_weights(str(src))
    a = torch_compat.audit({"model": weights, "optimizer": orig}, {"model": weights, "optimizer": got})
    assert a["violations"] == 0, a


def test_every_verb_names_the_trainer_directory_it_saw(dirs, tmp_path, capsys):
    assert main(["compress", str(dirs["hf"]), "-o", str(tmp_path / "c"), "--param-order", "trainer"]) == 0
    assert main(["compress", str(dirs["acc"]), "-o", str(tmp_path / "ac")]) == 0
    capsys.readouterr()
    hf, acc = "hf-checkpoint", "accelerate-checkpoint"
    cases = [   # (verb, input, its kind, status or the words of its one-line refusal)
        ("inspect", dirs["hf"], hf, 0), ("verify", dirs["hf"], hf, 1),
        ("restore", dirs["hf"], hf, "no compressed optimizer"),
        ("inspect", tmp_path / "c", hf, 0), ("verify", tmp_path / "c", hf, 0),
        ("compress", tmp_path / "c", hf, "compressed already"),
        ("inspect", dirs["acc"], acc, 0), ("verify", dirs["acc"], acc, 1),
        ("restore", dirs["acc"], acc, "no compressed optimizer"),
        ("inspect", tmp_path / "ac", acc, 0), ("verify", tmp_path / "ac", acc, 0),
        ("compress", tmp_path / "ac", acc, "compressed already"),
    ]
    for verb, path, kind, want in cases:
        args = [verb, str(path)] + (["-o", str(tmp_path / f"{verb}.out")] if verb in ("compress", "restore") else [])
        rc = main(args)
        out, err = capsys.readouterr()
        assert recognise(path).kind == kind, (verb, path)
        if isinstance(want, str):
            assert rc == 2 and want in err and err.count("\n") == 1, (verb, path, err)
        else:
            assert rc == want, (verb, path, out, err)
        said = out + err
        other = DESCRIPTIONS[acc if kind == hf else hf]
        assert DESCRIPTIONS[kind] in said and other not in said, (verb, path, said)
        assert ".metadata" not in said and "DCP" not in said, (verb, path, said)
    assert main(["compress", str(dirs["hf"] / "optimizer.pt"), "-o", str(tmp_path / "x.jg")]) == 2
    err = capsys.readouterr().err
    assert "optimizer state_dict alone" in err and "Hugging Face Trainer checkpoint directory" in err, err
