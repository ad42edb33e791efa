"""The guard's fixed-shape kernels, compiled once per machine and kept across processes.

A fresh process pays for every guard kernel it runs: tracing, lowering and XLA's
compilation, about 0.1-3 s each (a dozen kernels for the smallest state).  `call(fn,
*args, **static)` runs a jitted kernel of the core through its compiled executable,
stored on disk by the first process that needed it (`jax.experimental.serialize_executable`)
and loaded by every later one: no tracing, no lowering, no compilation.  `prepare`
obtains many kernels at once, their compilations on a thread each (XLA compiles outside
the interpreter lock), before the encode runs them.

The cache is on by default for the library and the CLI alike, in
``$XDG_CACHE_HOME/jaxguard/programs`` (``~/.cache/jaxguard/programs``), bounded by
``JAXGUARD_PROGRAM_CACHE_MB`` megabytes (`DEFAULT_MB`; the least recently used go first,
`prune`); ``JAXGUARD_PROGRAM_CACHE_MB=0`` turns it off (every process compiles, as `fn`
does), a negative value lifts the bound.  `enable` points it elsewhere or turns it off
for this process.

Numerical contract
------------------
A stored executable is XLA's compilation of ``jax.jit(fn)`` lowered for these argument
shapes and dtypes on this backend, so it computes what ``fn`` computes, bit for bit
(tests/core/test_programs.py).  Its key names the kernel, the argument tree, shapes, dtypes and
static arguments, the backend, the jax/jaxlib versions, a hash of every source file of
`jaxguard.core` (a changed bound never reuses a stale program), this CPU's model,
feature flags and ``XLA_FLAGS`` (XLA compiles for the host's instruction set and options;
the host device count alone is left out), and the one device the program is lowered for
and loaded onto (tests/core/test_program_cache_devices.py).
A file is used only if it is this user's, writable by no one else (it holds a pickle), its
SHA-256 matches its contents and the key written inside it is the one looked up; anything
else (a damaged, truncated, foreign or renamed entry) is ignored and replaced, as is one
that loads but fails on its first call.  With the cache off, or on any failure of it, the
call is exactly ``fn(*args, **static)``.
"""
from __future__ import annotations

__all__ = ["CACHE_ENV", "DEFAULT_MB", "SUFFIX", "MAGIC", "STALE_TMP_SECONDS", "cache_bytes", "cache_root", "enable",
           "enabled", "counts", "prune", "call", "Prepared", "prepare", "settle", "wrap_entry", "unwrap_entry"]

import concurrent.futures
import functools
import hashlib
import os
import platform
import threading

from jaxguard.errors import ConfigError

CACHE_ENV = "JAXGUARD_PROGRAM_CACHE_MB"
DEFAULT_MB = 512   # ~30 MB of executables a jaxguard/jax version and machine (GPT-2's compress loads ~25)
SUFFIX = ".xla"
MAGIC = b"jaxguard-program-1\n"
STALE_TMP_SECONDS = 24 * 3600   # a ``.tmp`` older than this was left by a killed process

_DEFAULT = object()   # `enable` not called: the environment decides at first use
_state = {"dir": _DEFAULT, "programs": {}, "plans": set(), "max_bytes": None, "prune_root": None, "pruned": False}
_counts = {"loaded": 0, "compiled": 0}   # this process's programs, by where they came from (`counts`)
# one lock per program: the encode threads and `prepare` start on the same kernels at once,
# and each loaded its own copy of the executable (6 of 45 loads of a GPT-2 compress, 0.5 s CPU)
_loading: dict = {}
_loading_lock = threading.Lock()
# kernels `prepare` queued that no thread has started, in queue order: a thread about to
# wait for a kernel another thread is making makes queued ones from the tail meanwhile (the
# pool takes them from the head), so a cold save's two cores both compile (on a small
# state the guard's thread sat idle for 3 s while one pool thread compiled its stages in turn)
_queued: dict = {}
# preparations left to finish after the work that started them returned (`prepare(...,
# background=True)`), until `settle`; `_later`: the keys of theirs still queued, which a
# waiting thread does not make meanwhile
_background: list = []
_background_lock = threading.Lock()
_later: set = set()


