"""Small models trained here, on data that ships with the machine, for the demo, tests
and benchmarks: a byte-level transformer on the Python standard library's own source
text, and a residual CNN with BatchNorm on scikit-learn's 8x8 digits."""
from __future__ import annotations

__all__ = ["ByteTransformer", "text_batches", "digits_batches", "loss_fn", "make", "train", "next_gradients",
           "odd_values_checkpoint"]

import copy
import functools
import os
import sysconfig

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 4_000_000) -> np.ndarray:
    """Bytes of the standard library's .py files, in sorted path order (deterministic).

    Args:
      max_bytes: stop after this many bytes.

    Returns:
      A uint8 numpy array of at most `max_bytes` bytes (site-packages and tests left out).
    """
    root = sysconfig.get_paths()["stdlib"]
    out, total = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "__pycache__"))
        for f in sorted(filenames):
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    b = fh.read()
                out.append(b)
                total += len(b)
                if total >= max_bytes:
                    return np.frombuffer(b"".join(out)[:max_bytes], np.uint8)
    return np.frombuffer(b"".join(out), np.uint8)


class ByteTransformer(nn.Module):
    """A small causal byte-level transformer (pre-norm encoder layers, causal mask).

    Args:
      d: model width.
      layers: encoder layers.
      heads: attention heads.
      ctx: context length (positions).
    """
    def __init__(self, d=64, layers=2, heads=4, ctx=64):
        super().__init__()
        self.ctx = ctx
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(ctx, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256)
        self.register_buffer("mask", torch.triu(torch.full((ctx, ctx), float("-inf")), 1), persistent=False)

    def forward(self, x):
        """Next-byte logits.

        Args:
          x: int64 byte ids, shape [batch, t] with t <= ctx.

        Returns:
          float32 logits, shape [batch, t, 256].
        """
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        h = self.blocks(h, mask=self.mask[: x.shape[1], : x.shape[1]], is_causal=True)
        return self.head(self.norm(h))


