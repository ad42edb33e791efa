"""torch.save's zip format (torch >= 1.6) read without torch, by the standard library and numpy.

``jaxguard compress`` reads its checkpoint with `load`, so that the process never imports torch
(1.2-2 s and 180 MB of a 2-core machine); ``jaxguard restore`` writes the same format
(`jaxguard.format.torchzip_writer`).  The file: a zip of stored (uncompressed) records
``<archive>/data.pkl`` (the pickle of the object), ``<archive>/data/<key>`` (one storage's
bytes), ``<archive>/byteorder``; the pickle names ``torch._utils._rebuild_tensor_v2`` per tensor
and refers to storages by persistent id ``("storage", torch.<Type>Storage, key, location, numel)``.
"""
from __future__ import annotations

__all__ = ["STORAGES", "Unsupported", "FileTensor", "load"]

import collections
import io
import mmap
import os
import pickle
import zipfile

import numpy as np

from jaxguard.errors import JaxguardError

# container dtype -> torch storage class (torch.save's ``_pickle_storage_type``)
STORAGES = {"float32": "FloatStorage", "float64": "DoubleStorage", "float16": "HalfStorage",
            "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
            "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage"}


class Unsupported(JaxguardError):
    """A file (`load`) or a tree (`jaxguard.format.torchzip_writer.restore`) this torch-free code does not
    cover: the caller goes through torch (``torch.load`` / ``torch.save``) instead."""


# torch storage class -> (numpy dtype of its bytes, container dtype name): `STORAGES` read backwards
_STORAGE_DTYPES = {cls: (np.dtype(np.uint16) if name == "bfloat16" else np.dtype(name), name)
                   for name, cls in STORAGES.items()}


class FileTensor:
    """A tensor of a torch checkpoint read by `load` without torch: a read-only numpy view
    of its storage in the mapped file, and what `torch_compat.state` asks of a tensor on
    the compress path (shape, dtype, device, storage identity, bytes).

    Args:
      storage: the whole storage, a 1-D numpy array over the mapped file (bfloat16 as uint16).
      dtype_name: the container dtype name (``"float32"``, ``"bfloat16"``, ...).
      key: the storage's record key (tensors of one storage share it).
      offset, shape, stride: the view, in elements, as torch pickles it.
    """

    __slots__ = ("storage", "dtype_name", "key", "offset", "shape", "stride", "array")

    def __init__(self, storage, dtype_name, key, offset, shape, stride):
        self.storage, self.dtype_name, self.key = storage, dtype_name, key
        self.offset, self.shape, self.stride = int(offset), tuple(int(s) for s in shape), tuple(int(s) for s in stride)
        n = int(np.prod(self.shape, dtype=np.int64))
        if n and (self.offset < 0 or min(self.stride, default=0) < 0 or self.offset + sum(
                (d - 1) * s for d, s in zip(self.shape, self.stride)) >= storage.size):
            raise Unsupported(f"storage {key}: a view past its storage's {storage.size} elements")
        self.array = np.lib.stride_tricks.as_strided(storage[self.offset:] if n else storage[:0], self.shape,
                                                     tuple(s * storage.itemsize for s in self.stride), writeable=False)

    @property
    def dtype(self):
        """``"torch.<dtype>"``, as torch prints a tensor's dtype (for messages)."""
        return f"torch.{self.dtype_name}"

    @property
    def device(self):
        """The CPU (`load` maps every tensor there, as ``torch.load(map_location="cpu")``)."""
        return _CPU

    def numel(self) -> int:
        """The number of elements."""
        return int(self.array.size)

    def is_floating_point(self) -> bool:
        """Whether the dtype is a floating-point one."""
        return self.dtype_name in ("float16", "bfloat16", "float32", "float64")

    def item(self):
        """The one element as a Python number."""
        return self.array.reshape(-1)[0].item()

    def contiguous_array(self) -> np.ndarray:
        """The values in C order: the view itself when it is contiguous, else a copy."""
        return self.array if self.array.flags.c_contiguous else self.array.copy(order="C")   # 0-d stays 0-d


class _Device:
    type = "cpu"

    def __str__(self):
        return "cpu"


_CPU = _Device()


