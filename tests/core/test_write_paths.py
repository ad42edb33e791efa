"""The one write path (`jaxguard.writer`): every adapter writes the same files as before it
(payload and decoded SHA-256 of the main before the change, tests/golden/write_paths.json)
and every adapter refuses certified values that the numpy reader does not decode to:
a one-ulp disagreement injected into what the guard (or the jitted program) certified
makes the save raise and leaves nothing behind."""
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch", reason="the torch write paths need torch")
pytest.importorskip("orbax.checkpoint", reason="the orbax write path needs orbax-checkpoint")

import write_paths as W  # noqa: E402
from jaxguard.core import guard, jit_encode  # noqa: E402
from jaxguard.errors import JaxguardError  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "write_paths.json")


def test_every_path_writes_the_files_it_wrote_before(tmp_path):
    with open(GOLDEN) as fh:
        want = json.load(fh)
    got = W.all_hashes(str(tmp_path))
    assert sorted(got) == sorted(want)
    diff = {k: (got[k], want[k]) for k in want if got[k] != want[k]}
    assert not diff, diff


def _one_ulp_off(x):
    x = np.array(x, np.float32)
    x[0] = np.nextafter(x[0], np.float32(np.inf))
    return x


@pytest.fixture
def tampered(monkeypatch):
    """The guard's certified values, one ulp off at coordinate 0 (always in the sample)."""
    encode_many, encode_v_only = guard.encode_many, guard.encode_v_only

    def many(items, **kw):
        encs = encode_many(items, **kw)
        assert kw.get("keep_decoded"), "a writer asked the guard for codes without their certified values"
        for e in encs:
            e.decoded = (_one_ulp_off(e.decoded[0]), e.decoded[1])
        return encs

    def v_only(*a, **kw):
        e = encode_v_only(*a, **kw)
        e.decoded = (e.decoded[0], _one_ulp_off(e.decoded[1]))
        return e

    monkeypatch.setattr(guard, "encode_many", many)
    monkeypatch.setattr(guard, "encode_v_only", v_only)
    traced = jit_encode.encode_traced

    def jit_traced(*a, **kw):
        je = traced(*a, **kw)
        assert "sample_m" in je.arrays, "the jitted hook did not return what it certified"
        sm = je.arrays["sample_m"]
        je.arrays["sample_m"] = sm.at[0].set(jnp.nextafter(sm[0], jnp.float32(jnp.inf)))
        return je

    monkeypatch.setattr(jit_encode, "encode_traced", jit_traced)


def _refused(fn, *args):
    with pytest.raises(BaseException) as info:   # DCP raises CheckpointException (a BaseException)
        fn(*args)
    chain, exc = [], info.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    msg = " ".join(str(e) for e in chain)
    assert "certified" in msg and "reader decodes" in msg, msg
    assert any(isinstance(e, JaxguardError) for e in chain) or "ContainerError" in msg, msg


# path -> (the writer, what must not exist afterwards: the file, or the commit marker of a directory)
REFUSALS = {
    "optax-file": (W.write_optax_file, "optax-log8-rel.jg"),
    "sharded": (W.write_sharded, "sharded-log8-rel/manifest.json"),
    "orbax": (W.write_orbax, "orbax-log8-rel/1"),
    "jit-hook": (W.write_jit_hook, "jit-log8-rel/manifest.json"),
    "torch-file": (W.write_torch_file, "torch-log8-rel.jg"),
    "torch-compress": (W.write_torch_compress, "compress-log8-rel.jg"),
    "dcp": (W.write_dcp, "dcp-log8-rel/.metadata"),
}


@pytest.mark.parametrize("codec", ["log8-rel", "log8-rel-zstd"])
@pytest.mark.parametrize("path", sorted(REFUSALS) + ["lightning"])
def test_every_path_refuses_values_the_reader_does_not_restore(tmp_path, tampered, path, codec):
    if path == "lightning":       # to_bytes: nothing reaches a file
        _refused(W.write_lightning, codec)
        return
    write, marker = REFUSALS[path]
    _refused(write, str(tmp_path), codec)
    marker = marker.replace("log8-rel", codec)
    assert not (tmp_path / marker).exists(), sorted(p.name for p in tmp_path.rglob("*"))


def test_every_path_writes_log8_rel_zstd_that_decodes_like_log8_rel(tmp_path):
    """log8-rel-zstd on every write path (the jit hook's entropy stage runs on the host at
    write time): each container verifies, holds log8-rel-zstd entries in fewer bytes and
    decodes (numpy reader, torch decoder) to exactly the values log8-rel's decode to."""
    from jaxguard.format import reader
    from torch_compat import codes_torch
    zstd = "log8-rel-zstd"
    (tmp_path / "base").mkdir()
    (tmp_path / "zstd").mkdir()
    base = W.all_hashes(str(tmp_path / "base"), codecs=("log8-rel",))
    got = W.all_hashes(str(tmp_path / "zstd"), codecs=(zstd,))
    got["jit-hook/log8-rel"] = sorted(W._file(f) for f in W.glob.glob(W.write_jit_hook(str(tmp_path / "zstd"), zstd)
                                                                        + "/*.jaxguard"))
    assert sorted(k.replace(zstd, "log8-rel") for k in got) == sorted(base)
    for key, hashes in got.items():
        want = base[key.replace(zstd, "log8-rel")]
        flat = lambda h: sorted(x[1] for x in h) if isinstance(h[0], list) else [h[1]]   # noqa: E731
        assert flat(hashes) == flat(want), key        # the same decoded values, path by path
    blobs = [p.read_bytes() for p in (tmp_path / "zstd").rglob("*")     # all_hashes' own jit hook writes log8-rel
             if p.is_file() and "jit-log8-rel" not in p.parts]
    (tmp_path / "dcp").mkdir()
    blobs += W.dcp_containers(W.write_dcp(str(tmp_path / "dcp"), zstd)[1]) + [W.write_lightning(zstd)]
    blobs = [b for b in blobs if bytes(b[:8]) == b"JAXGUARD"]
    assert len(blobs) >= 11        # optax, sharded, orbax, jit hook, torch x2, DCP (one per tensor), lightning
    for f, data in enumerate(blobs):
        assert reader.verify_bytes(data)["ok"], f
        header, payload = reader.parse(data)
        moments = [e for e in header["entries"] if e["kind"] == "moments"]
        assert moments and all(e["codec"] == zstd for e in moments), f
        tables = reader.read_tables(header, payload)
        for e in moments:
            m, v = reader.read_moments(e, payload, tables)
            tm, tv = codes_torch.read_moments(e, payload, tables)
            assert np.array_equal(np.asarray(m, np.float32).view(np.uint32), tm.numpy().view(np.uint32))
            assert np.array_equal(np.asarray(v, np.float32).view(np.uint32), tv.numpy().view(np.uint32))


