"""Writing and committing a sharded save: each process's file and index under the save's
names, the manifest merged from the indexes and published in one atomic replace (the commit
point), and the clean-up of what no manifest names any more.  `save` is the sharded
`jaxguard.save` (the package docstring)."""
from __future__ import annotations

__all__ = ["make_manifest", "commit_manifest", "remove_unnamed", "write_process_files", "remove_process_files",
           "save", "prepare_directory", "write_and_commit"]

import contextlib
import json
import os
import time

import jax

from jaxguard import audit
from jaxguard.core.config import GuardSpec, UpdateRequest
from jaxguard.errors import CheckpointError
from jaxguard.format import storage
from jaxguard.format.manifest import (MANIFEST, SCHEMA, VERSION, check_coverage, check_files, file_name, index_name,
                                      is_manifest_tmp, owned_save_id, path_text, read_manifest)
from jaxguard.sharded.planning import build_local, plan_local, plan_state
from jaxguard.sharded.processes import barrier, failed_processes, new_save_id


def make_manifest(directory, common: dict, process_count: int, save_id: str | None = None) -> dict:
    """Merge every process's index of save `save_id` into the manifest dict.

    Args:
      directory: the checkpoint directory.
      common: the shared meta (`common_meta`).
      process_count: how many processes wrote.
      save_id: the save's id (None: the older layout's names).

    Returns:
      The manifest (save_id, files, shards by entry, summed totals under ``"summary"``).

    Raises:
      CheckpointError: a process's index is missing (it did not finish).
    """
    d = path_text(directory)
    files, shards, totals = {}, {}, audit.new_totals()
    for pid in range(process_count):
        ipath = storage.join(d, index_name(pid, save_id))
        if not storage.exists(ipath):
            raise CheckpointError(f"{ipath} is missing: process {pid} did not finish writing its shards")
        idx = json.loads(bytes(storage.read_bytes(ipath)))
        files[idx["file"]] = {"bytes": idx["bytes"], "sha256": idx["sha256"], "tables": idx["tables"]}
        for sh in idx["shards"]:
            shards.setdefault(sh.pop("entry"), []).append({"file": idx["file"], **sh})
        audit.add_stats(totals, {k: idx["totals"].get(k, 0) for k in totals})
    man = {"schema": SCHEMA, "version": VERSION, **common, "process_count": process_count, "files": files,
           "shards": shards, "summary": totals}
    if save_id is not None:
        man["save_id"] = save_id
    return man


def _current_save_id(d):
    """The save id of the manifest at `d` now ("" for an older-layout one, None for none or unreadable)."""
    try:
        man = json.loads(bytes(storage.read_bytes(storage.join(d, MANIFEST))))
        return str(man.get("save_id") or "") if isinstance(man, dict) else None
    except Exception:  # noqa: BLE001 - a missing or broken manifest is no committed save
        return None


def commit_manifest(directory, common: dict, process_count: int, save_id: str | None = None) -> dict:
    """Publish a sharded save: check it, replace ``manifest.json`` in one atomic write (the
    commit point), then remove the per-process indexes and every file no manifest names.

    Args:
      directory, common, process_count, save_id: as `make_manifest`.

    Returns:
      The manifest written.

    Raises:
      CheckpointError: an index or file is missing, the shards do not tile every leaf, or a
        save that started later has already committed to this path (this one is dropped,
        that checkpoint kept).
      ContainerError: the manifest could not be written (the previous one is intact).
    """
    d = path_text(directory)
    man = make_manifest(d, common, process_count, save_id)
    check_coverage(man, d)
    with _commit_lock(d):   # two jobs: check, replace and clean up one after the other
        check_files(man, d)
        cur = _current_save_id(d)
        if save_id is not None and cur and cur > save_id:
            raise CheckpointError(f"{d}: a save that started later ({cur}) committed to this path while this one "
                                  f"({save_id}) ran; this save is dropped and that checkpoint kept")
        storage.atomic_write(storage.join(d, MANIFEST), json.dumps(man, separators=(",", ":")).encode())
        for pid in range(process_count):
            try:
                storage.remove(storage.join(d, index_name(pid, save_id)))
            except Exception:  # noqa: BLE001 - committed: a stale index is only garbage for the next save
                pass
        if save_id is not None:
            remove_unnamed(d, save_id)
    return man