class _Storage:
    def __init__(self, name):
        self.name = name


def _rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if not isinstance(storage, tuple) or metadata:
        raise Unsupported("a tensor with metadata or of an unknown storage")
    arr, name, key = storage
    return FileTensor(arr, name, key, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None):
    if not isinstance(data, FileTensor):
        raise Unsupported("a parameter of something that is not a tensor")
    return data


class _Unpickler(pickle.Unpickler):
    # only what torch's weights_only loader allows for plain tensors; anything else is refused
    # here (never constructed) and the caller takes torch.load, which decides for itself
    GLOBALS = {("collections", "OrderedDict"): collections.OrderedDict,
               ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
               ("torch._utils", "_rebuild_parameter"): _rebuild_parameter}

    def __init__(self, fh, records):
        super().__init__(fh)
        self.records = records

    def find_class(self, module, name):
        if module == "torch" and name in _STORAGE_DTYPES:
            return _Storage(name)
        try:
            return self.GLOBALS[(module, name)]
        except KeyError:
            raise Unsupported(f"the pickle names {module}.{name}") from None

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], _Storage)):
            raise Unsupported(f"a persistent id {str(pid)[:60]}")
        _, kind, key, _location, numel = pid
        dt, name = _STORAGE_DTYPES[kind.name]
        return self.records(str(key), dt, int(numel)), name, str(key)


def load(path):
    """A checkpoint written by ``torch.save`` (the zip format, torch >= 1.6), read without
    torch: its dicts, lists and numbers as ``torch.load`` returns them and each tensor a
    `FileTensor` over a read-only mapping of the file (nothing is copied).

    The pickle may name only what ``torch.load(weights_only=True)`` allows for plain tensors
    (``collections.OrderedDict``, ``torch._utils._rebuild_tensor_v2`` and
    ``_rebuild_parameter``, ``torch.<Type>Storage`` of the dtypes the container stores);
    nothing else is constructed.  What this reader does not cover raises `Unsupported`
    (the caller then loads with torch): another name in the pickle, a tensor with
    metadata, a compressed or big-endian file, a storage past the end of its record.

    Args:
      path: a local file.

    Returns:
      The checkpoint object.

    Raises:
      Unsupported: the file is not one this reader covers (torch.load may still read it).
    """
    try:
        fh = open(path, "rb")
    except OSError as exc:
        raise Unsupported(str(exc)) from None
    with fh:
        try:
            zf = zipfile.ZipFile(fh)
            infos = zf.infolist()
            size = os.fstat(fh.fileno()).st_size
            mapped = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_READ)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise Unsupported(f"not a zip file ({exc})") from None
        pkl = [i for i in infos if i.filename.endswith("/data.pkl") and i.filename.count("/") == 1]
        if len(pkl) != 1:
            raise Unsupported("no single <archive>/data.pkl record")
        prefix = pkl[0].filename[:-len("data.pkl")]
        by_name = {i.filename: i for i in infos}
        order = by_name.get(prefix + "byteorder")
        if order is not None and zf.read(order).strip() != b"little":
            raise Unsupported("a big-endian checkpoint")
        buf = memoryview(mapped)

        def records(key, dt, numel):
            info = by_name.get(f"{prefix}data/{key}")
            if info is None or info.compress_type != zipfile.ZIP_STORED or numel * dt.itemsize > info.file_size:
                raise Unsupported(f"storage record {key} is missing, compressed or short")
            local = bytes(buf[info.header_offset:info.header_offset + 30])
            if local[:4] != b"PK\x03\x04":
                raise Unsupported(f"storage record {key} has no local header")
            start = info.header_offset + 30 + int.from_bytes(local[26:28], "little") + int.from_bytes(local[28:30], "little")
            if start + info.file_size > size:
                raise Unsupported(f"storage record {key} runs past the end of the file")
            return np.frombuffer(buf, dt, numel, start)

        try:
            return _Unpickler(io.BytesIO(zf.read(pkl[0])), records).load()
        except Unsupported:
            raise
        except Exception as exc:  # noqa: BLE001 - any malformed pickle: torch.load decides
            raise Unsupported(f"the pickle did not load here ({type(exc).__name__}: {str(exc)[:80]})") from None
