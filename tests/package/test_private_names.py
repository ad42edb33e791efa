"""No module of jaxguard or torch_compat uses another module's private name (issue 59 item 6).

A name that starts with ``_`` is its module's own: a sibling that imports it (``from
jaxguard.format.entries import _take``) or reaches it through a module alias
(``reader._check_layout``) depends on an interface nobody chose.  The fix is to make the
helper a public name of its module (in ``__all__``, documented), to move it to the one
module that uses it, or to make the module an implementation detail (``_name.py``).

The rule, checked on every module's AST, function-level imports included:

* ``_x`` of module ``M`` is used only in ``M``, except that a private module (one whose
  own name starts with ``_``) is its package's implementation detail: any module inside
  that package may use any of its names;
* a private module ``P._m`` (or a private package) is imported only from inside ``P``.

Dunder names and the NamedTuple API (``_fields``, ``_replace``, ...) are public.  Private
names of third-party packages are not ours and are not checked.
"""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
OURS = ("jaxguard", "torch_compat")
NAMEDTUPLE_API = {"_fields", "_replace", "_asdict", "_make", "_field_defaults"}

# (importing module, "module.name") pairs allowed for now while a change is under way; a
# pair that is gone must be removed too.  Empty: every module uses only public names.
PENDING: set = set()


def _private(name):
    return (name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
            and name not in NAMEDTUPLE_API)


def module_files(root=ROOT):
    """Dotted module name -> path, for every module of jaxguard and torch_compat."""
    files = {}
    for pkg in OURS:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _inside(module, package):
    return module == package or module.startswith(package + ".")


def _allowed(user, owner, name, modules):
    """May module `user` use `name` of module `owner` (a name in it, or its submodule)?"""
    if user == owner:
        return True
    parts = owner.split(".")
    for i in range(1, len(parts)):          # a private module or package on the way: its package's own
        if _private(parts[i]) and not _inside(user, ".".join(parts[:i])):
            return False
    if f"{owner}.{name}" in modules:       # a submodule
        return not _private(name) or _inside(user, owner)
    if not _private(name):
        return True
    return _private(parts[-1]) and _inside(user, owner.rpartition(".")[0])


def private_uses(module, source, modules, is_package=False):
    """The private names of other modules (``"owner.name"``, sorted) that `source`, the
    source of `module` (a package's ``__init__`` when `is_package`), uses against the rule.

    `modules`: every dotted module name of the tree (imported names that are modules
    become aliases whose attributes are checked)."""
    tree = ast.parse(source)
    aliases, found = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:
                base = (module if is_package else module.rpartition(".")[0]).split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] not in OURS:
                continue
            for a in node.names:
                if f"{target}.{a.name}" in modules:
                    aliases[a.asname or a.name] = f"{target}.{a.name}"
                if not _allowed(module, target, a.name, modules):
                    found.add(f"{target}.{a.name}")
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] not in OURS:
                    continue
                aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
                owner, _, last = a.name.rpartition(".")
                if owner and not _allowed(module, owner, last, modules):
                    found.add(a.name)
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, base = [], node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in aliases:
            owner = ".".join([aliases[base.id], *reversed(chain)])
            if owner in modules and not _allowed(module, owner, node.attr, modules):
                found.add(f"{owner}.{node.attr}")
    return sorted(found)


def all_uses(root=ROOT):
    """Every (module, "owner.name") pair of the tree that breaks the rule."""
    modules = module_files(root)
    return {(mod, use) for mod, path in modules.items()
            for use in private_uses(mod, path.read_text(), modules, path.name == "__init__.py")}


def test_no_module_uses_another_modules_private_name():
    uses = all_uses()
    new = sorted(uses - PENDING)
    assert not new, ("these modules use another module's private name; make it a public name of its "
                     f"module (__all__, a docstring) or move it to its one user: {new}")
    fixed = sorted(PENDING - uses)
    assert not fixed, f"fixed on this tree: remove these pairs from PENDING: {fixed}"


MODULES = {"jaxguard", "jaxguard._tuning", "jaxguard.cli", "jaxguard.cli.main", "jaxguard.format",
           "jaxguard.format._impl", "jaxguard.format.container", "jaxguard.format.entries", "jaxguard.format.reader"}


def test_checker_finds_private_uses():
    src = ("from jaxguard.format.entries import Pieces, _take\n"
           "from .reader import _shape_size, shape_size\n"
           "from jaxguard.format import reader as r, _impl\n"
           "from jaxguard.format._impl import _helper, helper\n"
           "from jaxguard.format.container import _own\n"
           "import jaxguard.format.reader\n"
           "import numpy as np\n"
           "def f():\n"
           "    from jaxguard.format.entries import _lazy\n"
           "    return (r._check_layout, jaxguard.format.reader._x, r.__name__, r.T._replace, _impl._y,\n"
           "            np._NoValue, r.check_layout)\n")
    assert private_uses("jaxguard.format.container", src, MODULES) == [
        "jaxguard.format.entries._lazy", "jaxguard.format.entries._take", "jaxguard.format.reader._check_layout",
        "jaxguard.format.reader._shape_size", "jaxguard.format.reader._x"]


def test_a_private_module_is_its_packages_own():
    outside = ("from jaxguard.format._impl import helper\nfrom jaxguard import _tuning\n"
               "import jaxguard.format._impl\nfrom jaxguard.format import _impl\n")
    assert private_uses("jaxguard.cli.main", outside, MODULES) == [
        "jaxguard.format._impl", "jaxguard.format._impl.helper"]
