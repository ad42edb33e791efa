"""The restore's speed paths write what the plain paths write (jaxguard/cli/torchfile.py,
jaxguard/format/reader.py): decode buffers lent again across entries (in any order the tree
names them, one named twice), decodes in `SUB`-coordinate pieces, the mapped read, and the
escape mask unpacked only where it has bits; every restored tensor is compared by SHA-256
with ``torch.save(restore_tree(path)[0])``.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
torch = pytest.importorskip("torch", reason="needs torch (pip install -e '.[torch]')")

import torch_compat
from jaxguard.cli import torchfile
from jaxguard.format import reader
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


@pytest.fixture(scope="module")
def ckpt_file(tmp_path_factory):
    """A real Adam checkpoint: 16 parameters, 8 of them (1,600 coordinates) over CHUNK=512."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(40, 40) for _ in range(8)])
    opt = torch.optim.Adam(model.named_parameters(), lr=1e-3)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(8, 40)).square().sum().backward()
        opt.step()
    data, _ = torch_compat.compress_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict()})
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
    hb = json.dumps(header, separators=(",", ":")).encode()
    body = PREFIX.pack(reader.MAGIC, reader.VERSION, 0, len(hb)) + hb + payload
    dst.write_bytes(body + hashlib.sha256(body).digest())
    return dst


def _reference(container, tmp_path):
    tree, _ = torch_compat.restore_tree(container)
    torch.save(tree, tmp_path / "ref.pt")
    return digests(torch.load(tmp_path / "ref.pt", weights_only=True))


@pytest.mark.parametrize("order", ["as-saved", "reversed+twice"])
def test_lent_buffers_and_pieces_restore_the_same_tensors(ckpt_file, order, tmp_path, monkeypatch):
    monkeypatch.setattr(torchfile, "CHUNK", 512)
    monkeypatch.setattr(torchfile, "SUB", 256)
    monkeypatch.setattr(torchfile, "WINDOW", 1024)
    taken, fresh = [], []
    take = torchfile._Buffers.take

    def spy(self, name, n):
        before = len(self.free)
        out = take(self, name, n)
        taken.append(name)
        if len(self.free) == before:
            fresh.append(name)
        return out
    monkeypatch.setattr(torchfile._Buffers, "take", spy)
    src = ckpt_file if order == "as-saved" else _reordered(ckpt_file, tmp_path / "r.jg")
    out = tmp_path / "fast.pt"
    assert torchfile.restore(str(src), str(out)) is True
    assert len(taken) == 8, taken                 # the eight entries over CHUNK
    if order == "as-saved":   # written in decode order: at most 5 lent at once (2 queued, 1 written,
        assert len(fresh) <= 5, (taken, fresh)    # 1 finishing, 1 submitted), so some were lent again
    assert digests(torch.load(out, weights_only=True)) == _reference(src, tmp_path)


def test_buffers_lend_the_smallest_that_fits():
    b = torchfile._Buffers()
    m1, _ = b.take("a", 1000)
    m2, _ = b.take("b", 10)
    b.give_back("a")
    b.give_back("b")
    m3, v3 = b.take("c", 8)
    assert m3.base is m2.base and m3.shape == v3.shape == (8,)
    m4, _ = b.take("d", 900)
    assert m4.base is m1.base
    m5, _ = b.take("e", 5)           # nothing free: a new one
    assert m5.base is not m1.base and m5.base is not m2.base


def test_mapped_read_is_the_file(ckpt_file, tmp_path):
    got = torchfile._read(str(ckpt_file))
    assert isinstance(got, memoryview) and bytes(got) == ckpt_file.read_bytes()
    empty = tmp_path / "empty.jg"
    empty.write_bytes(b"")
    assert bytes(torchfile._read(str(empty))) == b""        # not mapped: read as bytes


@pytest.mark.parametrize("n", [1, 8, 9, 1000, 4099])
def test_escape_mask_positions(n):
    rng = np.random.default_rng(n)
    bits = rng.random(n) < 0.02
    bits[-1] = True
    mask = np.packbits(bits, bitorder="little").tobytes()
    got = reader._escape_positions("e", {"escape_mask": [0, len(mask)]}, memoryview(mask), n)
    assert np.array_equal(got, np.flatnonzero(bits))
    if n % 8:
        bad = bytes(mask[:-1]) + bytes([mask[-1] | 0x80])
        with pytest.raises(reader.ReaderError, match="bits set past the end"):
            reader._escape_positions("e", {"escape_mask": [0, len(bad)]}, memoryview(bad), n)


@pytest.mark.parametrize("zip64_limit", [None, 1000])
def test_records_are_the_bytes_writestr_writes(zip64_limit, monkeypatch):
    """`_Records` (each local header written once, CRC known) against `zipfile.writestr`
    of the same records; with a small ZIP64_LIMIT the zip64 headers and end records too."""
    import io
    import zipfile
    import zlib
    if zip64_limit:
        monkeypatch.setattr(zipfile, "ZIP64_LIMIT", zip64_limit)
    rng = np.random.default_rng(0)
    recs = [("data.pkl", b"\x80\x02pickle", False), ("byteorder", b"little", False)]
    recs += [(f"data/{i}", rng.integers(0, 256, size, dtype=np.uint8).tobytes(), True)
             for i, size in enumerate([0, 1, 63, 64, 999, 1001, 5000])]
    ours, theirs = io.BytesIO(), io.BytesIO()
    zr = torchfile._Records(ours)
    for i, (name, data, align) in enumerate(recs):
        zr.add(name, memoryview(data), zlib.crc32(data) if i % 2 else None, align)
    zr.close()
    with zipfile.ZipFile(theirs, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data, align in recs:
            zf.writestr(torchfile._zinfo(name, zf.fp.tell(), len(data), align), data)
    assert ours.getvalue() == theirs.getvalue()
    with zipfile.ZipFile(io.BytesIO(ours.getvalue())) as zf:
        assert zf.testzip() is None and [zf.read(f"archive/{n}") for n, _, _ in recs] == [d for _, d, _ in recs]
