"""Make installed packages unimportable, in this process and in the Python processes it
starts: how the suite checks what runs without torch (tests/conftest.py,
``JAXGUARD_BLOCK_IMPORTS``) and what the plain install needs (tests/package/test_plain_install.py).
"""
import os
import tempfile

# Run as a sitecustomize.py (or exec'd): refuses the top-level names listed, comma
# separated, in the environment variable JAXGUARD_BLOCK_IMPORTS.
SITECUSTOMIZE = '''
import os, sys

class _BlockImports:
    """A meta-path finder that refuses the packages named in JAXGUARD_BLOCK_IMPORTS."""

    blocked = frozenset(n.strip() for n in os.environ.get("JAXGUARD_BLOCK_IMPORTS", "").split(",") if n.strip())

    def find_spec(self, name, path=None, target=None):
        if name.split(".", 1)[0] in self.blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (JAXGUARD_BLOCK_IMPORTS)", name=name)
        return None

if _BlockImports.blocked:
    sys.meta_path.insert(0, _BlockImports())
'''


def site_dir(where=None) -> str:
    """A directory holding the blocking sitecustomize.py (put it first on PYTHONPATH)."""
    d = tempfile.mkdtemp(prefix="jaxguard-block-", dir=where)
    with open(os.path.join(d, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    return d


def blocked_env(names, where=None, env=None) -> dict:
    """`env` (default os.environ) for a subprocess in which `names` cannot be imported."""
    env = dict(os.environ if env is None else env)
    env["JAXGUARD_BLOCK_IMPORTS"] = ",".join(sorted(names))
    env["PYTHONPATH"] = os.pathsep.join([site_dir(where)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env
