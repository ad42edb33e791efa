"""Where checkpoints live: local paths and fsspec URLs (``s3://``, ``gs://``, ``memory://``, ``file://``).

The one module that owns file I/O and atomicity for the whole library: `atomic_write`,
`atomic_write_with`, `read_bytes`, `read_range`, `exists`, `is_dir`, `mkdir`, `listdir`,
`size`, `remove` and `join` dispatch on the path; `atomic_directory` publishes a new local
directory whole; `commit_directory` replaces a local directory whole (the trainer
integrations' checkpoints: a staging directory, two renames, `recover_directory` to undo
what a killed commit left).  A plain path, an ``os.PathLike`` or a ``file://`` URL is local; any
other ``scheme://`` goes to fsspec, imported only then (``pip install jaxguard[remote]``
for s3fs/gcsfs).

Local writes: a temporary file ``.<name>.<random>.tmp`` in the target directory, created
with mode 0666 less the umask (as ``open(path, "wb")`` or ``torch.save`` would), fsync,
``os.replace`` over the target, fsync of the directory (a cache's file, `durable` False:
the rename without the fsyncs).  A failure (a full disk, ...)
removes the temporary file and raises one `ContainerError` line; the target is untouched.
A writer killed mid-write (SIGKILL, power loss) cannot remove its temporary file: the next
successful write of the same target removes that target's temporary files left untouched
for `STALE_TMP_SECONDS` (a live writer's file is newer: it is being written).

Visibility contract (all-or-nothing, as for local files): a reader of the target key
sees either the previous complete object or the new complete object, never a prefix.

- Object stores (s3, gcs, azure; `ATOMIC_PUT`): the complete object is sent with one
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

__all__ = ["is_url", "local_path", "join", "STALE_TMP_SECONDS", "tmp_name", "fsync_dir", "fsync_tree", "atomic_write_with",
           "atomic_directory", "atomic_write", "read_bytes", "read_range", "is_dir", "mkdir", "listdir",
           "exists", "size", "remove", "STAGING_SUFFIX", "OLD_SUFFIX", "new_token", "staging_path",
           "recover_directory", "recover_directories", "commit_directory"]

import contextlib
import io
import os
import re
import shutil
import time
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


def join(base, *names) -> str:
    """`base` / `names` for a local path (``os.path.join``) or a URL (``/``).

    Args:
      base: a local path, ``os.PathLike`` or URL.
      names: path components to append.

    Returns:
      The joined path (str).
    """
    base = os.fspath(base)
    if is_url(base):
        return "/".join([base.rstrip("/"), *names])
    return os.path.join(local_path(base), *names)


STALE_TMP_SECONDS = 3600.0


def tmp_name(name: str) -> str:
    """Args: name: a file name.  Returns: a fresh temporary name beside it (``.<name>.<random>.tmp``)."""
    return f".{name}.{uuid.uuid4().hex[:12]}.tmp"


def _remove_stale_tmps(directory: str, name: str) -> None:
    """Remove ``.<name>.<random>.tmp`` files in `directory` unmodified for `STALE_TMP_SECONDS`."""
    pattern = re.compile(r"\." + re.escape(name) + r"\.[0-9a-f]{12}\.tmp")
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if pattern.fullmatch(entry.name):
                with contextlib.suppress(OSError):
                    if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_SECONDS:
                        os.unlink(entry.path)


def fsync_dir(directory: str) -> None:
    """Make `directory`'s entries (a rename, a new file) durable (POSIX fsync of the directory).

    Args:
      directory: a local directory.
    """
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """fsync every file under `root`, then each directory, deepest entries included.

    Args:
      root: a local directory.
    """
    for here, _dirs, files in os.walk(root):
        for name in files:
            with open(os.path.join(here, name), "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(here)


def _write_error(path, exc) -> ContainerError:
    why = (exc.strerror or str(exc)) if isinstance(exc, OSError) else str(exc)
    return ContainerError(f"cannot write {path}: {why}; nothing was replaced (the previous file, if any, is intact)")


def atomic_write_with(path, write, *, storage_options: dict | None = None, durable: bool = True,
                      mode: int = 0o666) -> None:
    """Write a file through ``write(fh)``, all-or-nothing (module docstring).

    Local: ``write(fh)`` fills a temporary file in the target directory (e.g.
    ``torch.save(obj, fh)``: no in-memory copy of the output), which is fsynced and
    renamed over `path`.  URL: ``write`` fills a buffer, sent as by `atomic_write`.

    Args:
      path: a local path, ``file://`` URL or any fsspec URL.
      write: ``write(fh)`` writes the file's content to the binary file object `fh`.
      storage_options: keyword arguments for the fsspec filesystem (URLs only).
      durable: fsync the file and its directory (local); False for a cache, which needs
        the rename's all-or-nothing but not to survive a power loss.
      mode: the new file's permissions, less the umask (local; 0o600: this user's only).

    Raises:
      ContainerError: the directory does not exist, or the write failed (one line with
        the OS's reason, e.g. a full disk); no partial file is left, the target is as it was.
      Whatever `write` raises that is not an OSError (the temporary file is removed).
    """
    if is_url(path):
        buf = io.BytesIO()
        write(buf)
        return atomic_write(path, buf.getvalue(), storage_options=storage_options)
    path = local_path(path)
    directory = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(directory):
        raise ContainerError(f"output directory {directory} does not exist; create it first")
    tmp = os.path.join(directory, tmp_name(os.path.basename(path)))
    try:
        # mode 0666 less the umask by default, as a plain open() would give (mkstemp's 0600 would not)
        # read-write: a container writer reads its payload back for the trailer's SHA-256
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), mode)
        with os.fdopen(fd, "wb") as fh:
            write(fh)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise _write_error(path, exc) from None
        raise
    if durable:
        with contextlib.suppress(OSError):
            fsync_dir(directory)
    _remove_stale_tmps(directory, os.path.basename(path))


@contextlib.contextmanager
def atomic_directory(path):
    """Build a new local directory all-or-nothing: fill the yielded staging directory.

    The staging directory is ``.<name>.<random>.tmp`` beside `path` (`tmp_name`).  When the
    ``with`` block ends normally every file under it is fsynced, `path` (absent, or an
    empty directory, which is removed first) is replaced by it in one rename, and the
    parent directory is fsynced.  When the block raises (anything, KeyboardInterrupt
    included) the staging directory is removed, `path` is as it was, and the exception
    propagates.  Durability contract: a reader of `path` sees no directory (or the empty
    one) or the complete new one, never a partial one; a process killed inside the block
    leaves only the hidden staging directory, which nothing removes automatically (unlike
    `atomic_write`'s temporary files).

    Args:
      path: a local directory that does not exist yet or is empty.

    Yields:
      The staging directory's path (str).

    Raises:
      ContainerError: the parent directory does not exist, or `path` is a file or a
        non-empty directory (one line each; nothing was created).
    """
    path = os.path.abspath(local_path(path))
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise ContainerError(f"output directory {parent} does not exist; create it first")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise ContainerError(f"{path} exists and is not an empty directory; choose a new output directory")
    stage = os.path.join(parent, tmp_name(os.path.basename(path)))
    try:
        os.mkdir(stage)
    except OSError as exc:
        raise _write_error(path, exc) from None
    try:
        yield stage
        fsync_tree(stage)
        if os.path.isdir(path):
            os.rmdir(path)
        os.replace(stage, path)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    with contextlib.suppress(OSError):
        fsync_dir(parent)


# ---------------------------------------------------------------- replacing a directory whole
# A checkpoint directory is committed as a whole: the framework writes it into a hidden
# staging directory beside it, and two renames publish it (the previous directory, if any,
# moved aside first and removed last).  A kill before the renames leaves the previous
# checkpoint as it was; a kill between them leaves it aside, and `recover_directory` (run by
# the next save or load) moves it back.  Every save has its own token in these names, so two
# jobs saving to one place never write into each other's stage: the last to publish wins,
# whole, and the other one's rename fails.
STAGING_SUFFIX = ".jaxguard-staging"
OLD_SUFFIX = ".jaxguard-old"
_AUX = re.compile(r"\.(?P<name>.+)\.(?P<token>[0-9a-f]{12})(?P<suffix>\.jaxguard-staging|\.jaxguard-old)")


def new_token() -> str:
    """A fresh token naming one save's staging and aside directories (12 hex digits)."""
    return uuid.uuid4().hex[:12]


def _aux(final: str, token: str, suffix: str) -> str:
    final = os.path.normpath(os.fspath(final))
    return os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.{token}{suffix}")


def staging_path(final: str, token: str) -> str:
    """The hidden staging directory of one save of `final` (``parent/.NAME.TOKEN.jaxguard-staging``).

    Args:
      final: the checkpoint directory a save publishes.
      token: the save's `new_token` (the same on every rank of the job).

    Returns:
      The staging path (no checkpoint-naming pattern matches it: it starts with a dot).
    """
    return _aux(final, token, STAGING_SUFFIX)


def _age(path: str) -> float:
    """Seconds since anything directly in `path` (or `path` itself) was last modified."""
    newest = os.stat(path).st_mtime
    with contextlib.suppress(OSError):
        for entry in os.scandir(path):
            with contextlib.suppress(OSError):
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return time.time() - newest


def recover_directory(final: str) -> list:
    """Undo what interrupted commits of `final` left; the previous checkpoint comes back.

    A directory moved aside by a commit that stopped before publishing is renamed back
    (the newest, when several); aside directories of commits that published are removed;
    staging directories unmodified for `jaxguard.format.storage.STALE_TMP_SECONDS` are
    removed, younger ones (a save that stopped, or one still running in another job) named.

    Args:
      final: a checkpoint directory `commit_directory` publishes.

    Returns:
      One-line descriptions of what was restored, removed or left.
    """
    final = os.path.normpath(os.fspath(final))
    parent, name = os.path.dirname(final) or ".", os.path.basename(final)
    found = {OLD_SUFFIX: [], STAGING_SUFFIX: []}
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            m = _AUX.fullmatch(entry.name)
            if m and m["name"] == name and entry.is_dir(follow_symlinks=False):
                found[m["suffix"]].append(entry.path)
    done = []
    olds = sorted(found[OLD_SUFFIX], key=lambda p: os.stat(p).st_mtime)
    if olds and not os.path.exists(final):   # a commit stopped between its renames
        back = olds.pop()
        os.rename(back, final)
        fsync_dir(parent)
        done.append(f"restored {final} from {back} (a save stopped while publishing it)")
    for old in olds:
        shutil.rmtree(old, ignore_errors=True)
        done.append(f"removed {old} (the previous checkpoint of a save that published)")
    for stage in found[STAGING_SUFFIX]:
        age = _age(stage)
        if age > STALE_TMP_SECONDS:
            shutil.rmtree(stage, ignore_errors=True)
            done.append(f"removed {stage} (an unfinished save, {age / 3600:.1f} h old)")
        else:
            done.append(f"left {stage}: a save that stopped {age:.0f} s ago or is still running; removed once it "
                        f"is {STALE_TMP_SECONDS / 3600:g} h old")
    return done


def recover_directories(parent: str) -> list:
    """`recover_directory` for every checkpoint under `parent` that interrupted commits touched.

    Args:
      parent: the directory holding the checkpoint directories (a Trainer's output_dir).

    Returns:
      The descriptions of what was restored, removed or left.
    """
    names = set()
    with contextlib.suppress(OSError):
        names = {m["name"] for m in map(_AUX.fullmatch, os.listdir(parent)) if m}
    return [what for name in sorted(names) for what in recover_directory(os.path.join(parent, name))]


def commit_directory(stage: str, final: str, token: str) -> None:
    """Publish the finished staging directory `stage` as `final`, replacing what was there.

    Every file under `stage` is fsynced first; then the previous `final` (if any) is
    renamed aside, `stage` renamed to `final`, and the previous one removed.

    Durability contract (local filesystems, POSIX rename): a reader of `final` sees the
    previous complete directory or the new complete one, never a mix of their files.
    A process killed before the first rename leaves `final` as it was (and the hidden
    stage); killed between the renames, `final` is absent and the previous directory
    lies aside under this save's token until `recover_directory` renames it back; killed
    after the second rename, the new `final` is whole and durable (its files and the
    parent were fsynced) and the aside directory is removed by `recover_directory`.

    Args:
      stage: the directory the save wrote (its `staging_path` or a directory inside it).
      final: the checkpoint directory to publish.
      token: the save's token (names the aside directory).

    Raises:
      OSError: another job published `final` between the two renames (its checkpoint
        stands, whole; the previous one is removed by the next `recover_directory`).
    """
    final = os.path.normpath(os.fspath(final))
    fsync_tree(stage)
    old = _aux(final, token, OLD_SUFFIX)
    if os.path.exists(final):
        os.rename(final, old)
    os.rename(stage, final)
    fsync_dir(os.path.dirname(final) or ".")
    if os.path.exists(old):
        shutil.rmtree(old)


def atomic_write(path, data: bytes, *, storage_options: dict | None = None) -> None:
    """Write `data` to a local path or fsspec URL, all-or-nothing (module docstring).

    Args:
      path: a local path, ``file://`` URL or any fsspec URL (``s3://bucket/key``, ...).
      data: the complete bytes of the object.
      storage_options: keyword arguments for the fsspec filesystem (``endpoint_url``, ...).

    Raises:
      ContainerError: the local directory does not exist, the write failed (one line: a
        full disk, ...; the target is as it was), the filesystem is unknown, or the store
        reports a size different from ``len(data)`` after the write.
    """
    if not is_url(path):
        return atomic_write_with(path, lambda fh: fh.write(data))
    fs, key = _fs(path, storage_options)
    data = bytes(data)
    if _protocols(fs) & ATOMIC_PUT:
        try:
            fs.pipe_file(key, data)
        except FileNotFoundError:
            raise ContainerError(f"{path}: the bucket or container does not exist; create it first") from None
        except OSError as exc:
            raise _write_error(path, exc) from None
    else:
        parent, name = key.rsplit("/", 1) if "/" in key else ("", key)
        tmp = f"{parent}/{tmp_name(name)}" if parent else tmp_name(name)
        try:
            fs.pipe_file(tmp, data)
            fs.mv(tmp, key)
        except BaseException as exc:
            with contextlib.suppress(Exception):
                fs.rm_file(tmp)
            if isinstance(exc, OSError):
                raise _write_error(path, exc) from None
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


def read_range(path, start: int, end: int, *, storage_options: dict | None = None) -> bytes:
    """Bytes ``[start, end)`` of a local file or fsspec object (fewer when it is shorter).

    Args:
      path: a local path or an fsspec URL.
      start, end: the byte range.
      storage_options: keyword arguments for the fsspec filesystem (URLs only).

    Returns:
      The bytes read.

    Raises:
      ContainerError: the object does not exist or cannot be read (one line naming it).
    """
    try:
        if not is_url(path):
            with open(local_path(path), "rb") as fh:
                fh.seek(start)
                return fh.read(end - start)
        fs, key = _fs(path, storage_options)
        return fs.cat_file(key, start=start, end=end)
    except FileNotFoundError:
        raise ContainerError(f"{path}: no such file") from None
    except OSError as exc:
        raise ContainerError(f"cannot read {path}: {exc.strerror or exc}") from None


def is_dir(path) -> bool:
    """Whether a local path or fsspec URL is a directory (a prefix with objects under it).

    Args:
      path: a local path or an fsspec URL.

    Returns:
      bool; False for a file, a missing path or an unreachable URL.
    """
    try:
        if not is_url(path):
            return os.path.isdir(local_path(path))
        fs, key = _fs(path)
        return bool(fs.isdir(key))
    except Exception:  # noqa: BLE001 - an unreachable URL is not a directory
        return False


def mkdir(path) -> None:
    """Create a directory (and its parents); an existing one is fine.

    Args:
      path: a local path or an fsspec URL (object stores have no directories: a no-op there).

    Raises:
      ContainerError: it cannot be created (one line with the reason).
    """
    try:
        if not is_url(path):
            os.makedirs(local_path(path), exist_ok=True)
            return
        fs, key = _fs(path)
        fs.makedirs(key, exist_ok=True)
    except OSError as exc:
        raise ContainerError(f"cannot create directory {path}: {exc.strerror or exc}") from None


def listdir(path) -> list:
    """The names directly under a directory (files and subdirectories), sorted.

    Args:
      path: a local path or an fsspec URL.

    Returns:
      A sorted list of names; empty for a missing directory.
    """
    if not is_url(path):
        try:
            return sorted(os.listdir(local_path(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []
    fs, key = _fs(path)
    try:
        got = fs.ls(key, detail=False, refresh=True) if "refresh" in _ls_args(fs) else fs.ls(key, detail=False)
    except FileNotFoundError:
        return []
    return sorted({str(x).rstrip("/").rsplit("/", 1)[-1] for x in got if str(x).rstrip("/") != key.rstrip("/")})


def _ls_args(fs):
    import inspect
    try:
        return inspect.signature(fs.ls).parameters
    except (TypeError, ValueError):
        return {}


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