@contextlib.contextmanager
def _commit_lock(d):
    """An exclusive lock on a local checkpoint directory's commit step (``flock`` on the
    directory itself: no file is added, and the lock is released when the process dies,
    so a killed primary never blocks the next save).  Without it,
    a save that checked the manifest just before another job replaced it and removed the
    older save's files could publish a manifest naming removed files.  fsspec URLs have
    no such lock: one job per path there (docs/format.md)."""
    if storage.is_url(d):
        yield
        return
    import fcntl
    fd = os.open(storage.local_path(d), os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def remove_unnamed(directory, save_id: str) -> list:
    """Remove what the manifest of save `save_id` has made garbage: process files, indexes
    and temporary files of the older layout and of every save that started before it, and
    temporary manifests.  Files of a save that started later (still running) stay.

    Args:
      directory: the checkpoint directory.
      save_id: the id of the save whose manifest was just committed.

    Returns:
      The names removed.
    """
    d = path_text(directory)
    gone = []
    for name in storage.listdir(d):
        sid = owned_save_id(name)
        if sid is False:
            if not is_manifest_tmp(name):
                continue
        elif sid is not None and (sid > save_id or (sid == save_id and not name.startswith("."))):
            continue
        try:
            storage.remove(storage.join(d, name))
            gone.append(name)
        except Exception:  # noqa: BLE001 - a file another cleaner removed first
            pass
    return gone


def write_process_files(directory, data: bytes, index: dict, process: int, save_id: str | None = None) -> None:
    """Write one process's container and its index, each atomically, under the save's names.

    Args:
      directory: the checkpoint directory.
      data, index: from `build_local`.
      process: the process index.
      save_id: the save's id (`new_save_id`); None writes the older layout's names.

    Raises:
      ContainerError: a write failed (one line, e.g. a full disk); nothing the manifest names is touched.
    """
    d = path_text(directory)
    fname = file_name(process, save_id)
    storage.atomic_write(storage.join(d, fname), data)
    storage.atomic_write(storage.join(d, index_name(process, save_id)), json.dumps({**index, "file": fname}).encode())


def remove_process_files(directory, process: int, save_id: str) -> None:
    """Remove one process's file and index of save `save_id` (a save that failed), best effort.

    Args:
      directory: the checkpoint directory.
      process: the process index.
      save_id: the failed save's id.
    """
    d = path_text(directory)
    for name in (file_name(process, save_id), index_name(process, save_id)):
        try:
            storage.remove(storage.join(d, name))
        except Exception:  # noqa: BLE001 - cleaning up after a failure must not hide it
            pass


def save(path, opt_state, params, *, update: UpdateRequest | None, spec: GuardSpec, include_params=False,
         primary=0) -> dict:
    """Sharded `jaxguard.save` (module docstring); every process calls it with the same `path`.

    Args:
      path: the checkpoint directory (the same on every process).
      opt_state, params, include_params: as `jaxguard.save`.
      update: the save's `UpdateRequest` (`jaxguard.save` builds it from lr, weight_decay,
        betas, eps, op_model, tx, uncertifiable).
      spec: the save's `GuardSpec` (`jaxguard.save` builds it from its keywords).
      primary: the process that writes host leaves and commits the manifest.

    Returns:
      This process's summary (its share: coordinates, escapes, container_bytes of its
      file, ...) with the whole checkpoint's totals under ``"total"``.

    Raises:
      CheckpointError, UnsupportedOptimizerError, ConfigError: as `jaxguard.save`; a
        file at `path`.
    """
    t0 = time.perf_counter()
    d = path_text(path)
    plan = plan_state(opt_state, params, update=update, spec=spec)
    prepare_directory(d, primary)
    try:
        local = plan_local(plan, opt_state, params, spec=spec, include_params=include_params, primary=primary)
    except jax.errors.JaxRuntimeError as exc:   # a collective of the certification failed: a process died
        raise CheckpointError(f"{d}: a collective failed while certifying the shards ({_first_line(exc)}); another "
                              "process of this job probably stopped; nothing was written, the previous "
                              "checkpoint there is kept") from None
    return write_and_commit(d, local.items, local.totals, local.common, primary=primary, t0=t0)


def prepare_directory(d, primary: int = 0) -> None:
    """Create the directory (the previous checkpoint in it, if any, is left as it is: a
    save writes new names and commits by replacing the manifest), then wait for every process.

    Args:
      d: the checkpoint directory.
      primary: the process that creates it.

    Raises:
      CheckpointError: `d` is a file.
    """
    d = path_text(d)
    if storage.exists(d) and not storage.is_dir(d):
        raise CheckpointError(f"{d} is a file; a sharded checkpoint is a directory: pass a new path or remove it")
    if jax.process_index() == primary:
        storage.mkdir(d)
    try:
        barrier(f"jaxguard_save_begin:{d}")
    except jax.errors.JaxRuntimeError as exc:   # a process died before the save began
        raise CheckpointError(f"{d}: another process of this job stopped before the save began "
                              f"({str(exc).strip().splitlines()[0][:160] if str(exc).strip() else exc!r}); "
                              "nothing was written, the previous checkpoint there is kept") from None


def _first_line(exc) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:160] if text else ''}"


