"""jaxguard.integrations.accelerate: a real accelerate.Accelerator loop training a 2-layer
GPT-2 (from a config, no download) on standard-library bytes; at step N the same live state
is saved with accelerator.save_state (plain) and with the guarded save_state; both are
resumed into fresh accelerators and trained on.

Tolerances (reason):
  first update    |p_guarded - p_plain| <= tau * lr per coordinate: the guarantee itself
                  (accelerator.clip_grad_norm_(params, C) makes every |g| <= C).
  50-step losses  mean |L_guarded - L_plain| <= mean |L_plain(batch order 2) - L_plain|: within the
                  run-to-run noise of an uncompressed resume (same resume, another batch order).
  size            optimizer.jg <= 32% of optimizer.bin (the issue's acceptance figure).
"""
from __future__ import annotations

import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
from helpers import assert_first_update_within_tau, assert_losses_within_noise, byte_tokens, tiny_gpt2  # noqa: E402
from helpers import one_torch_thread  # noqa: E402,F401 - an autouse fixture

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

from jaxguard.integrations import accelerate as jg_acc  # noqa: E402

TAU, CLIP, LR = 0.01, 0.2, 1e-3
N, NEXT, SEQ, BATCH = 30, 50, 32, 8


def _batches(seed, n):
    x = byte_tokens(SEQ)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    return [x[order[i * BATCH:(i + 1) * BATCH]] for i in range(n)]


def _setup():
    model = tiny_gpt2(SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False, fused=False)
    acc = accelerate.Accelerator(cpu=True)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _steps(acc, model, opt, batches, first=None):
    losses = []
    for i, x in enumerate(batches):
        loss = model(input_ids=x, labels=x).loss
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if i == 0 and first is not None:
            first.update({k: p.detach().clone() for k, p in model.named_parameters()})
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("accelerate")
    acc, model, opt = _setup()
    _steps(acc, model, opt, _batches(0, N))
    plain = acc.save_state(str(root / "plain"))
    guarded = jg_acc.save_state(acc, str(root / "guarded"))
    p0 = {k: p.detach().clone() for k, p in model.named_parameters()}
    out = {"plain_dir": root / "plain", "guarded_dir": root / "guarded", "p0": p0, "plain_ret": plain,
           "guarded_ret": guarded}
    for name, d, load, seed in (("guarded", guarded, jg_acc.load_state, 1), ("plain", plain, None, 1),
                                ("noise", plain, None, 2)):
        acc, model, opt = _setup()
        (load or (lambda a, p: a.load_state(p)))(acc, d)
        first = {}
        out[name] = (first, _steps(acc, model, opt, _batches(seed, NEXT), first))
    return out


def test_guarded_directory_holds_optimizer_jg_not_bin(runs):
    g = runs["guarded_dir"]
    assert (g / "optimizer.jg").is_file() and not (g / "optimizer.bin").exists()
    assert (g / "model.safetensors").is_file()
    jg = (g / "optimizer.jg").stat().st_size
    bin_ = (runs["plain_dir"] / "optimizer.bin").stat().st_size
    print(f"optimizer.jg {jg} B, optimizer.bin {bin_} B, ratio {jg / bin_:.3f}")
    assert jg <= 0.32 * bin_


def test_first_update_after_resume_within_tau_lr(runs):
    assert_first_update_within_tau(runs["guarded"][0], runs["plain"][0], runs["p0"], tau=TAU, lr=LR)


def test_next_50_losses_within_run_to_run_noise(runs):
    assert_losses_within_noise(*(runs[k][1] for k in ("guarded", "plain", "noise")), NEXT)


def test_optimizers_restored_after_save_and_load(runs, tmp_path):
    acc, model, opt = _setup()
    _steps(acc, model, opt, _batches(0, 2))
    jg_acc.save_state(acc, str(tmp_path / "s"))
    assert acc._optimizers == [opt]
    jg_acc.load_state(acc, str(tmp_path / "s"))
    assert acc._optimizers == [opt]
    assert float(opt.state_dict()["state"][0]["step"]) == 2
