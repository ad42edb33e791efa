"""The HF Trainer and accelerate integrations publish a checkpoint directory as a whole.

Both frameworks write a checkpoint's files into the directory in place, so a save that stops
half way (a kill, a full disk, an error) used to leave a directory mixing the new weights with
the previous optimizer state, or one without an optimizer file that the Trainer resumes from
with Adam restarted at zero. Here a real GuardedTrainer / accelerate loop saves twice to the
same place with another data order, the second save interrupted at a real point of its write
path (an OSError raised while the optimizer file is written; a stop between the two renames
that publish it), and every file of the first checkpoint must still be there, bit for bit.
The kill -9 versions run from bench/faults.py (real processes, bench/results/faults.md).
"""
from __future__ import annotations

import hashlib
import os

import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
from helpers import byte_tokens, tiny_gpt2  # noqa: E402
from helpers import one_torch_thread  # noqa: E402,F401 - an autouse fixture

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import torch_compat  # noqa: E402
from jaxguard.errors import CheckpointError  # noqa: E402
from jaxguard.format import storage  # noqa: E402
from jaxguard.integrations import accelerate as jg_acc  # noqa: E402
from jaxguard.integrations.hf import GuardedTrainer  # noqa: E402

LR, CLIP, SEQ, STEPS = 1e-3, 0.2, 32, 3


def tree_digest(d):
    """{relative path: SHA-256} of every file under d."""
    out = {}
    for here, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(here, f)
            out[os.path.relpath(p, d)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


class _Bytes(torch.utils.data.Dataset):
    x = byte_tokens(SEQ)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _trainer(out, data_seed, steps=STEPS, cls=GuardedTrainer):
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=8, learning_rate=LR, optim="adamw_torch",
        lr_scheduler_type="constant", max_grad_norm=CLIP, save_strategy="steps", save_steps=STEPS,
        report_to="none", use_cpu=True, seed=0, data_seed=data_seed, dataloader_num_workers=0, disable_tqdm=True)
    return cls(model=tiny_gpt2(SEQ), args=args, train_dataset=_Bytes())


class _Disk:
    """A fault in the real write path: the optimizer file's write raises ENOSPC."""

    def __init__(self, monkeypatch):
        real = torch_compat.save

        def full(path, *a, **kw):
            raise OSError(28, "No space left on device", str(path))
        monkeypatch.setattr(torch_compat, "save", full)
        self.real = real


def _stop_between_renames(monkeypatch):
    """Stop the commit after it moved the previous directory aside (what a kill there leaves)."""
    real = os.rename

    def rename(src, dst):
        real(src, dst)
        if str(dst).endswith(storage.OLD_SUFFIX):
            raise KeyboardInterrupt("stopped between the renames")
    monkeypatch.setattr(storage.os, "rename", rename)


