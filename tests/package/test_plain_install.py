"""The plain install (``pip install -e .``: jaxguard's declared dependencies, no extras)
saves, loads, inspects and verifies optax state.

Every installed distribution outside the dependency closure of jaxguard (its
``Requires-Dist`` without extras, followed recursively) is made unimportable in the
subprocesses that do it, so an undeclared import (orbax, etils, torch, ...) fails here
as it would in a fresh venv.
"""
import importlib.metadata as md
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import blocking

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def declared_dependencies() -> list:
    """jaxguard's ``Requires-Dist`` without extras: this tree's pyproject.toml (the
    installed metadata can be another checkout's, or stale), else the installed metadata."""
    try:
        import tomllib
    except ImportError:   # Python 3.10
        return [r for r in md.requires("jaxguard") or [] if "extra ==" not in r]
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["dependencies"]


def dependency_closure() -> set:
    """Canonical names of jaxguard and of everything it requires without extras,
    recursively (the extras a requirement itself names, ``etils[epy]``, are followed)."""
    seen: dict = {"jaxguard": set()}
    todo = [(Requirement(r).name, tuple(Requirement(r).extras)) for r in declared_dependencies()
            if Requirement(r).marker is None or Requirement(r).marker.evaluate({"extra": ""})]
    while todo:
        name, extras = todo.pop()
        key = canonicalize_name(name)
        if key in seen and set(extras) <= seen[key]:
            continue
        seen.setdefault(key, set()).update(extras)
        try:
            requires = md.requires(name) or []
        except md.PackageNotFoundError:   # declared but not installed: nothing to follow
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (extras or ("",))):
                continue
            todo.append((req.name, tuple(req.extras)))
    return set(seen)


def undeclared_modules(closure) -> set:
    """Top-level modules of installed distributions none of which is in `closure`."""
    out = set()
    for module, dists in md.packages_distributions().items():
        if module.isidentifier() and not any(canonicalize_name(d) in closure for d in dists):
            out.add(module)
    return out


SCRIPT = textwrap.dedent('''
    import sys
    import jax, jax.numpy as jnp, numpy as np, optax
    import jaxguard as jg

    path = sys.argv[1]
    params = {"w": jnp.linspace(-1, 1, 600, dtype=jnp.float32).reshape(6, 100), "b": jnp.zeros(100)}
    tx = optax.adamw(1e-3, weight_decay=0.01)
    state = tx.init(params)
    for i in range(3):
        g = jax.tree.map(lambda p: 0.01 * jnp.cos(p + i), params)
        u, state = tx.update(g, state, params)
        params = optax.apply_updates(params, u)
    s = jg.save(path, state, params, lr=1e-3, weight_decay=0.01)
    back = jg.load(path, tx.init(params))
    a, b = jax.tree.leaves(state), jax.tree.leaves(back)
    assert len(a) == len(b) and all(np.shape(x) == np.shape(y) for x, y in zip(a, b))
    assert int(back[0].count) == 3, back[0].count
    print("saved", s["coordinates"], "loaded", len(b))
''')


def _imports_etils():
    """The jaxguard modules that import etils (not a declared dependency), but the orbax
    adapter (checkpoint.py: orbax, which it needs, brings etils)."""
    import ast
    import pathlib
    out = []
    for p in sorted(pathlib.Path(ROOT, "jaxguard").rglob("*.py")):
        if p.name == "checkpoint.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.split(".")[0] == "etils" for n in names):
                out.append(p.name)
                break
    return out


# Issue 23: on main, jaxguard/sharded.py and jit_state.py import etils.epath, which jaxguard
# does not declare, so jaxguard.load fails in the plain install ("No module named 'etils'").
# Expected to fail (strictly) while any jaxguard module imports etils; once the storage
# work removes it, the marker switches itself off and the test must pass.
@pytest.mark.xfail(bool(_imports_etils()), strict=True,
                   reason=f"issue 23: {', '.join(_imports_etils())} import etils, an undeclared dependency")
def test_plain_install_saves_loads_inspects_and_verifies_optax_state(tmp_path):
    closure = dependency_closure()
    assert {"jax", "optax", "numpy"} <= closure and "torch" not in closure and "orbax-checkpoint" not in closure
    blocked = undeclared_modules(closure) - {"jaxguard", "torch_compat"}
    installed = {m for m in ("torch", "orbax") if importlib.util.find_spec(m) is not None}
    assert installed <= blocked, sorted(blocked)[:20]     # what is installed but undeclared is blocked
    env = blocking.blocked_env(blocked, where=str(tmp_path), env={**os.environ, "JAX_PLATFORMS": "cpu"})
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"].split(os.pathsep)[0], ROOT])
    for mod in sorted(installed):   # the block holds in the subprocesses (nothing to block where it is absent)
        probe = subprocess.run([sys.executable, "-c", f"import {mod}"], env=env, capture_output=True, text=True)
        assert probe.returncode != 0 and "JAXGUARD_BLOCK_IMPORTS" in probe.stderr, probe.stderr[-500:]
    path = str(tmp_path / "adamw.jaxguard")

    def run(what, *args):
        r = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, cwd=str(tmp_path),
                           timeout=600)
        assert r.returncode == 0, f"{what} in the plain install: {(r.stderr.strip().splitlines() or [r.stdout])[-1]}"
        return r.stdout

    assert "saved 700 loaded" in run("jaxguard.save + jaxguard.load", "-c", SCRIPT, path)
    out = run("jaxguard inspect", "-m", "jaxguard", "inspect", path)
    assert "framework: optax" in out and "certified: True" in out, out
    out = run("jaxguard verify", "-m", "jaxguard", "verify", path)
    assert out.startswith("ok "), out


def test_the_suite_collects_without_torch():
    """Every test module either runs without torch or skips with a reason: collecting the
    whole suite with torch unimportable gives no error (a module that imports torch at its
    top without `pytest.importorskip` breaks the torch-free run)."""
    env = {**os.environ, "JAXGUARD_BLOCK_IMPORTS": "torch"}
    p = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "-p", "no:cacheprovider",
                        os.path.join(ROOT, "tests")], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    tail = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-500:]
    assert p.returncode == 0 and "error" not in tail, p.stdout[-3000:]
    assert "collected" in tail and int(tail.split()[0]) > 100, tail   # the torch-free tests are there
