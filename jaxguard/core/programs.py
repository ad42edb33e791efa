"""The guard's fixed-shape kernels, kept across processes as `jax.export` artifacts.

XLA's persistent compilation cache spares a fresh process the *compilation* of the
guard's programs, not their *tracing*: the cell bound (five refinement levels), the
early reject, the closed-form tier and the proposal are traced again by every process,
seconds of Python per `jaxguard compress`.  `call(fn, *args, **static)` runs a jitted
kernel through a serialized `jax.export.Exported` of it when a cache directory is
enabled (the CLI enables one next to its XLA cache): the first process exports and
stores it, later ones deserialize it (no tracing; the executable itself still comes from
the XLA cache).  With no directory enabled, or without the ``flatbuffers`` package jax
needs to serialize, it is exactly ``fn(*args, **static)``.

Numerical contract
------------------
The exported module is the StableHLO of ``jax.jit(fn)`` lowered for these argument
shapes and dtypes on this backend, so it computes what ``fn`` computes; the key of an
artifact names the kernel, the argument tree, shapes, dtypes and static arguments, the
backend, the jax/jaxlib versions, the machine and a hash of every source file of
`jaxguard.core`, so a changed bound, another install or another device never reuses a
stale program.  tests/test_programs.py checks bitwise equality with the direct call.
"""
from __future__ import annotations

import functools
import hashlib
import os
import platform
import tempfile

_state = {"dir": None, "programs": {}, "broken": False}


def enable(directory) -> None:
    """Keep exported kernels under `directory` (created on first write); None disables.

    Args:
      directory: a local directory, or None.
    """
    _state["dir"] = None if directory is None else os.fspath(directory)
    _state["programs"].clear()


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
    avals = tuple((tuple(getattr(x, "shape", ())), str(getattr(x, "dtype", type(x).__name__))) for x in leaves)
    fast_key = (fn, tree, avals, tuple(sorted(static.items())))   # this process: hashable, no strings built
    prog = _state["programs"].get(fast_key)
    if prog is None:
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
    import jax
    from jax import export
    name = hashlib.sha256((_code_tag() + repr(key)).encode()).hexdigest()[:40]
    path = os.path.join(_state["dir"], name + ".jaxexport")
    exported = None
    if os.path.exists(path):
        try:
            with open(path, "rb") as fh:
                exported = export.deserialize(bytearray(fh.read()))
        except ImportError:
            raise
        except Exception:  # noqa: BLE001 - a damaged artifact is rebuilt, never trusted
            exported = None
    if exported is None:
        def flat(*xs):
            return fn(*jax.tree_util.tree_unflatten(tree, xs), **static)
        shapes = [jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x)) for x in leaves]
        exported = export.export(jax.jit(flat))(*shapes)
        data = exported.serialize()
        try:
            os.makedirs(_state["dir"], exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=_state["dir"], suffix=".tmp")
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)   # atomic: a concurrent process reads a whole file or none
        except OSError:
            pass   # a cache is an optimisation only
    return jax.jit(exported.call)