def cache_bytes() -> int | None:
    """The cache's bound from ``JAXGUARD_PROGRAM_CACHE_MB``.

    Returns:
      Bytes (default `DEFAULT_MB` MB), 0 (no cache) or None (unbounded: a negative value).

    Raises:
      ConfigError: the variable is not an integer (one line naming it and the fix).
    """
    raw = os.environ.get(CACHE_ENV, "").strip()
    if not raw:
        return DEFAULT_MB << 20
    try:
        mb = int(raw)
    except ValueError:
        raise ConfigError(f"{CACHE_ENV}={raw!r} is not an integer; set megabytes (default {DEFAULT_MB}, "
                          "0 for no program cache, -1 for no bound)") from None
    return None if mb < 0 else mb << 20


def cache_root() -> str:
    """Returns: the directory every version's programs live under (``$XDG_CACHE_HOME``
    or ``~/.cache``, then ``jaxguard/programs``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxguard", "programs")


def enable(directory=_DEFAULT, *, max_bytes=None, prune_root=None) -> None:
    """Keep compiled kernels under `directory` (created on first write); None disables;
    no argument: the default (`cache_root`, bounded by ``JAXGUARD_PROGRAM_CACHE_MB``).

    Args:
      directory: a local directory, None, or nothing (the default cache).
      max_bytes: bound the cache's files to this many bytes (None: unbounded).  Every
        program a process uses has its modification time renewed; the first process that
        stores a new one (a new jaxguard, jax or machine: a compile) then removes the
        least recently used ones until the cache holds 3/4 of `max_bytes` (`prune`).
      prune_root: the directory that bound applies to (default `directory`), e.g. the
        parent of several versions' directories.

    Raises:
      ConfigError: no directory given and ``JAXGUARD_PROGRAM_CACHE_MB`` is not an integer.
    """
    if directory is _DEFAULT:
        limit = cache_bytes()
        root = cache_root()
        directory = None if limit == 0 else os.path.join(root, _version_tag())
        max_bytes, prune_root = limit, root
    _state["dir"] = None if directory is None else os.fspath(directory)
    _state["max_bytes"] = max_bytes
    _state["prune_root"] = None if prune_root is None else os.fspath(prune_root)
    _state["pruned"] = False
    _state["programs"].clear()
    _state["plans"].clear()


def _version_tag() -> str:
    import jax
    import jaxlib
    return f"jax{jax.__version__}-jaxlib{jaxlib.__version__}-{platform.machine()}"


def enabled() -> bool:
    """Whether `call` goes through stored executables (the default, read from the
    environment at first use, unless `enable` said otherwise)."""
    if _state["dir"] is _DEFAULT:
        enable()
    return _state["dir"] is not None


def counts() -> dict:
    """Returns: ``{"loaded": n, "compiled": n}``, the programs this process loaded from the
    cache and those it compiled (and stored) while the cache was on, since it started."""
    return dict(_counts)


def prune(root, max_bytes: int, *, keep_fraction: float = 0.75) -> int:
    """Remove the least recently used programs under `root` until they take at most
    ``keep_fraction * max_bytes`` (nothing when they take no more than `max_bytes`).

    Only this module's files are touched (``*.xla``, the ``*.jaxexport`` earlier versions
    kept, and ``*.tmp`` left for a day); the order is by modification time, which
    `call` renews on every use.  A concurrent process that loses a file it was about to
    read compiles it again.

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
            elif name.endswith((SUFFIX, ".jaxexport")):
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


def _stored() -> None:
    """After a new program was written: once a process, bound the cache (`enable`)."""
    if _state["max_bytes"] is None or _state["pruned"]:
        return
    _state["pruned"] = True
    try:
        prune(_state["prune_root"] or _state["dir"], _state["max_bytes"])
    except OSError:
        pass


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


# XLA_FLAGS that change nothing XLA emits for a program: how many host devices the process
# has (every stored program is lowered for one device, `_program_device`, whatever that
# count; jax leaves the flag out of its own compilation cache's key too).  With it in the
# key, each rank of the multi-process tests compiled every guard program again.
_FLAGS_NOT_IN_KEY = ("--xla_force_host_platform_device_count",)


def _keyed_xla_flags(flags: str) -> str:
    """``XLA_FLAGS`` less `_FLAGS_NOT_IN_KEY`, the others in their order (a repeated flag's
    last value is the one XLA takes)."""
    return " ".join(f for f in flags.split() if f.split("=", 1)[0] not in _FLAGS_NOT_IN_KEY)


def _program_device():
    """The one device a stored program is lowered for and loaded onto: jax's default
    (``jax_default_device``, else this process's first local device)."""
    import jax
    dev = jax.config.jax_default_device
    if isinstance(dev, str):
        return jax.local_devices(backend=dev)[0]
    return dev or jax.local_devices()[0]


