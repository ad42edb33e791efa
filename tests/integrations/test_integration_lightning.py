"""GuardedCheckpointIO: a real lightning.Trainer training an MLP LightningModule with
ModelCheckpoint on, resuming from the guarded .ckpt, compared with a resume from the
uncompressed .ckpt of an identical run (TorchCheckpointIO, Lightning's default).

Tolerances (reason):
  first update    |p_guarded - p_plain| <= tau * lr per coordinate: the guarantee itself
                  (gradient_clip_val = C, "norm" algorithm, makes every |g| <= C).
  50-step losses  mean |L_guarded - L_plain| <= mean |L_plain(shuffle seed 2) - L_plain|: within
                  the run-to-run noise of an uncompressed resume (two uncompressed resumes that
                  differ only in the data order).
  size            guarded optimizer bytes (payload of the optimizer_states entries) <= 32% of
                  torch.save(optimizer_states) (the issue's acceptance figure).
"""
from __future__ import annotations

import io

import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")
from helpers import assert_first_update_within_tau, assert_losses_within_noise, container_canon  # noqa: E402
from helpers import one_torch_thread  # noqa: E402,F401 - an autouse fixture

L = pytest.importorskip("lightning")

from jaxguard.format import container  # noqa: E402
from jaxguard.integrations.lightning import GuardedCheckpointIO  # noqa: E402

TAU, CLIP, LR = 0.01, 0.2, 1e-3
N, NEXT, DIM, HID = 30, 50, 16, 96


class MLP(L.LightningModule):
    def __init__(self, named=True):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, HID), torch.nn.Tanh(), torch.nn.Linear(HID, HID),
                                       torch.nn.Tanh(), torch.nn.Linear(HID, 1))
        self.named, self.losses, self.first = named, [], None

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.trainer.global_step >= N:
            self.losses.append(float(loss.detach()))
        return loss

    def on_train_batch_end(self, *a):
        if self.trainer.global_step == N + 1 and self.first is None:
            self.first = {k: p.detach().clone() for k, p in self.named_parameters()}

    def configure_optimizers(self):
        ps = self.named_parameters() if self.named else self.parameters()
        return torch.optim.AdamW(ps, lr=LR, weight_decay=0.01, foreach=False, fused=False)


def _data(seed):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, DIM, generator=g)
    y = torch.sin(x @ torch.randn(DIM, 1, generator=g)) + 0.1 * torch.randn(2048, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True,
                                       generator=torch.Generator().manual_seed(seed))


def _trainer(root, steps, plugins=(), ckpt=False):
    cbs = [L.pytorch.callbacks.ModelCheckpoint(dirpath=root, every_n_train_steps=N, save_top_k=-1,
                                               filename="{step}")] if ckpt else []
    return L.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, gradient_clip_val=CLIP, gradient_clip_algorithm="norm",
                     plugins=list(plugins), callbacks=cbs, enable_checkpointing=ckpt, default_root_dir=root)


def _fit(root, steps, ckpt_path=None, guarded=True, seed=0, save=False):
    L.seed_everything(0, verbose=False)
    model = MLP()
    tr = _trainer(root, steps, [GuardedCheckpointIO()] if guarded else [], ckpt=save)
    tr.fit(model, _data(seed), ckpt_path=ckpt_path)
    return model, tr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    _fit(root / "g", N, guarded=True, save=True)
    _fit(root / "p", N, guarded=False, save=True)
    g, p = root / "g" / f"step={N}.ckpt", root / "p" / f"step={N}.ckpt"
    out = {"gckpt": g, "pckpt": p}
    for name, path, guarded, seed in (("guarded", g, True, 0), ("plain", p, False, 0), ("noise", p, False, 2)):
        out[name], _ = _fit(root / f"r_{name}", N + NEXT, ckpt_path=str(path), guarded=guarded, seed=seed)
    return out


