import os
import sys

# JAXGUARD_BLOCK_IMPORTS=torch,lightning makes those top-level packages (and their
# submodules) unimportable in this process, before any test module is collected, and in
# the Python subprocesses the tests start (tests/blocking.py): the suite's "runs without
# torch" check, on a machine where torch is installed.
#   PYTHONPATH=$PWD JAXGUARD_BLOCK_IMPORTS=torch python -m pytest -q tests
if os.environ.get("JAXGUARD_BLOCK_IMPORTS", "").strip():
    import blocking
    _blocked = {n.strip() for n in os.environ["JAXGUARD_BLOCK_IMPORTS"].split(",")}
    _loaded = sorted(m for m in sys.modules if m.split(".", 1)[0] in _blocked)
    if _loaded:   # a pytest plugin imported it before this file ran: the block would be a lie
        raise RuntimeError(f"JAXGUARD_BLOCK_IMPORTS: {_loaded[:3]} imported before tests/conftest.py")
    exec(compile(blocking.SITECUSTOMIZE, "<JAXGUARD_BLOCK_IMPORTS>", "exec"))
    os.environ["PYTHONPATH"] = os.pathsep.join([blocking.site_dir()] + [p for p in [os.environ.get("PYTHONPATH")] if p])

import jax  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, max_examples=30, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# the suite compiles the same guard kernels in several subprocesses (CLI tests)
_cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxguard", "xla")
jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