@functools.lru_cache(maxsize=1)
def _cpu_and_flags() -> str:
    info = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
        info = "|".join(next((ln for ln in lines if ln.startswith(k)), "") for k in ("vendor_id", "model name", "flags"))
    except OSError:
        pass
    return f"{platform.processor()}|{info}|{_keyed_xla_flags(os.environ.get('XLA_FLAGS', ''))}"


def _host_tag() -> str:
    """This CPU's model and feature flags, ``XLA_FLAGS`` (`_keyed_xla_flags`) and the device
    the program runs on (`_program_device`): a compiled CPU executable is only reused on a
    host with the same instruction set (a home directory shared by other machines), by a
    process compiling with the same XLA options (``--xla_cpu_max_isa``,
    ``--xla_cpu_enable_fast_math``: the executable is what they made of the program), and
    on the device it names (a rank whose first device is another stores its own)."""
    device = _program_device()
    return hashlib.sha256(f"{_cpu_and_flags()}|{device.platform}:{device.id}".encode()).hexdigest()[:16]


def _fast_key(fn, args, static):
    """(this process's key: hashable, no strings built, leaves, tree)."""
    import jax
    leaves, tree = jax.tree_util.tree_flatten(args)
    key = (fn, tree, tuple((getattr(x, "shape", ()), getattr(x, "dtype", type(x))) for x in leaves),
           tuple(sorted(static.items())))
    return key, leaves, tree


def call(fn, *args, **static):
    """``fn(*args, **static)`` for a `jax.jit` kernel of the core, through its stored
    executable while the cache is on (`enabled`), or the one `prepare` made ready.

    Args:
      fn: a jitted function of arrays (pytrees of arrays) with keyword-only static arguments.
      *args: its array arguments (numpy or jax arrays, or pytrees of them).
      **static: its static arguments (hashable, with a stable ``repr``).

    Returns:
      What ``fn`` returns.
    """
    on = enabled()
    if not on and not _loading:
        return fn(*args, **static)
    key, leaves, tree = _fast_key(fn, args, static)
    prog = _state["programs"].get(key)
    if prog is None:
        if not on and key not in _loading:   # not being prepared: jax's own dispatch
            return fn(*args, **static)
        prog = _program(fn, key, leaves, tree, static, helping=True)
    return prog(*leaves)


class Prepared:
    """The kernels `prepare` is making ready on other threads: `wait` before returning
    from the work that asked for them (no compilation outlives it)."""

    def __init__(self, pool=None, futures=(), items=()):
        self._pool, self._futures, self._items = pool, list(futures), list(items)

    def wait(self) -> None:
        """Block until every kernel is ready, making those no thread has started on this
        one; re-raise nothing (a kernel that failed to compile is compiled again, or fails,
        where it is called)."""
        for item in reversed(self._items):
            if _claim(item[1]):
                _make(item)
        for fut in self._futures:
            fut.exception()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def prepare(calls, *, key=None, wait=True, background=False) -> Prepared:
    """Make every ``(fn, args, static)`` of `calls` ready to run: loaded from the cache, or
    compiled (and stored) on a thread each, as many at once as this process has cores,
    the caller's thread counted when it goes on (XLA compiles outside the interpreter lock).  A later `call` with the same kernel, shapes and
    static arguments then neither traces nor compiles (one still being made ready waits
    for it).  Only the arguments' shapes and dtypes matter while the cache is on; with it
    off each kernel runs once on them instead (jax keeps the compilation).

    Args:
      calls: an iterable of ``(fn, args, static)`` (a jitted kernel, a tuple of array
        arguments, a dict of static arguments), or a function returning one.
      key: a hashable name of this set of calls: once prepared in this process (until
        `enable` is called again), later calls with the same key return at once, without
        building `calls`.
      wait: False: return while the threads work (call `Prepared.wait` before the work
        that asked for them ends); the calling thread goes on (e.g. with the kernels it
        needs first, which it compiles itself).
      background: kernels the caller may never run (made ready for a later call): one
        thread makes them while the caller returns and goes on; no `Prepared.wait` is
        needed (`settle` waits for every such thread, and the interpreter does at exit).
        A `call` of one of them meanwhile makes it, or waits for it, as any; a thread
        waiting for another kernel does not make them.

    Returns:
      A `Prepared`.
    """
    if key is not None:
        if key in _state["plans"]:
            return Prepared()
        _state["plans"].add(key)
    on = enabled()
    todo, seen = [], set()
    for fn, args, static in (calls() if callable(calls) else calls):
        fkey, leaves, tree = _fast_key(fn, args, static)
        if fkey in seen or fkey in _state["programs"]:
            continue
        seen.add(fkey)
        todo.append((fn, fkey, leaves, tree, static, not on))
    if not todo:
        return Prepared()
    with _loading_lock:
        for item in todo:
            _loading.setdefault(item[1], threading.Lock())
            _queued.setdefault(item[1], item)
        if background:   # queued and marked at once: no waiting thread takes one on between
            _later.update(item[1] for item in todo)

    def ready(item):   # a kernel another thread started (or made) is skipped: the next one starts
        if _claim(item[1]):
            _make(item)

    # one thread a core, the caller's (which goes on compiling what it needs first) counted;
    # in the background one thread, and the caller makes none of them
    workers = 1 if background else min(len(todo), max(1, _cores() - (0 if wait else 1)))
    if wait and workers == 1 and not background:
        for item in todo:
            ready(item)
        return Prepared()
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="jaxguard-compile")
    handle = Prepared(pool, [pool.submit(ready, item) for item in todo], () if background else todo)
    if background:
        with _background_lock:
            _background.append(handle)
        pool.shutdown(wait=False)   # its thread ends after the last kernel
    elif wait:
        handle.wait()
    return handle


