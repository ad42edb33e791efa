"""The guard's fixed-shape kernels, kept across processes as `jax.export` artifacts.

XLA's persistent compilation cache spares a fresh process the *compilation* of the
guard's programs, not their *tracing*: the cell bound (five refinement levels), the
early reject, the closed-form tier and the proposal are traced again by every process,
seconds of Python per `jaxguard compress`.  `call(fn, *args, **static)` runs a jitted
kernel through a serialized `jax.export.Exported` of it when a cache directory is
enabled (the CLI enables one next to its XLA cache): the first process exports and
stores it, later ones deserialize it (no tracing; the executable itself still comes from
the XLA cache).  Beside each artifact the compiled executable is kept too (``exe/``,
`jax.experimental.serialize_executable`), keyed also by this CPU's model and feature
flags (XLA compiles for the host's instruction set): a later process on the same kind of
machine loads it directly, skipping the lowering of the exported module, the XLA cache
lookup and the LAPACK initialisation the lowering triggers (about 1 s of every
`jaxguard compress`, measured at commit 729597b).  With no directory enabled, or without the
``flatbuffers`` package jax needs to serialize, it is exactly ``fn(*args, **static)``.

Numerical contract
------------------
The exported module is the StableHLO of ``jax.jit(fn)`` lowered for these argument
shapes and dtypes on this backend, so it computes what ``fn`` computes; the key of an
artifact names the kernel, the argument tree, shapes, dtypes and static arguments, the
backend, the jax/jaxlib versions, the machine and a hash of every source file of
`jaxguard.core`, so a changed bound, another install or another device never reuses a
stale program.  A stored executable is the compilation of that same module, so it
computes the same bits; one that fails to load or to run on these arguments is not
used (the exported module runs instead).  tests/test_programs.py checks bitwise equality with the direct call.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import tempfile
import threading

_state = {"dir": None, "programs": {}, "broken": False, "max_bytes": None, "prune_root": None, "pruned": False}
# one lock per program: the encode threads start on the same kernels at once, and each
# loaded its own copy of the executable (6 of 45 loads of a GPT-2 compress, 0.5 s CPU)
_loading: dict = {}
_loading_lock = threading.Lock()


def enable(directory, *, max_bytes=None, prune_root=None) -> None:
    """Keep exported kernels under `directory` (created on first write); None disables.

    Args:
      directory: a local directory, or None.
      max_bytes: bound the cache's files to this many bytes (None: unbounded).  Every
        artifact a process uses has its modification time renewed; the first process that
        stores a new one (a new jaxguard, jax or machine: a compile) then removes the
        least recently used ones until the cache holds 3/4 of `max_bytes` (`prune`).
      prune_root: the directory that bound applies to (default `directory`), e.g. the
        parent of several versions' directories.
    """
    _state["dir"] = None if directory is None else os.fspath(directory)
    _state["max_bytes"] = max_bytes
    _state["prune_root"] = None if prune_root is None else os.fspath(prune_root)
    _state["pruned"] = False
    _state["programs"].clear()


ARTIFACT_SUFFIXES = (".jaxexport", ".xla")
STALE_TMP_SECONDS = 24 * 3600   # a ``.tmp`` older than this was left by a killed process


def prune(root, max_bytes: int, *, keep_fraction: float = 0.75) -> int:
    """Remove the least recently used cache artifacts under `root` until they take at most
    ``keep_fraction * max_bytes`` (nothing when they take no more than `max_bytes`).

    Only this module's files are touched (``*.jaxexport``, ``*.xla``, and ``*.tmp`` left
    for a day); the order is by modification time, which `call` renews on every use.  A
    concurrent process that loses a file it was about to read exports it again.

    Args:
      root: a directory (missing: nothing to do).
      max_bytes: the bound, in bytes.
      keep_fraction: what a prune leaves, as a fraction of `max_bytes`.

    Returns:
      The bytes removed.
    """
    import time
    files, total, removed = [], 0, 0
    now = time.time()
    for base, _dirs, names in os.walk(root):
        for name in names:
            path = os.path.join(base, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            if name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_SECONDS:
                removed += _remove(path, st.st_size)
            elif name.endswith(ARTIFACT_SUFFIXES):
                files.append((st.st_mtime, st.st_size, path))
                total += st.st_size
    if total <= max_bytes:
        return removed
    for _mtime, size, path in sorted(files):
        if total <= keep_fraction * max_bytes:
            break
        freed = _remove(path, size)
        total -= freed
        removed += freed
    return removed


def _remove(path, size) -> int:
    try:
        os.remove(path)
        return size
    except OSError:
        return 0


def _used(path) -> None:
    """Renew `path`'s modification time: `prune` removes the least recently used first."""
    try:
        os.utime(path)
    except OSError:
        pass