def _give_up(d, pid, sid, err, others_failed: str):
    """A step of the save failed somewhere: remove this process's files of it and raise its
    own error, or the line saying which other process failed."""
    remove_process_files(d, pid, sid)
    if err is not None:
        raise err
    raise CheckpointError(others_failed)


def write_and_commit(d, items, totals, common, *, primary=0, t0=None, save_id=None) -> dict:
    """Write this process's file and index under a fresh save id, agree that every process
    wrote, the primary commits the manifest, agree that it did.

    A process whose write fails raises its own error; every other process raises one
    `CheckpointError` line naming it; the files of the failed save are removed and the
    previous checkpoint at `d` is untouched.

    Args:
      d: the checkpoint directory.
      items, totals: from `encode_local` (or the jitted hook).
      common: from `common_meta`.
      primary: the process that commits.
      t0: when the save started (for ``encode_seconds``).
      save_id: the save's id (default: `new_save_id`, a collective).

    Returns:
      As `save`.

    Raises:
      CheckpointError, ContainerError: this or another process could not write or commit.
    """
    d = path_text(d)
    t0 = time.perf_counter() if t0 is None else t0
    pid, n = jax.process_index(), jax.process_count()
    try:
        sid = save_id or new_save_id(primary)
    except jax.errors.JaxRuntimeError as exc:   # the broadcast failed: a process died before writing
        raise CheckpointError(f"{d}: another process of this job stopped before the save began writing "
                              f"({_first_line(exc)}); nothing was written, the previous checkpoint there is "
                              "kept") from None
    extra = {k: common[k] for k in ("op_model", "tau", "clip", "codec")}
    err, data = None, b""
    try:
        data, index = build_local(items, totals, process=pid, extra_header=extra)
        write_process_files(d, data, index, pid, sid)
    except Exception as exc:  # noqa: BLE001 - every process must learn of it before anyone commits
        err = exc
    try:
        failed = failed_processes(err is None)
    except Exception as exc:  # noqa: BLE001 - a process of the job died: the collective fails
        remove_process_files(d, pid, sid)
        raise CheckpointError(f"{d}: another process of this job stopped before every shard was written "
                              f"({_first_line(exc)}); nothing was committed, the previous checkpoint there is "
                              "kept") from None
    if failed:
        _give_up(d, pid, sid, err, f"{d}: process{'es' if len(failed) > 1 else ''} {', '.join(map(str, failed))} "
                 "could not write its shards; nothing was committed, the previous checkpoint there is kept")
    man = None
    if pid == primary:
        try:
            man = commit_manifest(d, common, n, sid)
        except Exception as exc:  # noqa: BLE001 - as above
            err = exc
    try:
        failed = failed_processes(err is None)
    except Exception as exc:  # noqa: BLE001 - as above; the primary may have committed
        if man is None:   # files stay (the primary may still be committing); the next save removes them
            raise CheckpointError(f"{d}: another process of this job stopped while the primary committed "
                                  f"({_first_line(exc)}); `jaxguard.load` gives the last committed checkpoint") from None
        failed = []
    if failed:
        _give_up(d, pid, sid, err, f"{d}: the primary process {primary} could not commit {MANIFEST}; nothing was "
                 "committed, the previous checkpoint there is kept")
    if man is None:
        man = read_manifest(d)
        if man.get("save_id") != sid:
            raise CheckpointError(f"{d}: {MANIFEST} is another save's ({man.get('save_id')}) right after this one "
                                  f"({sid}) committed; two jobs are saving to this path")
    totals["encode_seconds"] = time.perf_counter() - t0
    s = audit.compression_summary(totals, len(data))
    s.update(process_index=pid, process_count=n, total=man["summary"], save_id=sid,
             checkpoint_bytes=sum(f["bytes"] for f in man["files"].values()))
    return s
