"""`jaxguard.format.torchzip.load`: torch.save's zip format read without torch.

`jaxguard compress` reads its checkpoint this way once the environment's Adam variant is
cached (`torch_compat.variant_cache.fast_record`), so that it never imports torch.  What it
returns must be what ``torch.load(weights_only=True)`` returns, tensor for tensor and bit for
bit, and the container compressed from it must be the one compressed from torch's tree; a
file it does not cover is left to torch (`Unsupported`), and nothing a pickle names outside
the plain-tensor allowlist is ever constructed.
"""
from __future__ import annotations

import collections
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import torch_compat
from jaxguard.core import programs
from jaxguard.format import torchzip
from jaxguard.format import reader
from torch_compat import variant_cache

ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}
VARIANT = {"matched": True, "detail": "fixed for the comparison"}


def same_tree(ours, theirs, path="") -> int:
    """Assert `ours` (torchzip.load) is `theirs` (torch.load); return the tensors compared."""
    if isinstance(theirs, torch.Tensor):
        assert isinstance(ours, torchzip.FileTensor), path
        assert ours.shape == tuple(theirs.shape) and ours.dtype == str(theirs.dtype), (path, ours.dtype, theirs.dtype)
        t = theirs.detach().contiguous()
        if t.dtype == torch.bfloat16:
            t = t.view(torch.int16)
        got = ours.contiguous_array()
        assert got.shape == tuple(theirs.shape) and got.tobytes() == t.numpy().tobytes(), path
        return 1
    assert type(ours) is type(theirs), (path, type(ours), type(theirs))
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), path
        return sum(same_tree(ours[k], theirs[k], f"{path}/{k}") for k in theirs)
    if isinstance(theirs, (list, tuple)):
        assert len(ours) == len(theirs), path
        return sum(same_tree(a, b, f"{path}/{i}") for i, (a, b) in enumerate(zip(ours, theirs)))
    assert ours == theirs or (ours != ours and theirs != theirs), path
    return 0


class Opaque:
    """A class of this module: a pickle naming it is refused by torch's weights_only loader."""


def trained(decoupled=False, tie=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(11, 6), torch.nn.Linear(6, 300), torch.nn.Linear(300, 11))
    if tie:   # a tied weight: one Parameter under two state_dict keys, as GPT-2's wte / lm_head
        model[2] = torch.nn.Linear(300, 11)
        model[2].weight = torch.nn.Parameter(torch.randn(11, 300) * 0.1)
        model.add_module("head", torch.nn.Linear(300, 11, bias=False))
        model.head.weight = model[2].weight
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    opt = cls(model.named_parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        out = model[2](model[1](model[0](torch.randint(0, 11, (4,)))))
        out.square().sum().backward()
        opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict()}


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """A real checkpoint with every kind of value torch.save writes for plain tensors."""
    ckpt = trained(decoupled=True)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    ckpt.update({
        "epoch": 7, "big": 2**70, "nan": float("nan"), "inf": -float("inf"), "s": "é\u2603", "none": None,
        "flag": True, "t": (1, [2, (3,)], {}), "nested": {"a": {"b": [1.5, "x"]}, 4: "int key"},
        "od": collections.OrderedDict([("x", torch.tensor([1.0]))]),
        "bf16": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16),
        "i64": torch.arange(5), "i8": torch.tensor([-1, 2], dtype=torch.int8),
        "u8": torch.tensor([255], dtype=torch.uint8), "b": torch.tensor([True, False]),
        "f64": torch.tensor([1e-300]), "f16": torch.tensor([1.5], dtype=torch.float16),
        "i32": torch.tensor([[1], [2]], dtype=torch.int32), "i16": torch.tensor([3], dtype=torch.int16),
        "zero_d": torch.tensor(2.5), "zero_size": torch.zeros(0, 3),
        "base": base, "transposed": base.t(), "row": base[2], "strided": base[:, ::2], "same": base,
        "param": torch.nn.Parameter(torch.ones(2, 2)),
        "tiny": torch.tensor([1e-45, 3.4028235e38, -0.0], dtype=torch.float32),
    })
    p = tmp_path_factory.mktemp("tf") / "odd.pt"
    torch.save(ckpt, p)
    return p


def test_load_is_torch_load_tensor_for_tensor(odd):
    ours = torchzip.load(str(odd))
    theirs = torch.load(odd, map_location="cpu", weights_only=True)
    assert same_tree(ours, theirs) > 30
    assert ours["same"].key == ours["base"].key == ours["transposed"].key      # one storage, as torch keeps it
    assert ours["transposed"].stride == (1, 6) and ours["row"].offset == 12
    assert not ours["base"].array.flags.writeable                             # a read-only view of the file


def _stripped_header(data):
    hlen = reader.PREFIX.unpack(data[:reader.PREFIX.size])[3]
    header = json.loads(data[reader.PREFIX.size:reader.PREFIX.size + hlen])

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k != "encode_seconds"}
        return [strip(v) for v in x] if isinstance(x, list) else x
    # the payload; the trailer hashes the header bytes, which hold the encode's seconds
    return strip(header), data[reader.PREFIX.size + hlen:len(data) - reader.TRAILER]


