"""Where containers live: local paths and fsspec URLs (``s3://``, ``gs://``, ``memory://``, ``file://``).

`atomic_write` and `read_bytes` dispatch on the path: a plain path, an ``os.PathLike``
or a ``file://`` URL goes to the local atomic writer (`container.atomic_write`:
temporary file, fsync, rename, fsync of the directory); any other ``scheme://`` goes to
fsspec, imported only then (``pip install jaxguard[remote]`` for s3fs/gcsfs).

Visibility contract (all-or-nothing, as for local files): a reader of the target key
sees either the previous complete object or the new complete object, never a prefix.

- Object stores (s3, gcs, azure; `ATOMIC_PUT`): the complete container is sent with one
  ``pipe_file`` call, i.e. one PUT, or a multipart upload that the store publishes only
  on its final *complete* request. Both are atomic by the store's own semantics; a
  writer killed mid-upload leaves the previous object in place (an abandoned multipart
  upload is invisible; a bucket lifecycle rule reclaims it). A temporary key followed
  by a server-side copy would add a second full copy and nothing to the guarantee.
- Every other fsspec filesystem (memory, sftp, hdfs, ...): the bytes go to a temporary
  key ``.<name>.<random>.tmp`` beside the target, then ``fs.mv`` renames it over the
  target; the temporary key is removed if anything fails.

After a write the stored size is compared with ``len(data)``; the SHA-256 checks run on
every read (`container.read`), wherever the bytes came from.
"""
from __future__ import annotations

import contextlib
import os
import re
import uuid

from jaxguard.errors import ContainerError

ATOMIC_PUT = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")


def is_url(path) -> bool:
    """True when `path` is a ``scheme://`` URL other than ``file://`` (handled locally).

    Args:
      path: a str, `os.PathLike` or anything else (only a str can be a URL).

    Returns:
      bool; ``file://`` and ``local://`` paths are local (False).
    """
    if not isinstance(path, str):
        return False
    m = _URL.match(path)
    return bool(m) and m.group(1).lower() not in ("file", "local")


def local_path(path) -> str:
    """`path` as a local filesystem path (``file://`` and ``local://`` stripped).

    Args:
      path: a str or `os.PathLike` that `is_url` calls local.

    Returns:
      The path (str, or bytes for a bytes path).
    """
    path = os.fspath(path)
    if isinstance(path, str):
        for prefix in ("file://", "local://"):
            if path.lower().startswith(prefix):
                return path[len(prefix):]
    return path


def _fs(url, storage_options=None):
    try:
        import fsspec
    except ImportError:
        raise ContainerError(f"{url}: reading and writing URLs needs fsspec; pip install 'jaxguard[remote]'") from None
    try:
        return fsspec.core.url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise ContainerError(f"{url}: no fsspec filesystem for this URL ({str(exc).splitlines()[0][:160]}); "
                             "install the one it names (s3fs for s3://, gcsfs for gs://)") from None


def _protocols(fs) -> set:
    p = fs.protocol
    return {p} if isinstance(p, str) else set(p)


def atomic_write(path, data: bytes, *, storage_options: dict | None = None) -> None:
    """Write `data` to a local path or fsspec URL, all-or-nothing (module docstring).

    Args:
      path: a local path, ``file://`` URL or any fsspec URL (``s3://bucket/key``, ...).
      data: the complete bytes of the object.
      storage_options: keyword arguments for the fsspec filesystem (``endpoint_url``, ...).

    Raises:
      ContainerError: the local directory does not exist, the filesystem is unknown,
        or the store reports a size different from ``len(data)`` after the write.
    """
    if not is_url(path):
        from jaxguard.format.container import atomic_write as local_write
        return local_write(local_path(path), data)
    fs, key = _fs(path, storage_options)
    data = bytes(data)
    if _protocols(fs) & ATOMIC_PUT:
        try:
            fs.pipe_file(key, data)
        except FileNotFoundError:
            raise ContainerError(f"{path}: the bucket or container does not exist; create it first") from None
    else:
        parent, name = key.rsplit("/", 1) if "/" in key else ("", key)
        tmp = f"{parent}/.{name}.{uuid.uuid4().hex}.tmp" if parent else f".{name}.{uuid.uuid4().hex}.tmp"
        try:
            fs.pipe_file(tmp, data)
            fs.mv(tmp, key)
        except BaseException:
            with contextlib.suppress(Exception):
                fs.rm_file(tmp)
            raise
    with contextlib.suppress(AttributeError):
        fs.invalidate_cache(key)
    size = fs.size(key)
    if size != len(data):
        raise ContainerError(f"{path}: the store holds {size} bytes after writing {len(data)}; the write did not "
                             "complete, retry it")


def read_bytes(path, *, storage_options: dict | None = None) -> bytes:
    """The complete bytes at a local path or fsspec URL.

    Args:
      path: a local path or an fsspec URL (``s3://``, ``gs://``, ``memory://``, ...).
      storage_options: keyword arguments for the fsspec filesystem (URLs only).

    Returns:
      The contents: a writable ``bytearray`` for a local file (arrays can view it in
      place), the filesystem's ``bytes`` for a URL.

    Raises:
      ContainerError: the object does not exist or cannot be read (one line naming it),
        or no fsspec filesystem handles the URL's scheme.
    """
    try:
        if not is_url(path):
            with open(local_path(path), "rb") as fh:   # a writable buffer: arrays can be used in place
                data = bytearray(os.fstat(fh.fileno()).st_size)
                got = fh.readinto(data)
                if got != len(data):
                    del data[got:]
                return data
        fs, key = _fs(path, storage_options)
        return fs.cat_file(key)
    except FileNotFoundError:
        raise ContainerError(f"{path}: no such file; pass the path of a jaxguard container") from None
    except OSError as exc:
        raise ContainerError(f"cannot read {path}: {exc.strerror or exc}") from None


def exists(path) -> bool:
    """Whether a local path or fsspec URL names an existing object.

    Args:
      path: a local path or an fsspec URL.

    Returns:
      bool.

    Raises:
      ContainerError: no fsspec filesystem handles the URL's scheme.
    """
    if not is_url(path):
        return os.path.exists(local_path(path))
    fs, key = _fs(path)
    return fs.exists(key)


def size(path) -> int:
    """Size in bytes of the object at a local path or fsspec URL.

    Args:
      path: a local path or an fsspec URL.

    Returns:
      The size in bytes (int).

    Raises:
      ContainerError: no fsspec filesystem handles the URL's scheme.
    """
    if not is_url(path):
        return os.path.getsize(local_path(path))
    fs, key = _fs(path)
    return int(fs.size(key))


def remove(path, *, storage_options: dict | None = None) -> None:
    """Remove the object at a local path or fsspec URL; a missing one is not an error.

    Args:
      path: a local path or an fsspec URL.
      storage_options: keyword arguments for the fsspec filesystem (URLs only).

    Raises:
      ContainerError: no fsspec filesystem handles the URL's scheme.
    """
    if not is_url(path):
        try:
            os.unlink(local_path(path))
        except FileNotFoundError:
            pass
        return
    fs, key = _fs(path, storage_options)
    if fs.exists(key):
        fs.rm_file(key)
