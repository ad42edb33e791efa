"""The restore's speed paths write what the plain paths write (jaxguard/format/torchzip_writer.py,
jaxguard/format/reader.py): decode buffers lent again across entries (in any order the tree
names them, one named twice), decodes in `SUB`-coordinate pieces, the mapped read, and the
escape mask unpacked only where it has bits; every restored tensor is compared by SHA-256
with ``torch.save(restore_tree(path)[0])``.
"""
from __future__ import annotations

import hashlib
import json
import math
import os

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import torch_compat
from jaxguard import cli
from jaxguard.format import torchzip_writer
from jaxguard.format import container
from jaxguard.format.reader import PREFIX, TRAILER


def digests(obj, path=""):
    """{path: (dtype, shape, stride, SHA-256 of the bytes)} of every tensor, repr of the rest."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(digests(v, f"{path}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(digests(v, f"{path}/{i}"))
    elif isinstance(obj, torch.Tensor):
        raw = obj.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if obj.numel() else b""
        out[path] = (str(obj.dtype), tuple(obj.shape), obj.stride(), hashlib.sha256(raw).hexdigest())
    else:
        out[path] = repr(obj)
    return out


def _adam_container(seed, layers, width, codec=None):
    """A real Adam checkpoint of `layers` Linear(width, width) after 3 steps, compressed."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, width)).square().sum().backward()
        opt.step()
    data, _ = torch_compat.compress_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict()},
                                               codec=codec)
    return data


@pytest.fixture(scope="module")
def ckpt_file(tmp_path_factory):
    """A real Adam checkpoint: 16 parameters, 8 of them (1,600 coordinates) over CHUNK=512."""
    data = _adam_container(0, 8, 40)
    p = tmp_path_factory.mktemp("speed") / "c.jg"
    p.write_bytes(data)
    return p


def _reordered(src, dst):
    """`src` with its optimizer state named in reverse order and the first moment named twice."""
    data = src.read_bytes()
    h = PREFIX.unpack_from(data, 0)[3]
    header, payload = json.loads(data[PREFIX.size:PREFIX.size + h]), data[PREFIX.size + h:len(data) - TRAILER]
    top = header["meta"]["tree"]["__dict__"]
    opt = dict(top)["optimizer"]["__dict__"]
    state = dict(opt)["state"]["__dict__"]
    state.reverse()
    state.append(["again", state[-1][1]])
    dst.write_bytes(container.seal(header, payload))
    return dst


def _reference(container, tmp_path):
    tree, _ = torch_compat.restore_tree(container)
    torch.save(tree, tmp_path / "ref.pt")
    return digests(torch.load(tmp_path / "ref.pt", weights_only=True))


@pytest.mark.parametrize("order", ["as-saved", "reversed+twice"])
def test_lent_buffers_and_pieces_restore_the_same_tensors(ckpt_file, order, tmp_path, monkeypatch):
    """Small decode chunks, pieces and window: eight entries go through the lent buffers and
    the piecewise decode, in the saved order or reversed with one entry named twice."""
    monkeypatch.setattr(torchzip_writer, "CHUNK", 512)
    monkeypatch.setattr(torchzip_writer, "SUB", 256)
    monkeypatch.setattr(torchzip_writer, "WINDOW", 1024)
    src = ckpt_file if order == "as-saved" else _reordered(ckpt_file, tmp_path / "r.jg")
    out = tmp_path / "fast.pt"
    assert torchzip_writer.restore(str(src), str(out)) is True
    assert digests(torch.load(out, weights_only=True)) == _reference(src, tmp_path)


@pytest.mark.parametrize("n", [1, 9, 4099])
def test_escapes_anywhere_restore_exactly(n, tmp_path):
    """Coordinates that escape (NaN first moments) at the first, a sparse set and the last
    position: the escape mask is unpacked only where it has bits, and the restored file holds
    their exact values."""
    torch.manual_seed(n)
    w = torch.nn.Parameter(torch.randn(n) * 0.1)
    opt = torch.optim.Adam([w], lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        (w * torch.randn(n)).sum().backward()
        opt.step()
    sd = opt.state_dict()
    bad = sorted({0, n - 1, *range(3, n, 97)})
    sd["state"][0]["exp_avg"][bad] = float("nan")
    data, summary = torch_compat.compress_checkpoint({"model": {"w": w.detach()}, "optimizer": sd})
    assert summary["escapes"] >= len(bad)
    src = tmp_path / "e.jg"
    src.write_bytes(data)
    out = tmp_path / "e.pt"
    assert torchzip_writer.restore(str(src), str(out)) is True
    back = torch.load(out, weights_only=True)
    assert torch.isnan(back["optimizer"]["state"][0]["exp_avg"][bad]).all()
    assert digests(back) == _reference(src, tmp_path)


@pytest.mark.parametrize("zip64_limit", [None, 1000])
def test_restored_zip_reads_back_with_zip64_records(ckpt_file, tmp_path, monkeypatch, zip64_limit):
    """The records written once each (CRC known ahead): zipfile's own check passes and torch
    loads the same tensors, with zip64 headers and end records too (a small ZIP64_LIMIT)."""
    import zipfile
    if zip64_limit:
        monkeypatch.setattr(zipfile, "ZIP64_LIMIT", zip64_limit)
    out = tmp_path / "z.pt"
    assert torchzip_writer.restore(str(ckpt_file), str(out)) is True
    monkeypatch.undo()
    with zipfile.ZipFile(out) as zf:
        assert zf.testzip() is None
    assert digests(torch.load(out, weights_only=True)) == _reference(ckpt_file, tmp_path)


def test_damaged_frame_inside_a_grouped_task_named_and_nothing_written(tmp_path, capsys):
    """Small log8-rel-zstd entries are decoded several to a pool task: a zstd frame of the
    middle entry with a reserved header bit set (the file's checksums resealed over it) is
    refused in one line naming that entry's section, and no output is left."""
    from jaxguard.format import zstd_streams
    data = _adam_container(2, 5, 30, codec="log8-rel-zstd")
    h = PREFIX.unpack_from(data, 0)[3]
    header, payload = json.loads(data[PREFIX.size:PREFIX.size + h]), bytearray(data[PREFIX.size + h:len(data) - TRAILER])
    moments = [e for e in header["entries"] if e["kind"] == "moments"]
    assert len(moments) == 10 and sum(math.prod(e["shape"]) for e in moments) <= torchzip_writer.GROUP

    def first_compressed_frame(e):   # where the first zstd-compressed frame of e's m codes starts
        frames = zstd_streams.stream_frames(payload[slice(*e["sections"]["m_codes"])], "m")[1]
        return next((a for a, stored, d in frames if stored < d), None)
    target, start = next((e, a) for e in moments[3:] for a in [first_compressed_frame(e)] if a is not None)
    payload[target["sections"]["m_codes"][0] + start] |= 0x08    # the frame header's reserved bit
    src = tmp_path / "bad.jg"
    src.write_bytes(container.seal(header, bytes(payload), payload_digest=True))
    assert cli.main(["restore", str(src), "-o", str(tmp_path / "out.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{target['name']}.m_codes" in err[0] and "reserved bit" in err[0], err
    assert os.listdir(tmp_path) == ["bad.jg"]