@pytest.mark.parametrize("kind", ["odd", "adam_tied", "adamw"])
def test_container_from_either_loader_is_the_same(kind, odd, tmp_path):
    if kind == "odd":
        path = odd
    else:
        path = tmp_path / f"{kind}.pt"
        torch.save(trained(decoupled=kind == "adamw", tie=kind == "adam_tied"), path)
    with_torch, _ = torch_compat.compress_checkpoint(torch.load(path, map_location="cpu", weights_only=True),
                                                     variant=VARIANT)
    without, summary = torch_compat.compress_checkpoint(torchzip.load(str(path)), variant=VARIANT)
    h1, rest1 = _stripped_header(with_torch)
    h2, rest2 = _stripped_header(without)
    assert h1 == h2 and rest1 == rest2
    assert summary["coordinates"] > 0
    if kind == "adam_tied":   # the tied weight is stored once by both
        names = [e["name"] for e in h2["entries"]]
        assert sum(n.startswith("model/") for n in names) == len(h2["meta"]["tree"]["__dict__"][0][1]["__dict__"]) - 1


def test_files_it_does_not_cover_are_left_to_torch(tmp_path):
    legacy = tmp_path / "legacy.pt"
    torch.save({"x": torch.ones(3)}, legacy, _use_new_zipfile_serialization=False)
    complex_ = tmp_path / "complex.pt"
    torch.save({"z": torch.ones(2, dtype=torch.complex64)}, complex_)
    device = tmp_path / "device.pt"
    torch.save({"d": torch.device("cpu")}, device)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    for p in (legacy, complex_, device, garbage, tmp_path / "missing.pt"):
        with pytest.raises(torchzip.Unsupported):
            torchzip.load(str(p))


def test_a_pickle_naming_code_is_never_run(tmp_path):
    """A zip whose data.pkl calls os.system: refused before anything is built (negative control:
    plain pickle.loads of the same bytes does run it)."""
    import zipfile
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))
    p = tmp_path / "evil.pt"
    payload = pickle.dumps({"x": Evil()}, protocol=2)
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("evil/data.pkl", payload)
        zf.writestr("evil/byteorder", "little")
    with pytest.raises(torchzip.Unsupported, match="os|posix|system"):
        torchzip.load(str(p))
    assert not marker.exists()
    pickle.loads(payload)
    assert marker.exists()


def test_fast_key_follows_the_kernel_variables(monkeypatch):
    key = variant_cache.fast_key()
    assert key is not None and len(key) == 24 and variant_cache.fast_key() == key
    for var, values in (("ATEN_CPU_CAPABILITY", ("default", "avx2")), ("MKL_CBWR", ("COMPATIBLE", "AVX2")),
                        ("MKL_ENABLE_INSTRUCTIONS", ("AVX2", "SSE4_2"))):
        other = next(v for v in values if v != os.environ.get(var))   # a value this run does not have
        with monkeypatch.context() as m:
            m.setenv(var, other)
            assert variant_cache.fast_key() != key, var
        assert variant_cache.fast_key() == key


def test_compress_process_does_not_import_torch_once_the_variant_is_cached(odd, tmp_path):
    env = {**ENV, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    os.makedirs(programs.cache_root(), exist_ok=True)    # a fresh variant cache, the suite's warm programs
    (tmp_path / "cache" / "jaxguard").mkdir(parents=True)
    (tmp_path / "cache" / "jaxguard" / "programs").symlink_to(programs.cache_root(), target_is_directory=True)
    code = ("import sys; from jaxguard.cli import main; rc = main(['compress', sys.argv[1], '-o', sys.argv[2], "
            "'--json']); print(rc, 'torch' in sys.modules)")
    runs = []
    for i in range(2):
        out = tmp_path / f"c{i}.jg"
        r = subprocess.run([sys.executable, "-c", code, str(odd), str(out)], env=env, capture_output=True, text=True,
                           timeout=600)
        runs.append((r.stdout.split()[-2:], out))
        assert r.returncode == 0, r.stdout + r.stderr
    assert runs[0][0] == ["0", "True"]     # the first detects the variant (torch) and records it
    assert runs[1][0] == ["0", "False"]    # the second reads the file without torch
    h0, rest0 = _stripped_header(runs[0][1].read_bytes())
    h1, rest1 = _stripped_header(runs[1][1].read_bytes())
    assert h0 == h1 and rest0 == rest1
    # with the variant recorded, a file the reader does not cover still goes through torch.load
    legacy = tmp_path / "legacy.pt"
    torch.save(torch.load(odd, weights_only=True), legacy, _use_new_zipfile_serialization=False)
    r = subprocess.run([sys.executable, "-c", code, str(legacy), str(tmp_path / "legacy.jg")], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.split()[-2:] == ["0", "True"], r.stdout + r.stderr
    h2, rest2 = _stripped_header((tmp_path / "legacy.jg").read_bytes())
    assert h2 == h0 and rest2 == rest0
    # and one torch refuses is refused as before, in one line, with no output file
    evil = tmp_path / "evil.pt"
    torch.save({"model": {}, "optimizer": {}, "x": Opaque()}, evil)   # a global weights_only refuses
    r = subprocess.run([sys.executable, "-m", "jaxguard", "compress", str(evil), "-o", str(tmp_path / "evil.jg")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and r.stderr.startswith("jaxguard: error: ") and "refused" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "evil.jg").exists()
