"""Every exception class the project defines is a `JaxguardError` (so also a `ValueError`).

The classes are found by reading the source (ast), so a new module's stray class is seen
without importing the whole tree; each one found is then imported and checked for real.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import pathlib

import pytest

from jaxguard.errors import ContainerError, JaxguardError

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("jaxguard", "torch_compat")
_BUILTIN_EXCEPTIONS = {n for n, v in vars(builtins).items()
                       if isinstance(v, type) and issubclass(v, BaseException)}


def _exception_classes():
    """(module, class name) of every class whose own name or a base's name says exception."""
    found = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef):
                    continue
                bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
                if node.name.endswith(("Error", "Exception")) or any(
                        b in _BUILTIN_EXCEPTIONS or b.endswith(("Error", "Exception")) for b in bases):
                    found.append((module, node.name))
    return found


CLASSES = _exception_classes()


def test_the_scan_sees_the_known_classes():
    names = {name for _, name in CLASSES}
    assert {"JaxguardError", "ContainerError", "ReaderError", "PackError", "RansError",
            "UnknownCodecError"} <= names, names


@pytest.mark.parametrize("module,name", CLASSES, ids=[f"{m}.{n}" for m, n in CLASSES])
def test_every_exception_is_a_jaxguard_error(module, name):
    if module.startswith("torch_compat"):
        pytest.importorskip("torch", reason="torch_compat's modules need torch")
    cls = getattr(importlib.import_module(module), name)
    if issubclass(cls, Warning):
        return   # warnings (torch_compat.variant.ReplayVariantWarning) are not errors
    assert issubclass(cls, JaxguardError), f"{module}.{name} bases {cls.__mro__[1:]}"
    assert issubclass(cls, ValueError)   # catchable as before


def test_format_errors_stay_catchable_as_today():
    from jaxguard.format import packed, rans, reader
    with pytest.raises(ValueError):
        reader.parse(b"not a container")
    with pytest.raises(reader.ReaderError) as exc:
        reader.parse(b"not a container")
    assert isinstance(exc.value, ContainerError) and "\n" not in str(exc.value)
    with pytest.raises(JaxguardError):
        rans.decode_streams(b"\xff" * 3, [8], 4)
    assert issubclass(packed.PackError, JaxguardError)