def settle() -> None:
    """Wait until every kernel made ready in the background (`prepare(...,
    background=True)`: those a first save makes ready for later saves) is ready, e.g.
    before timing a later call (``os.fork`` calls it first).  Returns at once when none is pending."""
    while True:
        with _background_lock:
            if not _background:
                return
            handle = _background.pop(0)
        handle.wait()


if hasattr(os, "register_at_fork"):   # a child never inherits a program half made (its locks held)
    os.register_at_fork(before=settle)


def _cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _claim(key) -> bool:
    """Take a queued kernel off the queue: True for the one thread that is to make it."""
    with _loading_lock:
        _later.discard(key)
        return _queued.pop(key, None) is not None


def _make(item) -> None:
    fn, key, leaves, tree, static, run = item
    _program(fn, key, leaves, tree, static, run=run)


def _program(fn, key, leaves, tree, static, run=False, helping=False):
    """The callable of the flat leaves for `key`, kept for this process: loaded, or
    compiled and stored, while the cache is on; else (or where the cache cannot serve this
    kernel) `fn` itself, run once on the leaves when `run` (jax compiles it then).
    `helping`: while another thread makes `key`, make queued kernels (`_queued`) first."""
    with _loading_lock:
        lock = _loading.setdefault(key, threading.Lock())
        _queued.pop(key, None)   # started here: no other thread starts it from the queue
        _later.discard(key)
    if helping:
        while lock.locked():
            with _loading_lock:
                item = next((_queued.pop(k) for k in reversed(_queued) if k not in _later), None)
            if item is None:
                break
            _make(item)
    with lock:
        prog = _state["programs"].get(key)
        if prog is None:
            prog = None
            if enabled():
                try:
                    prog = _load_or_compile(fn, key, leaves, tree, static)
                except Exception:  # noqa: BLE001 - a cache is an optimisation only: the direct call runs
                    prog = None
            if prog is None:
                prog = _direct(fn, tree, static)
                if run:
                    prog(*leaves)
            _state["programs"][key] = prog
    return prog


def _direct(fn, tree, static):
    import jax

    def run(*leaves):
        return fn(*jax.tree_util.tree_unflatten(tree, leaves), **static)
    return run


def _load_or_compile(fn, key, leaves, tree, static):
    """A jitted callable of the flat argument leaves (so the stored program's argument
    tree is a plain tuple: the core's NamedTuples need no serialization registry)."""
    import jax
    avals = tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)
    named = (f"{fn.__module__}.{getattr(fn, '__qualname__', fn.__name__)}", str(tree), avals,
             tuple(sorted((k, repr(v)) for k, v in static.items())))
    ident = f"{hashlib.sha256((_code_tag() + repr(named)).encode()).hexdigest()[:40]}-{_host_tag()}"
    path = os.path.join(_state["dir"], ident + SUFFIX)

    def flat(*xs):
        return fn(*jax.tree_util.tree_unflatten(tree, xs), **static)
    direct = jax.jit(flat)
    loaded = _load_executable(path, ident)
    if loaded is not None:
        _count("loaded")
        return _with_fallback(loaded, direct, path)
    compiled = _fresh_executable(flat, leaves, path, ident)
    _count("compiled")
    return _with_fallback(compiled, direct)


