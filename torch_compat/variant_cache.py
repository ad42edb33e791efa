"""`detect_variant` once per environment, not once per process.

`torch_compat.detect_variant` calibrates torch's Adam ops and confirms the replay end to
end (seconds: it builds optimizers and compiles a replay).  The result depends only on
the environment, so `cached_detect_variant` stores it under ``$XDG_CACHE_HOME/jaxguard``
in a file named by a SHA-256 of

* `environment_fingerprint()` (torch version, ATen CPU capability, MKL version, CPU
  model and flags, ``ATEN_CPU_CAPABILITY`` / ``MKL_ENABLE_INSTRUCTIONS`` / ``MKL_CBWR``),
* the Python and numpy versions, and
* the source of the detection code (``float32.py``, ``variant.py``, ``calibrate.py``, ``replay.py``),

so that a different torch, CPU, kernel setting or detection code never reuses a stale
entry: any change of the key is a cache miss and a fresh detection.  A cache that
cannot be read or written only costs the detection.

The fingerprint itself needs torch imported (its CPU capability and MKL version: 1-2 s of a
``jaxguard compress``).  `variant_record` therefore also keeps the record it returned, with
``torch.__version__``, under a second key that is read without torch (`fast_key`: the
installed torch's files by path, size and modification time, the CPU's vendor, model and
flags, the three variables, the Python and numpy versions and the detection code); a
compress that reads its checkpoint without torch (`jaxguard.format.torchzip.load`) then never
imports it.  The same torch files on the same CPU with the same variables select the same
kernels, so the second key never names another environment than the first.
"""
from __future__ import annotations

__all__ = ["cache_path", "cached_detect_variant", "fast_key", "fast_record", "variant_record"]

import contextlib
import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys
import warnings
from pathlib import Path

import numpy as np

from jaxguard.errors import ContainerError
from jaxguard.format import storage
from torch_compat import variant as variant_types
from torch_compat.replay import ReplayVariantWarning, detect_variant

_SOURCES = ("float32.py", "variant.py", "calibrate.py", "replay.py")
FORMAT = 1


def _key_of(doc: dict) -> str:
    """24 hex digits of `doc` (with the format and the Python and numpy versions) and of the
    detection code."""
    h = hashlib.sha256()
    doc = {**doc, "format": FORMAT, "python": platform.python_version(), "numpy": np.__version__}
    h.update(json.dumps(doc, sort_keys=True).encode())
    here = Path(__file__).resolve().parent
    for name in _SOURCES:
        h.update((here / name).read_bytes())
    return h.hexdigest()[:24]


def _cache_key() -> str:
    """Hex key of this environment and detection code (see the module docstring)."""
    return _key_of({"fingerprint": variant_types.environment_fingerprint()})


def cache_path(key: str | None = None) -> Path:
    """The cache file of one environment's detected variant.

    Args:
      key: the environment key (default: `_cache_key()`, the current environment's).

    Returns:
      ``<cache_dir>/adam-variant-<key>.json`` (it may not exist yet).
    """
    return variant_types.cache_dir() / f"adam-variant-{key or _cache_key()}.json"


def cached_detect_variant(*, refresh: bool = False, detect=None):
    """`detect_variant()`, from the on-disk cache when this environment was seen before.

    Args:
      refresh: ignore a cached entry and detect again (the new result is stored).
      detect: the detection function (default `torch_compat.replay.detect_variant`).

    Returns:
      ``(variant, cached)``: the `AdamVariant` and whether it came from the cache.
    """
    detect = detect or detect_variant
    path = cache_path()
    if not refresh:
        try:
            d = json.loads(path.read_text())
            if d.get("key") == path.stem.rsplit("-", 1)[-1]:
                return variant_types.AdamVariant(**d["variant"]), True
        except (OSError, ValueError, TypeError, KeyError):
            pass   # missing, unreadable or from another AdamVariant layout: detect again
    variant = detect()
    _store(path, {"key": path.stem.rsplit("-", 1)[-1], "variant": dataclasses.asdict(variant)})
    return variant, False


def _store(path: Path, doc: dict, sort_keys: bool = True) -> None:
    with contextlib.suppress(OSError, ContainerError):   # a read-only cache: detected again next time
        path.parent.mkdir(parents=True, exist_ok=True)
        storage.atomic_write(path, json.dumps(doc, sort_keys=sort_keys).encode())


KERNEL_VARIABLES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR")


def _torch_files() -> list:
    """(name, size, mtime_ns) of the installed torch's version file and compiled libraries."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = Path(list(spec.submodule_search_locations)[0])
    found = [root / "version.py", *sorted(root.glob("_C*.so")), *sorted((root / "lib").glob("libtorch_cpu*")),
             *sorted((root / "lib").glob("libtorch.*"))]
    out = []
    for f in found:
        with contextlib.suppress(OSError):
            st = f.stat()
            out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def fast_key() -> str | None:
    """Hex key of this environment read without importing torch (the module docstring),
    or None when torch is not installed.

    Returns:
      24 hex digits, or None.
    """
    try:
        version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None
    files = _torch_files()
    if not files:
        return None
    return _key_of({"torch": version, "files": files, "cpu": variant_types.cpu_description(),
                    "env": {k: os.environ.get(k, "") for k in KERNEL_VARIABLES}})


def _fast_path(key: str) -> Path:
    return variant_types.cache_dir() / f"adam-variant-fast-{key}.json"


def fast_record() -> dict | None:
    """What `variant_record` returned before in this environment, read without torch.

    Returns:
      ``{"variant": the record, "torch_version": torch.__version__}``, or None (not seen
      before under `fast_key`, or unreadable).
    """
    key = fast_key()
    if key is None:
        return None
    try:
        d = json.loads(_fast_path(key).read_text())
        if d.get("key") == key and isinstance(d.get("variant"), dict) and isinstance(d.get("torch_version"), str):
            return d
    except (OSError, ValueError):
        pass
    return None


def variant_record() -> dict:
    """The detected variant for a container header or a CLI report, without a Python warning.

    Returns:
      a JSON-able dict (`AdamVariant.to_dict`); a mismatch is reported in ``matched``/``detail``,
      a failed detection as ``{"matched": False, "detail": ...}`` (the guard does not use it).
      Cached on disk per environment (`cached_detect_variant`).
    """
    fast = fast_record()
    if fast is not None:
        return fast["variant"]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ReplayVariantWarning)
            record = cached_detect_variant()[0].to_dict()   # once per environment, not per run
    except Exception as exc:  # noqa: BLE001 - the variant is informational: the guard does not use it
        return {"matched": False, "detail": f"variant detection failed: {exc}"[:300]}
    key = fast_key()
    if key is not None and "torch" in sys.modules:
        _store(_fast_path(key), {"key": key, "variant": record, "torch_version": sys.modules["torch"].__version__},
               sort_keys=False)
    return record
