"""Helpers shared by the test modules (the numcodecs `tests/common.py` pattern).

The trainer integration tests (Hugging Face, accelerate, Lightning) all check the same
three things after a resume from a guarded checkpoint: the first update is within
``tau * lr`` of the uncompressed resume's, the step did happen, and the next losses stay
within the run-to-run noise of an uncompressed resume.  The checks live here once.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import shutil
import textwrap

import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with `n` torch intra-op threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Autouse in a module that imports it: tiny models on a shared machine, where more
    threads only add contention (2 s/step -> 0.07 s/step measured on 2 cores)."""
    with torch_threads(1):
        yield


def adam_checkpoint(path, dims, *, steps: int, batch: int):
    """A torch checkpoint ``{"model", "optimizer"}`` of an MLP of `dims` (Linear layers,
    seed 0) after `steps` steps of `torch.optim.Adam` (lr 1e-3) on random inputs, saved at
    `path`; returns the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:])))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(batch, dims[0])).square().sum().backward()
        opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return model


def adam_run(dims, *, steps: int, batch: int, seed: int = 0):
    """An MLP of `dims` (Linear layers, Tanh between, seed `seed`) and a `torch.optim.AdamW`
    over its named parameters after `steps` steps on random inputs: ``(model, optimizer)``."""
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:])]
    model = torch.nn.Sequential(*[m for lin in layers for m in (lin, torch.nn.Tanh())][:-1])
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(batch, dims[0])).pow(2).mean().backward()
        opt.step()
    return model, opt


class ByteDataset(torch.utils.data.Dataset):
    """Causal-LM rows ``{"input_ids", "labels"}`` of `byte_tokens` (the first `rows`)."""

    def __init__(self, seq: int, rows: int | None = None):
        self.x = byte_tokens(seq)[:rows]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def run_probe(code: str, *argv, env=None) -> dict:
    """Run `code` in a fresh Python process with `argv` (a CLI verb starts jax's backend and
    changes process settings once a process) and return the JSON object its last output
    line prints; a failed process fails the test with its stderr's tail."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-c", code, *map(str, argv)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def byte_tokens(seq: int) -> torch.Tensor:
    """[rows, seq] int64 token ids: the bytes of standard-library source (no download)."""
    text = "".join(inspect.getsource(m) for m in (json.decoder, textwrap, shutil)).encode()
    t = torch.tensor(list(text), dtype=torch.long)
    return t[: len(t) // seq * seq].view(-1, seq)


def tiny_gpt2(seq: int):
    """A 2-layer GPT-2 over the 256 byte values, built from a config, dropout off, seed 0."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=seq,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def assert_first_update_within_tau(guarded: dict, plain: dict, before: dict, *, tau: float, lr: float) -> float:
    """The first update after a guarded resume is within ``tau * lr`` of the plain resume's,
    coordinate by coordinate, and that update moved the parameters (a zero gap from a
    skipped step would pass vacuously).

    Args are {name: tensor}: the parameters after that step in both resumes, and before it.
    Returns the worst gap in lr units."""
    worst = max(float((guarded[k].double() - plain[k].double()).abs().max()) for k in guarded)
    print(f"first update after resume: max |p_guarded - p_plain| = {worst / lr:.4g} lr (tau {tau})")
    assert worst <= tau * lr
    assert max(float((plain[k] - before[k]).abs().max()) for k in plain) > 10 * tau * lr  # the step happened
    return worst / lr


def assert_losses_within_noise(guarded: list, plain: list, noise: list, n: int) -> None:
    """The mean |L_guarded - L_plain| over the `n` steps after the resume is at most the mean
    |L_noise - L_plain|, where `noise` is an uncompressed resume with another data order."""
    assert len(guarded) == len(plain) == len(noise) == n
    dev = sum(abs(a - b) for a, b in zip(guarded, plain)) / n
    spread = sum(abs(a - b) for a, b in zip(noise, plain)) / n
    print(f"next {n} losses: guarded vs plain {dev:.3g}, run-to-run noise {spread:.3g}")
    assert spread > 0, "the data order did not change the resumed run; the noise measurement is void"
    assert dev <= spread


def byte_transformer_round_trip(tmp_path, *, seed: int, steps: int, lr: float, weight_decay: float):
    """A small ByteTransformer trained `steps` real AdamW steps, compressed with the CLI's
    path and restored: ``(summary, moments entries' stats, the real torch audit)``."""
    import torch_compat
    from torch_compat import models
    torch.manual_seed(seed)
    model = models.ByteTransformer(d=32, layers=1, heads=2, ctx=64)
    sample = models.text_batches(seed)
    opt = torch.optim.AdamW(model.named_parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    for _ in range(steps):
        opt.zero_grad()
        models.loss_fn(model, sample(True)).backward()
        opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    out = tmp_path / "c.jg"
    summary = torch_compat.state.compress_checkpoint_to(out, ckpt)
    restored, header = torch_compat.restore_tree(out)
    stats = [e["stats"] for e in header["entries"] if e["kind"] == "moments"]
    return summary, stats, torch_compat.audit(ckpt, restored)


def container_canon(data):
    """A container as (its entries without their encode timings, decoded SHA-256, payload):
    what must match between two saves of the same state (``encode_seconds`` is wall time)."""
    import json
    from jaxguard.format import reader
    header, payload = reader.parse(data)

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "encode_seconds"}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return json.dumps(strip(header["entries"]), sort_keys=True), header["decoded_sha256"], bytes(payload)