class ResidualCNN(nn.Module):
    """A small residual CNN with batch norm for 8x8 digit images (one residual block).

    Args:
      width: channels.
      classes: output classes.
    """
    def __init__(self, width=16, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(1, width, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(width)
        self.c1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.c2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.fc = nn.Linear(width, classes)

    def forward(self, x):
        """Class logits.

        Args:
          x: float32 images, shape [batch, 1, H, W].

        Returns:
          float32 logits, shape [batch, classes].
        """
        h = F.relu(self.bn0(self.stem(x)))
        h = F.relu(h + self.bn2(self.c2(F.relu(self.bn1(self.c1(h))))))
        return self.fc(h.mean(dim=(2, 3)))


def text_batches(seed, batch=16, ctx=64, corpus_bytes=2_000_000):
    """Random next-byte windows of the standard-library corpus (95% train, 5% held out).

    Args:
      seed: the sampler's torch generator seed.
      batch: windows per batch.
      ctx: window length; ``y`` is ``x`` shifted by one byte.
      corpus_bytes: corpus size (`stdlib_corpus`).

    Returns:
      ``sample(train=True) -> (x, y)``: a function drawing one batch from the train split
      (or the held-out split with ``train=False``), from a torch generator seeded by `seed`.
    """
    data = torch.from_numpy(stdlib_corpus(corpus_bytes).astype(np.int64))
    gen = torch.Generator().manual_seed(seed)
    split = int(0.95 * len(data))

    def sample(train=True):
        lo, hi = (0, split - ctx - 1) if train else (split, len(data) - ctx - 1)
        i = torch.randint(lo, hi, (batch,), generator=gen)
        x = torch.stack([data[j:j + ctx] for j in i.tolist()])
        y = torch.stack([data[j + 1:j + ctx + 1] for j in i.tolist()])
        return x, y
    return sample


def digits_batches(seed, batch=64):
    """Random batches of scikit-learn's 8x8 digits (90% train, 10% held out), scaled to [0, 1].

    Args:
      seed: the sampler's torch generator seed.
      batch: images per batch.

    Returns:
      ``sample(train=True) -> (x, y)``: a function drawing one batch from the train split
      (or the held-out split with ``train=False``), from a torch generator seeded by `seed`.
    """
    from sklearn.datasets import load_digits
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    gen = torch.Generator().manual_seed(seed)
    split = int(0.9 * len(x))

    def sample(train=True):
        lo, hi = (0, split) if train else (split, len(x))
        i = torch.randint(lo, hi, (batch,), generator=gen)
        return x[i], y[i]
    return sample


def loss_fn(model, batch):
    """Mean cross-entropy of `model` on one batch (all positions for the transformer).

    Args:
      model: a `ByteTransformer` or `ResidualCNN`.
      batch: ``(x, y)`` from the model's sampler.

    Returns:
      A scalar float32 tensor.
    """
    x, y = batch
    out = model(x)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def make(kind, seed):
    """A fresh model of `kind` (torch seeded by `seed`) and its batch sampler.

    Args:
      kind: ``"transformer"`` (`ByteTransformer` on `text_batches`) or ``"cnn"``
        (`ResidualCNN` on `digits_batches`).
      seed: the torch and sampler seed.

    Returns:
      ``(model, sample)``.

    Raises:
      ValueError: an unknown kind.
    """
    torch.manual_seed(seed)
    if kind == "transformer":
        return ByteTransformer(), text_batches(seed)
    if kind == "cnn":
        return ResidualCNN(), digits_batches(seed)
    raise ValueError(f"model kind {kind!r}; use 'transformer' or 'cnn'")


def train(kind="transformer", seed=0, steps=300, fractions=(0.1, 0.5, 1.0), lr=1e-3, weight_decay=0.0,
          adamw=False, progress=None):
    """Train with torch Adam(foreach=False); return {fraction: CKPT dict} and the model.

    Runs torch on one thread: these models are too small to gain from two, and on a
    shared 2-core machine intra-op threads fighting other work cost 20x (measured).

    Args:
      kind: ``"transformer"`` or ``"cnn"`` (`make`).
      seed: the model and sampler seed.
      steps: optimizer steps.
      fractions: where to checkpoint, as fractions of `steps`.
      lr: the learning rate.
      weight_decay: the weight decay.
      adamw: use ``torch.optim.AdamW`` instead of ``Adam``.
      progress: optional ``progress(step, loss)`` called after every step.

    Returns:
      ``(ckpts, model, sample)``: ``{fraction: {"model", "optimizer", "step", "kind",
      "seed"}}`` (deep copies of the state_dicts), the trained model and its sampler.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(kind, seed, steps, fractions, lr, weight_decay, adamw, progress)
    finally:
        torch.set_num_threads(threads)


def _train(kind, seed, steps, fractions, lr, weight_decay, adamw, progress):
    model, sample = make(kind, seed)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    opt = cls(model.named_parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    marks = {max(1, int(round(f * steps))): f for f in fractions}
    ckpts = {}
    for step in range(1, steps + 1):
        model.train()
        opt.zero_grad()
        loss = loss_fn(model, sample(True))
        loss.backward()
        opt.step()
        if progress is not None:
            progress(step, loss.item())
        if step in marks:
            ckpts[marks[step]] = {"model": copy.deepcopy(model.state_dict()),
                                  "optimizer": copy.deepcopy(opt.state_dict()),
                                  "step": step, "kind": kind, "seed": seed}
    return ckpts, model, sample


def next_gradients(kind, ckpt, sample):
    """The real next-batch gradient at a checkpoint: {param name: tensor}.

    Args:
      kind: the model kind the checkpoint was trained with.
      ckpt: a checkpoint dict from `train`.
      sample: the sampler `train` returned (draws the next training batch).

    Returns:
      ``{name: gradient tensor}`` for every parameter that received a gradient.
    """
    model, _ = make(kind, 0)
    model.load_state_dict(ckpt["model"])
    model.train()
    model.zero_grad()
    loss_fn(model, sample(True)).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def odd_values_checkpoint():
    """A tiny Adam CKPT (Linear 20-30-3, 3 steps) with NaN, +-Inf, -0.0 in exp_avg and
    NaN, +Inf, negative (incl. a negative subnormal and -Inf) in exp_avg_sq: the seed of
    the reliability tests and the reader fuzzer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 30), nn.Linear(30, 3, bias=False))
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 20)).pow(2).sum().backward()
        opt.step()
    sd = opt.state_dict()
    s0 = sd["state"][0]
    s0["exp_avg"].view(-1)[:4] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    s0["exp_avg_sq"].view(-1)[4:9] = torch.tensor([float("nan"), float("inf"), -1e-3, -1e-45, -float("inf")])
    return {"model": model.state_dict(), "optimizer": sd}