def test_hf_failed_resave_keeps_the_previous_checkpoint_bit_for_bit(tmp_path, monkeypatch):
    _trainer(tmp_path, 0).train()
    ck = tmp_path / f"checkpoint-{STEPS}"
    before = tree_digest(ck)
    assert "optimizer.jg" in before and "model.safetensors" in before
    _Disk(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        _trainer(tmp_path, 1).train()
    assert tree_digest(ck) == before
    assert sorted(os.listdir(tmp_path)) == [f"checkpoint-{STEPS}"], os.listdir(tmp_path)   # no stage left


def test_hf_stop_while_publishing_is_undone_by_the_next_train(tmp_path, monkeypatch, caplog):
    _trainer(tmp_path, 0).train()
    ck = tmp_path / f"checkpoint-{STEPS}"
    before = tree_digest(ck)
    with monkeypatch.context() as m:
        _stop_between_renames(m)
        with pytest.raises(KeyboardInterrupt):
            _trainer(tmp_path, 1).train()
    assert not ck.exists()                         # what a kill there leaves: the previous one aside
    assert transformers.trainer_utils.get_last_checkpoint(str(tmp_path)) is None   # and nothing it would resume
    tr = _trainer(tmp_path, 0, steps=STEPS + 1)
    with caplog.at_level("WARNING", logger="jaxguard.integrations.hf"):
        tr.train(resume_from_checkpoint=True)
    assert "restored" in caplog.text
    after = tree_digest(ck)
    assert after == before, {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert tr.state.global_step == STEPS + 1
    hidden = [n for n in os.listdir(tmp_path) if n.startswith(".")]
    # the stopped save's stage is named, not removed: it could be another job's save in progress
    assert len(hidden) == 1 and hidden[0].endswith(storage.STAGING_SUFFIX), hidden
    assert f"left {tmp_path / hidden[0]}" in caplog.text


def test_hf_resave_replaces_the_whole_directory(tmp_path):
    """A second, successful save of the same step holds only the second run's files."""
    _trainer(tmp_path, 0).train()
    ck = tmp_path / f"checkpoint-{STEPS}"
    first = tree_digest(ck)
    (ck / "stale-extra-file").write_bytes(b"x")
    _trainer(tmp_path, 1).train()
    second = tree_digest(ck)
    assert set(second) == set(first)
    assert second["model.safetensors"] != first["model.safetensors"]
    assert second["optimizer.jg"] != first["optimizer.jg"]


def test_a_stage_older_than_an_hour_is_removed_a_younger_one_named(tmp_path):
    final = tmp_path / "ck"
    final.mkdir()
    young, stale = (storage.staging_path(str(final), storage.new_token()) for _ in range(2))
    for p in (young, stale):
        os.makedirs(p)
        open(os.path.join(p, "f"), "wb").close()
    t = os.stat(stale).st_mtime - 2 * 3600
    os.utime(os.path.join(stale, "f"), (t, t))
    os.utime(stale, (t, t))
    said = storage.recover_directories(str(tmp_path))
    assert os.path.isdir(young) and not os.path.exists(stale), said
    assert any(s.startswith(f"left {young}") for s in said) and any(s.startswith(f"removed {stale}") for s in said)


def test_two_jobs_publishing_one_directory_leave_one_whole_checkpoint(tmp_path, monkeypatch):
    """Job A moved the previous directory aside; job B published before A's second rename:
    B's checkpoint stands, whole, A's commit fails, and the next recovery removes the aside copy."""
    final = str(tmp_path / "ck")
    os.makedirs(final)
    open(os.path.join(final, "prev"), "w").write("previous")
    stages = {}
    for job in "AB":
        tok = storage.new_token()
        stages[job] = (storage.staging_path(final, tok), tok)
        os.makedirs(stages[job][0])
        open(os.path.join(stages[job][0], "who"), "w").write(job)
    real = os.rename

    def rename(src, dst):
        real(src, dst)
        if str(dst).endswith(storage.OLD_SUFFIX) and not rename.done:   # A between its renames: B commits
            rename.done = True
            storage.commit_directory(*stages["B"][:1], final, stages["B"][1])
    rename.done = False
    monkeypatch.setattr(storage.os, "rename", rename)
    with pytest.raises(OSError):
        storage.commit_directory(stages["A"][0], final, stages["A"][1])
    monkeypatch.undo()
    assert open(os.path.join(final, "who")).read() == "B" and sorted(os.listdir(final)) == ["who"]
    said = storage.recover_directory(final)
    assert any("removed" in s and storage.OLD_SUFFIX in s for s in said), said
    assert sorted(n for n in os.listdir(tmp_path) if not n.endswith(storage.STAGING_SUFFIX)) == ["ck"]


def test_hf_resume_from_a_directory_without_optimizer_state_is_refused(tmp_path):
    """What the Trainer's in-place save leaves when killed after the weights: the Trainer
    itself would resume from it with Adam restarted from zero, without a word."""
    _trainer(tmp_path, 0).train()
    ck = tmp_path / f"checkpoint-{STEPS}"
    (ck / "optimizer.jg").unlink()
    tr = _trainer(tmp_path, 0, steps=STEPS + 1)
    with pytest.raises(CheckpointError, match="holds no optimizer state") as e:
        tr.train(resume_from_checkpoint=str(ck))
    assert "\n" not in str(e.value)


def _acc_state(seed, steps=STEPS):
    model = tiny_gpt2(SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False, fused=False)
    acc = accelerate.Accelerator(cpu=True)
    model, opt = acc.prepare(model, opt)
    x = byte_tokens(SEQ)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        b = x[torch.randperm(len(x), generator=g)[:8]]
        acc.backward(model(input_ids=b, labels=b).loss)
        acc.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    return acc, model, opt


def test_accelerate_failed_resave_keeps_the_previous_directory_bit_for_bit(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    acc, _, _ = _acc_state(0)
    assert jg_acc.save_state(acc, str(d)) == str(d)
    before = tree_digest(d)
    assert "optimizer.jg" in before and "model.safetensors" in before
    acc, _, _ = _acc_state(1)
    _Disk(monkeypatch)
    with pytest.raises(OSError, match="No space left"):
        jg_acc.save_state(acc, str(d))
    assert tree_digest(d) == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert acc._optimizers                         # handed back to the accelerator


def test_accelerate_stop_while_publishing_is_undone_by_load_state(tmp_path, monkeypatch):
    d = tmp_path / "ck"
    acc, _, _ = _acc_state(0)
    jg_acc.save_state(acc, str(d))
    before = tree_digest(d)
    acc, _, _ = _acc_state(1)
    with monkeypatch.context() as m:
        _stop_between_renames(m)
        with pytest.raises(KeyboardInterrupt):
            jg_acc.save_state(acc, str(d))
    assert not d.exists()
    acc, model, opt = _acc_state(2, steps=0)
    jg_acc.load_state(acc, str(d))
    assert tree_digest(d) == before
    assert sorted(os.listdir(tmp_path)) == ["ck"]   # the interrupted call removed its own stage
    assert opt.state_dict()["state"]              # the Adam state of the first save is loaded


def test_hf_rotation_and_best_checkpoint_name_the_published_directories(tmp_path):
    """The Trainer's save_total_limit rotation and best-model bookkeeping see checkpoint-N/, not the stage."""
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, learning_rate=LR, optim="adamw_torch",
        lr_scheduler_type="constant", max_grad_norm=CLIP, save_strategy="steps", save_steps=1, save_total_limit=1,
        eval_strategy="steps", eval_steps=1, metric_for_best_model="loss", load_best_model_at_end=True,
        report_to="none", use_cpu=True, seed=0, dataloader_num_workers=0, disable_tqdm=True)
    tr = GuardedTrainer(model=tiny_gpt2(SEQ), args=args, train_dataset=_Bytes(),
                         eval_dataset=torch.utils.data.Subset(_Bytes(), range(16)))
    tr.train()
    names = sorted(os.listdir(tmp_path))
    assert not [n for n in names if n.startswith(".")], names
    best = tr.state.best_model_checkpoint
    assert os.path.dirname(best) == str(tmp_path) and os.path.basename(best) in names, (best, names)
    assert len([n for n in names if n.startswith("checkpoint-")]) <= 2, names   # the limit, plus the best kept
    import json
    saved = json.load(open(tmp_path / f"checkpoint-{STEPS}" / "trainer_state.json"))
    assert saved["best_model_checkpoint"] is None or ".jaxguard" not in saved["best_model_checkpoint"], saved
