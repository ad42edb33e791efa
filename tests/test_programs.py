"""jaxguard.core.programs: the exported kernels compute bit for bit what the jitted ones do,
are read back from disk by a later process, and are keyed by shape and static argument."""
import importlib
import os

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flatbuffers")

from jaxguard.core import bound as B
from jaxguard.core import codecs, fastbound, programs
from jaxguard.core.config import GuardConfig


@pytest.fixture
def export_dir(tmp_path):
    programs.enable(tmp_path / "export")
    yield tmp_path / "export"
    programs.enable(None)


def _inputs(n, seed=0):
    """Moments and decoded moments with float32's awkward values mixed in."""
    rng = np.random.default_rng(seed)
    m = (rng.standard_normal(n) * 10.0 ** rng.uniform(-12, -1, n)).astype(np.float32)
    v = (m.astype(np.float64) ** 2 * rng.uniform(0.5, 4, n)).astype(np.float32)
    edge = np.array([0.0, -0.0, 2.0**-126, 2.0**-149, 2.0**-80, 3.0e38, 1e-30], np.float32)
    m[:edge.size], v[:edge.size] = edge, np.abs(edge)
    mt = (m * (1 + rng.uniform(-2**-7, 2**-7, n))).astype(np.float32)
    vt = (v * (1 + rng.uniform(-2**-6, 2**-6, n))).astype(np.float32)
    p = rng.standard_normal(n).astype(np.float32)
    return m, v, mt, vt, np.abs(p), np.full(n, 0.2, np.float32)


def _rows(n):
    rows = [B.pack_constants(GuardConfig(lr=1e-3, step=s, weight_decay=wd, op_model=om).constants(), 0.01)
            for s, wd, om in ((0, 0.0, "torch-adam"), (99, 0.1, "torch-adamw"), (7, 0.01, "optax-adamw"))]
    K = B.stack_rows(rows)
    return K, np.arange(n, dtype=np.int32) % 3


def _artifacts(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".jaxexport"))


def _executables(d):
    return sorted(os.listdir(os.path.join(d, "exe"))) if os.path.isdir(os.path.join(d, "exe")) else []


def _bits(x):
    return np.asarray(x).view(np.uint32) if np.asarray(x).dtype == np.float32 else np.asarray(x)