def test_checkpoint_is_a_container_and_weights_exact(runs):
    header, _, _ = container.read(runs["gckpt"])
    assert header["meta"]["source"] == "lightning"
    guarded = GuardedCheckpointIO().load_checkpoint(runs["gckpt"])
    plain = torch.load(runs["pckpt"], weights_only=False)
    assert plain["global_step"] == guarded["global_step"] == N
    for k, t in plain["state_dict"].items():  # the two runs are identical up to the checkpoint
        assert torch.equal(guarded["state_dict"][k], t), k


def test_optimizer_bytes_at_most_32_percent(runs):
    header, _, _ = container.read(runs["gckpt"])
    guarded = 0
    for e in header["entries"]:
        if e["name"].startswith("optimizer_states/"):
            spans = e["sections"].values() if e["kind"] == "moments" else [e["offsets"]]
            guarded += sum(b - a for a, b in spans)
    buf = io.BytesIO()
    torch.save(torch.load(runs["pckpt"], weights_only=False)["optimizer_states"], buf)
    print(f"optimizer bytes: guarded {guarded}, torch.save {buf.tell()}, ratio {guarded / buf.tell():.3f}")
    assert guarded <= 0.32 * buf.tell()


def test_first_update_after_resume_within_tau_lr(runs):
    p0 = torch.load(runs["pckpt"], weights_only=False)["state_dict"]
    assert_first_update_within_tau(runs["guarded"].first, runs["plain"].first, p0, tau=TAU, lr=LR)


def test_next_50_losses_within_run_to_run_noise(runs):
    assert_losses_within_noise(*(runs[k].losses for k in ("guarded", "plain", "noise")), NEXT)


def test_unnamed_optimizer_is_stored_exactly_with_one_warning(tmp_path):
    """An optimizer built from self.parameters() (no param_names; this MLP's moments do not
    name their weights by shape): the save is not lost, the optimizer is stored exactly and
    one warning line says why; the checkpoint loads back bit for bit."""
    import warnings
    from jaxguard.errors import JaxguardWarning
    L.seed_everything(0, verbose=False)
    tr = _trainer(tmp_path, 2, [GuardedCheckpointIO()])
    tr.fit(MLP(named=False), _data(0))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", JaxguardWarning)
        tr.save_checkpoint(tmp_path / "x.ckpt")
    msgs = [str(w.message) for w in seen if issubclass(w.category, JaxguardWarning)]
    assert len(msgs) == 1 and "6 of 6 parameters stored exactly" in msgs[0] and "named_parameters" in msgs[0], msgs
    back = GuardedCheckpointIO().load_checkpoint(tmp_path / "x.ckpt")
    sd = tr.optimizers[0].state_dict() if isinstance(tr.optimizers, list) else tr.optimizers.state_dict()
    for idx, st in sd["state"].items():
        for k, t in st.items():
            assert torch.equal(back["optimizer_states"][0]["state"][idx][k], t), (idx, k)


def test_remove_checkpoint(runs, tmp_path):
    io_ = GuardedCheckpointIO()
    path = tmp_path / "copy.ckpt"
    path.write_bytes(runs["gckpt"].read_bytes())
    io_.remove_checkpoint(path)
    assert not path.exists()
    with pytest.raises(FileNotFoundError):
        io_.load_checkpoint(path)