def _count(origin) -> None:
    with _loading_lock:   # the compile threads count too
        _counts[origin] += 1


def _fresh_executable(flat, leaves, path, ident):
    """``flat`` compiled for these leaves, and stored (unless this backend cannot
    serialize it).

    An executable that jax's persistent XLA cache handed back serializes without its
    machine code (a later process fails with "Function ... not found"), so it is compiled
    under a module name no cache holds.  A stored program is not run here against its
    deserialized copy: that costs a load (0.85 s for a small state's twelve programs), and
    a copy that does not load or run is compiled again where it is used (`_with_fallback`)."""
    import time

    import jax
    from jax.experimental import serialize_executable

    def fresh(*xs):
        return flat(*xs)
    fresh.__name__ = fresh.__qualname__ = f"jaxguard_exe_{os.getpid()}_{time.time_ns()}"
    compiled = jax.jit(fresh).lower(*_shapes(leaves)).compile()
    try:
        data = serialize_executable.serialize(compiled)
    except Exception:  # noqa: BLE001 - not every backend serializes executables: run it unstored
        return compiled
    _store_executable(path, ident, data)
    return compiled


def _shapes(leaves):
    import jax
    return [jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)) for x in leaves]


def _with_fallback(compiled, slow, stored=None):
    """``compiled(*leaves)``; arguments it was not compiled for (a weakly typed scalar, a
    leaf on another device) go through the jitted kernel instead.  A program loaded from
    `stored` that fails on its first call is not used again, and its file is removed (the
    next process compiles it anew)."""
    state = {"first": stored is not None}

    def run(*leaves):
        if "slow" not in state:
            try:
                out = compiled(*leaves)
                state["first"] = False
                return out
            except (TypeError, ValueError):
                state["slow"] = slow
            except Exception:  # noqa: BLE001 - a stored program that loaded but does not run
                if not state["first"]:
                    raise
                state["slow"] = slow
                _remove(stored, 0)
        return state["slow"](*leaves)
    return run


def _load_executable(path, ident):
    """The stored executable, or None (missing, not this user's alone, damaged, foreign)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if (hasattr(os, "getuid") and st.st_uid != os.getuid()) or st.st_mode & 0o022:
        return None
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        body = unwrap_entry(raw, ident)
        if body is None:
            return None
        import pickle

        from jax.experimental import serialize_executable
        payload, in_tree, out_tree = pickle.loads(body)
        loaded = serialize_executable.deserialize_and_load(payload, in_tree, out_tree,
                                                           execution_devices=[_program_device()])
    except Exception:  # noqa: BLE001 - a damaged or foreign executable is rebuilt, never trusted
        return None
    _used(path)
    return loaded


def wrap_entry(ident: str, body: bytes) -> bytes:
    """A stored program's bytes: `MAGIC`, the key it is stored under, SHA-256 of both and `body`.

    Args:
      ident: the program's key (its file name less `SUFFIX`).
      body: the serialized executable.

    Returns:
      The file's content.
    """
    head = MAGIC + ident.encode() + b"\n"
    return head + hashlib.sha256(head + body).digest() + body


def unwrap_entry(raw: bytes, ident: str):
    """The body of a `wrap_entry` file, checked.

    Args:
      raw: a file's content.
      ident: the key it was looked up under.

    Returns:
      The body if `raw` is a whole program stored under `ident` (its key and SHA-256
      match), else None.
    """
    head = MAGIC + ident.encode() + b"\n"
    if not raw.startswith(head) or len(raw) < len(head) + 32:
        return None
    digest, body = raw[len(head):len(head) + 32], raw[len(head) + 32:]
    return body if hashlib.sha256(head + body).digest() == digest else None


def _used(path) -> None:
    """Renew `path`'s modification time: `prune` removes the least recently used first."""
    try:
        os.utime(path)
    except OSError:
        pass


def _store_executable(path, ident, serialized) -> None:
    import pickle

    from jaxguard.errors import JaxguardError
    from jaxguard.format import storage
    try:
        data = wrap_entry(ident, pickle.dumps(serialized))
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        # atomic (a concurrent process reads a whole file or none), not durable: a cache
        storage.atomic_write_with(path, lambda fh: fh.write(data), durable=False, mode=0o600)
    except (OSError, JaxguardError):
        return   # a full disk, a read-only home: the program runs unstored
    _stored()
