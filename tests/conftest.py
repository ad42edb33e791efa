import os
import sys

import pytest

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


# Under xdist (.ci/run: -n 2) every worker's first guarded save compiled the same guard
# programs at once (15 of them, ~25 s on two busy cores): the controller compiles them once,
# before any worker starts, into the program cache the workers and their subprocesses load
# from (a warm cache: ~1 s of loads).  A test about the cache itself points it elsewhere.
_PREFILL_LR = 1e-3


def _prefill_program_cache():
    import tempfile

    import jax.numpy as jnp
    import optax

    import jaxguard
    params = {"w": jnp.linspace(-1.0, 1.0, 64 * 48, dtype=jnp.float32).reshape(64, 48), "b": jnp.zeros(48)}
    tx = optax.adamw(_PREFILL_LR, weight_decay=1e-2)
    state = tx.init(params)
    grads = jax.tree_util.tree_map(lambda p: jnp.full_like(p, 1e-3), params)
    for _ in range(3):
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
    with tempfile.TemporaryDirectory() as d:
        jaxguard.save(os.path.join(d, "prefill.jg"), state, params, lr=_PREFILL_LR, weight_decay=1e-2, tx=tx)


def pytest_configure(config):
    workers = getattr(config.option, "numprocesses", None)
    if hasattr(config, "workerinput") or not workers or workers == "0":
        return
    from jaxguard.core import programs
    if programs.enabled():
        _prefill_program_cache()


# --dist loadfile hands each worker the next file in collection order: a long file that comes
# last is the suite's tail (one worker idle for minutes).  These go first, longest first
# (seconds of one warm `-n 2` run on two cores, tests/optax/test_faults.py 216 s); the
# others keep their order, and every file keeps its own.
LONGEST_FIRST = ("optax/test_faults.py", "core/test_programs.py", "quant/test_quant_wrapper.py",
                 "torch_compat/test_portability.py", "core/test_logrel_ans.py", "optax/test_jax_multiprocess.py",
                 "torch_compat/test_replay_parity.py", "format/test_rans.py", "torch_compat/test_torch_e2e.py",
                 "torch_compat/test_enclosure.py", "core/test_certify_pieces.py", "core/test_codec.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    here = os.path.dirname(os.path.abspath(__file__))

    def order(item):
        rel = os.path.relpath(str(item.path), here).replace(os.sep, "/")
        return rank.get(rel, len(rank))
    items.sort(key=order)   # stable: the rest, and each file's tests, in collection order


@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size)`` mounts a tmpfs of `size` (e.g. ``"256k"``) and returns its path: a
    real full disk for the fault tests; the test is skipped where mounting is not allowed."""
    import subprocess
    mounted = []

    def mount(size):
        mnt = tmp_path / f"disk{len(mounted)}"
        mnt.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)],
                           capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()[:80]})")
        mounted.append(mnt)
        return mnt
    yield mount
    for mnt in mounted:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
