"""`jaxguard restore` without torch or JAX in the process (jaxguard/format/torchzip_writer.py): the file
it writes loads (weights_only, and mmap) to the same object, tensor for tensor and bit for
bit, as ``torch.save(torch_compat.restore_tree(path)[0])``, for every codec's golden
container and for a checkpoint with every pass-through kind; a damaged file leaves nothing.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys
import zipfile

import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import torch_compat
from jaxguard import cli
from jaxguard.format import torchzip_writer
from jaxguard.format import container
from jaxguard.format.reader import PREFIX, TRAILER

HERE = pathlib.Path(__file__).resolve().parents[1]   # tests/
ROOT = HERE.parent
GOLDEN = HERE / "golden" / "containers"
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}


def same(x, y, path="") -> None:
    """The same object: types, keys in order, tensors' dtype/shape/stride and bits, values."""
    assert type(x) is type(y), (path, type(x), type(y))
    if isinstance(x, dict):
        assert list(x) == list(y), path
        for k in x:
            same(x[k], y[k], f"{path}/{k}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), path
        for i, (a, b) in enumerate(zip(x, y)):
            same(a, b, f"{path}/{i}")
    elif isinstance(x, torch.Tensor):
        assert (x.dtype, x.shape, x.stride(), x.requires_grad) == (y.dtype, y.shape, y.stride(), y.requires_grad), path
        assert x.contiguous().numpy().tobytes() == y.contiguous().numpy().tobytes() if x.dtype != torch.bfloat16 \
            else torch.equal(x.view(torch.int16), y.view(torch.int16)), path
    elif isinstance(x, float) and math.isnan(x):
        assert math.isnan(y), path
    else:
        assert x == y, (path, x, y)


def reference(container, tmp_path):
    """What the torch path writes: restore_tree + torch.save, loaded back."""
    tree, _ = torch_compat.restore_tree(container)
    ref = tmp_path / "ref.pt"
    torch.save(tree, ref)
    return torch.load(ref, weights_only=True)


def check_fast(container, tmp_path):
    out = tmp_path / "fast.pt"
    assert torchzip_writer.restore(str(container), str(out)) is True
    ref = reference(container, tmp_path)
    same(ref, torch.load(out, weights_only=True))
    same(ref, torch.load(out, weights_only=True, mmap=True))
    with zipfile.ZipFile(out) as zf:      # data records 64-byte aligned, as torch writes them
        with open(out, "rb") as fh:
            for zi in zf.infolist():
                if "/data/" in zi.filename:
                    fh.seek(zi.header_offset + 26)
                    n, e = int.from_bytes(fh.read(2), "little"), int.from_bytes(fh.read(2), "little")
                    assert (zi.header_offset + 30 + n + e) % 64 == 0, zi.filename
    return out


def _reseal(header, payload):
    return container.seal(header, payload)


def _split(data):
    h = PREFIX.unpack_from(data, 0)[3]
    return json.loads(data[PREFIX.size:PREFIX.size + h]), data[PREFIX.size + h:len(data) - TRAILER]


@pytest.mark.parametrize("chunk, ahead, reverse", [(None, None, False), (512, None, False), (None, 1, True)])
@pytest.mark.parametrize("name", sorted(p.stem for p in GOLDEN.glob("*.jaxguard")))
def test_golden_codecs_restore_identically(name, chunk, ahead, reverse, tmp_path, monkeypatch):
    """Every codec's golden container (rANS included), its entries given a torch tree; with
    chunk=512 every entry over two blocks is decoded in block ranges on the thread pool, and
    the rANS sections a window of about one entry at a time.  With ahead=1 the decoder hands
    one entry at a time (`torchzip_writer.AHEAD_BYTES`) to a writer that asks for the last first
    (the others wait in its stash), every entry's CRC-32 taken beside its hash: no deadlock,
    the same file."""
    if chunk:
        monkeypatch.setattr(torchzip_writer, "CHUNK", chunk)
        monkeypatch.setattr(torchzip_writer, "WINDOW", 3 * chunk)
        monkeypatch.setattr(torchzip_writer, "RANS_WINDOW", chunk)
    if ahead:
        monkeypatch.setattr(torchzip_writer, "AHEAD_BYTES", ahead)
        monkeypatch.setattr(torchzip_writer, "CRC_BESIDE_FROM", 0)
    header, payload = _split((GOLDEN / f"{name}.jaxguard").read_bytes())
    state = []
    for i, e in enumerate(x for x in header["entries"] if x["kind"] == "moments"):
        state.append([i, {"__dict__": [["step", 3.0], ["exp_avg", {"__moment__": e["name"], "which": "m"}],
                                       ["exp_avg_sq", {"__moment__": e["name"], "which": "v"}]]}])
    if reverse:
        state.reverse()
    raws = [[e["name"], {"__tensor__": e["name"]}] for e in header["entries"] if e["kind"] == "raw"]
    header["meta"] = {"framework": "torch", "tree": {"__dict__": [["model", {"__dict__": raws}],
                                                                  ["optimizer", {"__dict__": [["state", {"__dict__": state}]]}]]}}
    p = tmp_path / f"{name}.jg"
    p.write_bytes(_reseal(header, payload))
    check_fast(p, tmp_path)


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """A real AdamW checkpoint with every pass-through kind next to it."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 300), torch.nn.Linear(300, 2))
    opt = torch.optim.AdamW(model.named_parameters(), lr=1e-3)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 7)).square().sum().backward()
        opt.step()
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 7, "big": 2**70, "neg": -5,
            "mid": 70000, "f": 0.1, "nan": float("nan"), "inf": -float("inf"), "s": "é\u2603", "none": None,
            "flag": True, "t": (1, [2, (3,)], {}), "empty": [], "nested": {"a": {"b": [1.5, "x"]}, 4: "int key"},
            "bf16": torch.arange(6, dtype=torch.float32).reshape(2, 3).to(torch.bfloat16),
            "i64": torch.arange(5), "i8": torch.tensor([-1, 2], dtype=torch.int8), "u8": torch.tensor([255], dtype=torch.uint8),
            "b": torch.tensor([True, False]), "f64": torch.tensor([1e-300]), "f16": torch.tensor([1.5], dtype=torch.float16),
            "i32": torch.tensor([[1], [2]], dtype=torch.int32), "i16": torch.tensor([3], dtype=torch.int16),
            "zero_d": torch.tensor(2.5), "zero_size": torch.zeros(0, 3)}
    data, _ = torch_compat.compress_checkpoint(ckpt)
    d = tmp_path_factory.mktemp("fast")
    p = d / "odd.jg"
    p.write_bytes(data)
    return p


def test_every_passthrough_kind_restores_identically(odd, tmp_path):
    out = check_fast(odd, tmp_path)
    back = torch.load(out, weights_only=True)
    assert back["big"] == 2**70 and back["s"] == "é\u2603" and back["nested"][4] == "int key"


def test_restore_process_imports_neither_torch_nor_jax(odd, tmp_path):
    out = tmp_path / "cli.pt"
    code = ("import sys; from jaxguard.cli import main; rc = main(['restore', sys.argv[1], '-o', sys.argv[2]]); "
            "print(rc, 'torch' in sys.modules, 'jax' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(odd), str(out)], env=ENV, capture_output=True, text=True,
                       timeout=300)
    assert r.stdout.split()[-3:] == ["0", "False", "False"], r.stdout + r.stderr
    same(reference(odd, tmp_path), torch.load(out, weights_only=True))


def test_uncovered_dtype_falls_back_to_torch_save(tmp_path):
    """A uint16 tensor has no torch storage class this writer names: torch.save writes it."""
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    data, _ = torch_compat.compress_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                                "u16": torch.tensor([1, 65535], dtype=torch.uint16)})
    p = tmp_path / "u16.jg"
    p.write_bytes(data)
    assert torchzip_writer.restore(str(p), str(tmp_path / "x.pt")) is False and not (tmp_path / "x.pt").exists()
    assert cli.main(["restore", str(p), "-o", str(tmp_path / "y.pt")]) == 0
    same(reference(p, tmp_path), torch.load(tmp_path / "y.pt", weights_only=True))


@pytest.mark.parametrize("where", ["payload", "header", "trailer"])
def test_damaged_file_named_by_its_checksum_and_nothing_written(odd, tmp_path, where, capsys):
    data = bytearray(odd.read_bytes())
    hlen = PREFIX.unpack_from(data, 0)[3]
    pos = {"payload": PREFIX.size + hlen + 100, "header": PREFIX.size + 3, "trailer": len(data) - 1}[where]
    data[pos] ^= 0x10
    p = tmp_path / "bad.jg"
    p.write_bytes(bytes(data))
    assert cli.main(["restore", str(p), "-o", str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "file checksum mismatch" in err[0], err
    assert os.listdir(tmp_path) == ["bad.jg"]


def test_decoded_hash_mismatch_refused(odd, tmp_path, capsys):
    header, payload = _split(odd.read_bytes())
    header["decoded_sha256"] = "0" * 64
    p = tmp_path / "dec.jg"
    p.write_bytes(_reseal(header, payload))
    assert cli.main(["restore", str(p), "-o", str(tmp_path / "out.pt")]) == 2
    assert "decoded moments BLAKE3 mismatch" in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["dec.jg"]