def test_exported_kernels_match_direct_calls_bitwise(export_dir):
    n = 512
    m, v, mt, vt, pabs, clip = _inputs(n)
    K, gidx = _rows(n)
    kc = K.take(gidx)
    Kj = B.as_step_row(K, -1).as_float32(jnp)
    cases = [(B.batch_lower_pc, (kc, m, v, mt, vt, clip), {}),
             (fastbound.batch_fast_accept, (Kj, gidx, m, v, mt, vt, pabs, clip), {})]
    cases += [(B.batch_bound_pc, (kc, m, v, mt, vt, pabs, clip, jnp.asarray(B.unit_edges(L, "mixed"))),
               {"bound": "shared"}) for L in range(len(B.LEVELS))]
    blocks = [x.reshape(-1, 256) for x in (m, v)]
    valid = np.ones((n // 256, 256), bool)
    cases += [(codecs.propose, (*blocks, valid, valid), {"codec": c}) for c in ("log8-rel", "log8")]
    for fn, args, static in cases:
        want = fn(*args, **static)
        got = programs.call(fn, *args, **static)
        want, got = (r if isinstance(r, tuple) else (r,) for r in (want, got))
        assert len(want) == len(got)
        for w, g in zip(want, got):
            assert np.array_equal(_bits(w), _bits(g)), fn.__name__
    # one artifact and one compiled executable per kernel, shape and static argument
    assert len(_artifacts(export_dir)) == len(cases) and len(_executables(export_dir)) == len(cases)


def test_artifacts_are_read_back_and_keyed_by_shape(export_dir):
    m, v, mt, vt, _, clip = _inputs(256, seed=1)
    K, gidx = _rows(256)
    want = np.asarray(B.batch_lower_pc(K.take(gidx), m, v, mt, vt, clip))
    programs.call(B.batch_lower_pc, K.take(gidx), m, v, mt, vt, clip)
    (art,), (exe,) = _artifacts(export_dir), _executables(export_dir)
    programs.enable(export_dir)          # what a fresh process sees: the files only
    got = programs.call(B.batch_lower_pc, K.take(gidx), m, v, mt, vt, clip)
    assert np.array_equal(_bits(want), _bits(got))
    assert _artifacts(export_dir) == [art] and _executables(export_dir) == [exe]
    for f in (export_dir / art, export_dir / "exe" / exe):   # damaged files are rebuilt, not trusted
        with open(f, "wb") as fh:
            fh.write(b"not an export")
    programs.enable(export_dir)
    assert np.array_equal(_bits(want), _bits(programs.call(B.batch_lower_pc, K.take(gidx), m, v, mt, vt, clip)))
    assert (export_dir / "exe" / exe).read_bytes() != b"not an export"
    half = [x[:128] for x in (m, v, mt, vt, clip)]
    programs.call(B.batch_lower_pc, K.take(gidx[:128]), *half)
    assert len(_artifacts(export_dir)) == 2 and len(_executables(export_dir)) == 2   # another shape, another program


_FRESH = ("import logging, sys\n"
          "import jax, numpy as np\n"
          "jax.config.update('jax_log_compiles', True)\n"
          "from jaxguard.core import programs, bound as B\n"
          "from jaxguard.core.config import GuardConfig\n"
          "programs.enable(sys.argv[1])\n"
          "K = B.stack_rows([B.pack_constants(GuardConfig(lr=1e-3, step=1).constants(), 0.01)])\n"
          "x = np.full(256, 1e-3, np.float32)\n"
          "args = (K.take(np.zeros(256, np.int64)), x, x, x, x, x)\n"
          "assert np.array_equal(np.asarray(programs.call(B.batch_lower_pc, *args)), np.asarray(B.batch_lower_pc(*args)))\n")


def _fresh_compiles(directory, xla_flags=None):
    """Compilations logged by a fresh process making one exported call (the direct call
    it is checked against compiles one more, the kernel itself)."""
    import subprocess
    import sys
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    out = subprocess.run([sys.executable, "-c", _FRESH, str(directory)], capture_output=True, text=True, timeout=600,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    return sum("Compiling" in line for line in out.stderr.splitlines())


def test_a_fresh_process_loads_the_executable_without_compiling(tmp_path):
    d = tmp_path / "export"
    first = _fresh_compiles(d)
    (exe,) = _executables(d)
    loaded = _fresh_compiles(d)
    assert loaded < first, (first, loaded)
    os.chmod(d / "exe" / exe, 0o666)   # writable by others: not read (it is a pickle), compiled again
    assert _fresh_compiles(d) > loaded


def test_disabled_is_the_direct_call():
    programs.enable(None)
    assert not programs.enabled()
    m, v, mt, vt, _, clip = _inputs(256, seed=2)
    K, gidx = _rows(256)
    assert np.array_equal(_bits(programs.call(B.batch_lower_pc, K.take(gidx), m, v, mt, vt, clip)),
                          _bits(B.batch_lower_pc(K.take(gidx), m, v, mt, vt, clip)))


def test_without_flatbuffers_it_traces_as_before(tmp_path):
    """jax cannot serialize without flatbuffers: `call` falls back to the direct call."""
    import subprocess
    import sys
    code = ("import sys; sys.modules['flatbuffers'] = None\n"
            "import numpy as np\n"
            "from jaxguard.core import programs, bound as B\n"
            "from jaxguard.core.config import GuardConfig\n"
            f"programs.enable({str(tmp_path / 'export')!r})\n"
            "K = B.stack_rows([B.pack_constants(GuardConfig(lr=1e-3, step=1).constants(), 0.01)])\n"
            "x = np.full(256, 1e-3, np.float32)\n"
            "args = (K.take(np.zeros(256, np.int64)), x, x, x, x, x)\n"
            "r = programs.call(B.batch_lower_pc, *args)\n"
            "assert np.array_equal(np.asarray(r), np.asarray(B.batch_lower_pc(*args)))\n"
            "print(programs.enabled())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False" and not (tmp_path / "export").exists()


def test_an_executable_is_not_reused_under_other_xla_flags(tmp_path):
    """A stored executable is what XLA made of the program under the process's XLA_FLAGS
    (an instruction set, fast math): a process with other flags compiles and stores its
    own; one with the same flags loads it (the control)."""
    d = tmp_path / "export"
    _fresh_compiles(d)
    assert len(_executables(d)) == 1
    _fresh_compiles(d)
    assert len(_executables(d)) == 1          # the same flags: the stored one
    _fresh_compiles(d, "--xla_cpu_max_isa=AVX2")
    assert len(_executables(d)) == 2          # other flags: its own


def _file(path, size, age_s):
    import time
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_prune_removes_the_least_recently_used_artifacts_only(tmp_path):
    """`prune` keeps the cache at 3/4 of its bound once over it, oldest modification time
    first, and never touches a file that is not one of its artifacts."""
    old = [_file(tmp_path / "v1" / f"{i}.jaxexport", 100, 1000 - i) for i in range(4)]   # 0 the oldest
    new = [_file(tmp_path / "v2" / "exe" / f"{i}.xla", 100, i) for i in range(4)]
    mine = _file(tmp_path / "v1" / "notes.txt", 10_000, 5000)            # the user's: kept
    stale, fresh = _file(tmp_path / "v1" / "a.tmp", 7, 2 * 86400), _file(tmp_path / "v1" / "b.tmp", 7, 60)
    assert programs.prune(tmp_path, 800) == 7 and not stale.exists()     # under the bound: only the stale tmp
    assert all(p.exists() for p in old + new + [mine, fresh])
    assert programs.prune(tmp_path, 700) == 300                          # 800 > 700: down to 525
    assert [p.exists() for p in old] == [False, False, False, True]      # the three oldest went
    assert all(p.exists() for p in new + [mine, fresh])
    assert programs.prune(tmp_path / "missing", 1) == 0


def test_a_bounded_cache_keeps_what_it_uses_and_drops_another_versions(tmp_path):
    """The CLI's bound (`enable(max_bytes=..., prune_root=...)`): another version's
    artifacts, older, are removed by the first store of this one; what a process loads has
    its time renewed, so this version's programs outlive those it no longer uses."""
    root = tmp_path / "export"
    other = [_file(root / "jax-old" / "exe" / f"{i}.xla", 200_000, 3600) for i in range(5)]
    m, v, mt, vt, _, clip = _inputs(256, seed=3)
    K, gidx = _rows(256)
    args = (K.take(gidx), m, v, mt, vt, clip)
    programs.enable(root / "jax-new", max_bytes=1_000_000, prune_root=root)
    try:
        want = np.asarray(programs.call(B.batch_lower_pc, *args))
        assert not any(p.exists() for p in other[:2])            # 1.0 MB over the bound: down to 0.75 MB
        assert any(p.exists() for p in other)
        (exe,) = _executables(root / "jax-new")
        exe = root / "jax-new" / "exe" / exe
        t = exe.stat().st_mtime - 7200
        os.utime(exe, (t, t))
        programs.enable(root / "jax-new", max_bytes=1_000_000, prune_root=root)   # a later process
        assert np.array_equal(_bits(programs.call(B.batch_lower_pc, *args)), _bits(want))
        assert exe.stat().st_mtime > t + 3600                     # loaded: renewed
    finally:
        programs.enable(None)


@pytest.mark.parametrize("value, want", [("", 512 << 20), ("64", 64 << 20), ("0", 0), ("-1", None)])
def test_cli_program_cache_bound_from_the_environment(monkeypatch, value, want):
    cli = importlib.import_module("jaxguard.cli.main")
    monkeypatch.setenv("JAXGUARD_PROGRAM_CACHE_MB", value)
    assert cli.program_cache_bytes() == want


def test_cli_program_cache_bound_refuses_a_non_integer(monkeypatch):
    cli = importlib.import_module("jaxguard.cli.main")
    monkeypatch.setenv("JAXGUARD_PROGRAM_CACHE_MB", "1G")
    with pytest.raises(SystemExit, match=r"JAXGUARD_PROGRAM_CACHE_MB='1G' is not an integer; set megabytes"):
        cli.program_cache_bytes()