def _stored() -> None:
    """After a new artifact was written: once a process, bound the cache (`enable`)."""
    if _state["max_bytes"] is None or _state["pruned"]:
        return
    _state["pruned"] = True
    try:
        prune(_state["prune_root"] or _state["dir"], _state["max_bytes"])
    except OSError:
        pass


def enabled() -> bool:
    """Whether `call` goes through exported programs."""
    return _state["dir"] is not None and not _state["broken"]


@functools.lru_cache(maxsize=1)
def _code_tag() -> str:
    import jax
    import jaxlib
    h = hashlib.sha256(f"{jax.__version__}|{jaxlib.__version__}|{platform.machine()}|{jax.default_backend()}".encode())
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as fh:
                h.update(name.encode() + b"\0" + fh.read())
    return h.hexdigest()


@functools.lru_cache(maxsize=1)
def _host_tag() -> str:
    """This CPU's model and feature flags, and ``XLA_FLAGS``: a compiled CPU executable is
    only reused on a host with the same instruction set (a home directory shared by other
    machines) and by a process compiling with the same XLA options (``--xla_cpu_max_isa``,
    ``--xla_cpu_enable_fast_math``: the executable is what they made of the program)."""
    info = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
        info = "|".join(next((ln for ln in lines if ln.startswith(k)), "") for k in ("vendor_id", "model name", "flags"))
    except OSError:
        pass
    return hashlib.sha256(f"{platform.processor()}|{info}|{os.environ.get('XLA_FLAGS', '')}".encode()).hexdigest()[:16]


def call(fn, *args, **static):
    """``fn(*args, **static)`` for a `jax.jit` kernel of the core, through its exported
    program when `enable` set a directory.

    Args:
      fn: a jitted function of arrays (pytrees of arrays) with keyword-only static arguments.
      *args: its array arguments (numpy or jax arrays, or pytrees of them).
      **static: its static arguments (hashable, with a stable ``repr``).

    Returns:
      What ``fn`` returns.
    """
    if not enabled():
        return fn(*args, **static)
    import jax
    leaves, tree = jax.tree_util.tree_flatten(args)
    # this process: hashable, no strings built (dtype objects, not their names)
    fast_key = (fn, tree, tuple((getattr(x, "shape", ()), getattr(x, "dtype", type(x))) for x in leaves),
                tuple(sorted(static.items())))
    prog = _state["programs"].get(fast_key)
    if prog is None:
        with _loading_lock:
            lock = _loading.setdefault(fast_key, threading.Lock())
        with lock:
            prog = _state["programs"].get(fast_key)
            if prog is None:
                avals = tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__)))
                              for x in leaves)
                key = (f"{fn.__module__}.{getattr(fn, '__qualname__', fn.__name__)}", str(tree), avals,
                       tuple(sorted((k, repr(v)) for k, v in static.items())))
                try:
                    prog = _load_or_export(fn, key, leaves, tree, static)
                except ImportError:   # no flatbuffers: jax cannot serialize; trace as before
                    _state["broken"] = True
                    return fn(*args, **static)
                _state["programs"][fast_key] = prog
    return prog(*leaves)


def _load_or_export(fn, key, leaves, tree, static):
    """A jitted callable of the flat argument leaves (so the artifact's argument tree is
    a plain tuple: the core's NamedTuples need no serialization registry)."""
    name = hashlib.sha256((_code_tag() + repr(key)).encode()).hexdigest()[:40]
    path = os.path.join(_state["dir"], name + ".jaxexport")
    exe_path = os.path.join(_state["dir"], "exe", f"{name}-{_host_tag()}.xla")
    loaded = _load_executable(exe_path)
    if loaded is not None:
        _used(path)   # its fallback: kept as long as the executable is
        return _with_fallback(loaded, lambda: _load_or_export_module(fn, path, leaves, tree, static))
    jitted = _load_or_export_module(fn, path, leaves, tree, static)
    compiled = _fresh_executable(jitted, leaves, exe_path)
    if compiled is None:
        return jitted
    return _with_fallback(compiled, lambda: jitted)