def test_bfloat16_mu_path_refuses_too(tmp_path, tampered):
    """optax mu_dtype=bfloat16: only nu is coded (encode_v_only); its certified v~ is checked."""
    import optax
    import jaxguard as jg
    params = {"w": jnp.linspace(-1, 1, 700, dtype=jnp.float32)}
    tx = optax.adam(1e-3, mu_dtype=jnp.bfloat16)
    st = tx.init(params)
    u, st = tx.update({"w": jnp.sin(params["w"]) * 0.1}, st, params)
    _refused(lambda: jg.save(str(tmp_path / "bf16.jg"), st, params, lr=1e-3))
    assert not (tmp_path / "bf16.jg").exists()


def test_torch_compress_writes_the_model_first_and_reads_back_equal(tmp_path):
    """A torch checkpoint's compress: the model's tensors lead the header and the payload
    (written while the moments after them are encoded), the optimizer's entries follow,
    header order = payload order, and the file restores to the checkpoint's values."""
    import torch
    import torch_compat
    from jaxguard.format import reader
    model, opt = W.torch_state()
    path = tmp_path / "c.jg"
    torch_compat.state.compress_checkpoint_to(path, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    header, payload = reader.parse(path.read_bytes())
    names = [e["name"] for e in header["entries"]]
    lead = len(model.state_dict())
    assert names[:lead] == [f"model/{k}" for k in model.state_dict()]
    assert all(n.startswith("optimizer/") for n in names[lead:])
    assert [e["kind"] for e in header["entries"]].index("moments") == lead
    starts = [e["offsets"][0] if e["kind"] == "raw" else min(r[0] for r in e["sections"].values())
              for e in header["entries"]]
    assert starts == sorted(starts)
    restored, _ = torch_compat.restore_tree(path)
    for k, t in model.state_dict().items():
        assert torch.equal(restored["model"][k], t), k


def test_the_encode_goes_on_behind_raws_the_writer_has_not_taken():
    """`prefetched(raws_held=True)`: raw entries cost nothing against `ahead`, so the
    producer passes every raw and goes on to the entries after them while the consumer
    still holds the first; counted (the default), it waits for the consumer."""
    import threading
    from jaxguard.format import container
    from jaxguard.writer import prefetched

    def entries(passed):
        for i in range(4):
            yield container.Raw(f"r{i}", np.zeros(1000, np.float32))
        passed.set()
        yield container.Raw("after", np.zeros(1, np.float32))

    for held in (True, False):
        passed = threading.Event()
        it = prefetched(entries(passed), ahead=10, raws_held=held)
        assert next(it).name == "r0"
        assert passed.wait(2 if held else 0.3) is held
        assert [e.name for e in it] == ["r1", "r2", "r3", "after"]


def test_a_full_disk_while_the_model_is_written_raises_one_line_and_leaves_the_old_file(small_disk):
    """The model's 2 MiB of parameters, written first while the moments are encoded, do not
    fit a 1 MiB disk: one line naming the error, the file that was there kept, no temporary
    file and no encode thread left behind."""
    small_tmpfs = small_disk("1m")
    import threading
    import torch
    import torch_compat
    from jaxguard.errors import ContainerError
    rng = np.random.default_rng(0)
    model = torch.nn.Linear(1024, 512)
    opt = torch.optim.Adam(model.named_parameters(), lr=W.LR, foreach=False)
    for p in model.parameters():
        m, v = W._moments(rng, tuple(p.shape), 5)
        opt.state[p] = {"step": torch.tensor(5.0), "exp_avg": torch.from_numpy(m), "exp_avg_sq": torch.from_numpy(v)}
    target = small_tmpfs / "c.jg"
    target.write_bytes(b"the previous checkpoint")
    with pytest.raises(ContainerError) as info:
        torch_compat.state.compress_checkpoint_to(target, {"model": model.state_dict(), "optimizer": opt.state_dict()})
    assert "No space left" in str(info.value) and "\n" not in str(info.value)
    assert [p.name for p in small_tmpfs.iterdir()] == ["c.jg"]
    assert target.read_bytes() == b"the previous checkpoint"
    # no encode or write thread is left (a program compiling for later saves may be)
    assert not [t.name for t in threading.enumerate()
                if t.name.startswith("jaxguard-") and not t.name.startswith("jaxguard-compile")]