@pytest.mark.parametrize("lr_zero", [False, True], ids=["guarded", "lr0-uncompressed"])
def test_checkpoint_through_memory_url(runs, lr_zero):
    """A real Lightning checkpoint dict through an fsspec URL; at lr 0 (nothing to certify
    against) the plugin writes Lightning's own format, which load_checkpoint also reads."""
    ckpt = torch.load(runs["pckpt"], weights_only=False)
    if lr_zero:
        for g in ckpt["optimizer_states"][0]["param_groups"]:
            g["lr"] = 0.0
    io_ = GuardedCheckpointIO()
    url = f"memory://pl-{int(lr_zero)}/step={N}.ckpt"
    io_.save_checkpoint(ckpt, url)
    from jaxguard.format import storage
    assert (storage.read_bytes(url)[:8] == b"JAXGUARD") is (not lr_zero)
    back = io_.load_checkpoint(url)
    for k, t in ckpt["state_dict"].items():
        assert torch.equal(back["state_dict"][k], t), k
    st, st0 = back["optimizer_states"][0]["state"], ckpt["optimizer_states"][0]["state"]
    assert st.keys() == st0.keys()
    exact = all(torch.equal(st[i]["exp_avg_sq"], st0[i]["exp_avg_sq"]) for i in st0)
    assert exact is lr_zero  # guarded moments are coded, uncompressed ones exact
    assert back["global_step"] == ckpt["global_step"]


def test_async_checkpoint_io_saves_in_the_background_the_blocking_bytes(runs, tmp_path, monkeypatch):
    """Lightning's AsyncCheckpointIO(GuardedCheckpointIO()): the checkpoints of a real fit are
    those of the blocking plugin's identical run, and ``trainer.save_checkpoint`` returns before
    the guard runs (the guard is held until it returned; an encode inside the call times out)."""
    import threading
    from lightning.pytorch.plugins.io import AsyncCheckpointIO
    from jaxguard.core import guard
    L.seed_everything(0, verbose=False)
    model = MLP()
    tr = _trainer(tmp_path, N, [AsyncCheckpointIO(GuardedCheckpointIO())], ckpt=True)
    tr.fit(model, _data(0))
    assert container_canon((tmp_path / f"step={N}.ckpt").read_bytes()) == container_canon(runs["gckpt"].read_bytes())

    release, threads, encode_many = threading.Event(), [], guard.encode_many

    def held(items, **kw):
        threads.append(threading.get_ident())
        if not release.wait(60):
            raise AssertionError("the guard was never released: save_checkpoint waited for the encode")
        return encode_many(items, **kw)

    monkeypatch.setattr(guard, "encode_many", held)
    tr.save_checkpoint(tmp_path / "again.ckpt")
    assert not (tmp_path / "again.ckpt").exists() and threading.get_ident() not in threads
    release.set()
    tr.strategy.checkpoint_io.teardown()          # waits for the background save
    assert threads and container_canon((tmp_path / "again.ckpt").read_bytes()) == container_canon(runs["gckpt"].read_bytes())


@pytest.mark.parametrize("op_model,warns", [("torch-adamw-cuda-foreach", True), (None, False)],
                         ids=["certified-for-cuda-foreach", "certified-for-cpu"])
def test_resume_on_another_kernel_warns_once(tmp_path, op_model, warns):
    """A checkpoint certified for CUDA's foreach AdamW resumed by a real ``Trainer.fit`` on
    the CPU single-tensor kernel warns one line (what torch_compat.load says), once over
    the resumed steps; one certified for the CPU kernel resumes silently."""
    import warnings
    from jaxguard.errors import JaxguardWarning
    L.seed_everything(0, verbose=False)
    tr = _trainer(tmp_path / "a", 3, [GuardedCheckpointIO(op_model=op_model)])
    tr.fit(MLP(), _data(0))
    tr.save_checkpoint(tmp_path / "c.ckpt")
    header, _, _ = container.read(tmp_path / "c.ckpt", verify_decoded=False)
    assert header["op_model"] == (op_model or "torch-adamw")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        model, tr2 = _fit(tmp_path / "r", 6, ckpt_path=str(tmp_path / "c.ckpt"))
    assert tr2.global_step == 6
    ours = [str(w.message) for w in rec if issubclass(w.category, JaxguardWarning)]
    assert len(ours) == int(warns), ours
    if warns:
        assert "torch-adamw-cuda-foreach" in ours[0] and "resumes on cpu" in ours[0] and "\n" not in ours[0]
        assert "op_model='torch-adamw'" in ours[0]