def _fresh_executable(jitted, leaves, exe_path):
    """``jitted`` compiled anew for these leaves, stored when it survives a round trip.

    An executable that jax's persistent XLA cache handed back serializes without its
    machine code (a later process fails with "Function ... not found"), so it is compiled
    under a module name no cache holds; and it is only stored when its deserialized copy,
    run on these very arguments, returns the same bits."""
    import time

    import jax
    import numpy as np
    from jax.experimental import serialize_executable

    def fresh(*xs):
        return jitted(*xs)
    fresh.__name__ = fresh.__qualname__ = f"jaxguard_exe_{os.getpid()}_{time.time_ns()}"
    try:
        compiled = jax.jit(fresh).lower(*_shapes(leaves)).compile()
        data = serialize_executable.serialize(compiled)
        copy = serialize_executable.deserialize_and_load(*data)
        want, got = (jax.tree_util.tree_leaves(f(*leaves)) for f in (compiled, copy))
        if len(want) != len(got) or not all(np.array_equal(np.asarray(w).view(np.uint8), np.asarray(g).view(np.uint8))
                                            for w, g in zip(want, got)):
            return compiled
    except Exception:  # noqa: BLE001 - the executable is an optimisation only
        return None
    _store_executable(exe_path, data)
    return compiled


def _shapes(leaves):
    import jax
    return [jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)) for x in leaves]


def _with_fallback(compiled, slow):
    """``compiled(*leaves)``; arguments it was not compiled for (a weakly typed scalar, a
    leaf on another device) go through the jitted exported module instead."""
    state = {}

    def run(*leaves):
        if "slow" not in state:
            try:
                return compiled(*leaves)
            except (TypeError, ValueError):
                state["slow"] = slow()
        return state["slow"](*leaves)
    return run


def _load_executable(exe_path):
    """The stored executable, or None.  It is a pickle (`serialize_executable`'s format), so
    only a file of this user's that no one else may write is read."""
    try:
        st = os.stat(exe_path)
    except OSError:
        return None
    if (hasattr(os, "getuid") and st.st_uid != os.getuid()) or st.st_mode & 0o022:
        return None
    try:
        import pickle

        from jax.experimental import serialize_executable
        with open(exe_path, "rb") as fh:
            payload, in_tree, out_tree = pickle.load(fh)
        loaded = serialize_executable.deserialize_and_load(payload, in_tree, out_tree)
    except Exception:  # noqa: BLE001 - a damaged or foreign executable is rebuilt, never trusted
        return None
    _used(exe_path)
    return loaded


def _store_executable(exe_path, serialized):
    try:
        import pickle
        data = pickle.dumps(serialized)
        os.makedirs(os.path.dirname(exe_path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(exe_path), suffix=".tmp")
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.replace(tmp, exe_path)
    except Exception:  # noqa: BLE001 - not every backend serializes executables; a cache only
        return
    _stored()


def _load_or_export_module(fn, path, leaves, tree, static):
    """``jax.jit`` of the exported module at `path`, exported and stored first if absent."""
    import jax
    from jax import export
    exported = None
    if os.path.exists(path):
        try:
            with open(path, "rb") as fh:
                exported = export.deserialize(bytearray(fh.read()))
            _used(path)
        except ImportError:
            raise
        except Exception:  # noqa: BLE001 - a damaged artifact is rebuilt, never trusted
            exported = None
    if exported is None:
        def flat(*xs):
            return fn(*jax.tree_util.tree_unflatten(tree, xs), **static)
        exported = export.export(jax.jit(flat))(*_shapes(leaves))
        data = exported.serialize()
        try:
            os.makedirs(_state["dir"], exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=_state["dir"], suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)   # atomic: a concurrent process reads a whole file or none
            _stored()
        except OSError:
            pass   # a cache is an optimisation only
    return jax.jit(exported.call)
