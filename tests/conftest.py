import os

import jax
from hypothesis import settings

settings.register_profile("ci", derandomize=True, max_examples=30, deadline=None, print_blob=True)
settings.register_profile("dev", max_examples=30, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# the suite compiles the same guard kernels in several subprocesses (CLI tests)
_cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxguard", "xla")
jax.config.update("jax_compilation_cache_dir", _cache)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
