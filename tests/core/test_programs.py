"""jaxguard.core.programs: the stored executables compute bit for bit what the jitted kernels
do, are read back by a later process, keyed by shape and static argument; a damaged or
foreign entry is ignored and replaced; two processes fill one cache at once; the cache is
on by default and one variable turns it off; and a process's later saves compile nothing,
whatever their rows reach (the programs of every tier are prepared by the first)."""
import hashlib
import importlib
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxguard.core import bound as B
from jaxguard.core import codecs, fastbound, programs
from jaxguard.core.config import GuardConfig


@pytest.fixture(autouse=True)
def program_cache_as_it_was():
    """The tests here switch this process's program cache; each gives it back as it found it,
    on (the default directory, from the environment) or off, so a later test in the same
    worker sees what it would alone.  (Turning it off for good once hid an order dependence
    of the call-counting tests.)  The public interface says whether the cache is on, not
    where: no test outside this file points it elsewhere."""
    was_on = programs.enabled()
    yield
    programs.enable() if was_on else programs.enable(None)


@pytest.fixture
def cache_dir(tmp_path):
    programs.enable(tmp_path / "programs")
    return tmp_path / "programs"


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


def _stored(d):
    return sorted(f for f in os.listdir(d) if f.endswith(programs.SUFFIX)) if os.path.isdir(d) else []


def _bits(x):
    return np.asarray(x).view(np.uint32) if np.asarray(x).dtype == np.float32 else np.asarray(x)


def test_stored_kernels_match_direct_calls_bitwise(cache_dir):
    n = 512
    m, v, mt, vt, pabs, clip = _inputs(n)
    K, gidx = _rows(n)
    kc = K.take(gidx)
    Kj = B.as_step_row(K, -1).as_float32(jnp)
    cases = [(B.batch_lower_pc, (kc, m, v, mt, vt, clip), {}),
             (fastbound.batch_fast_accept, (Kj, gidx, m, v, mt, vt, pabs, clip), {}),
             (fastbound.batch_fast_cells_pc, (kc, m, v, mt, vt, pabs, clip), {}),
             (B.batch_bound_adaptive_pc, (kc, m, v, mt, vt, pabs, clip), {"gammas": B.ADAPTIVE_GAMMAS_DOUBLING})]
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
    assert len(_stored(cache_dir)) == len(cases)   # one executable per kernel, shape and static argument
    programs.enable(cache_dir)                     # what a fresh process sees: the files only
    for fn, args, static in cases:
        want, got = fn(*args, **static), programs.call(fn, *args, **static)
        want, got = (r if isinstance(r, tuple) else (r,) for r in (want, got))
        assert all(np.array_equal(_bits(w), _bits(g)) for w, g in zip(want, got)), fn.__name__
    assert len(_stored(cache_dir)) == len(cases)


def _lower_args(n=256, seed=1):
    m, v, mt, vt, _, clip = _inputs(n, seed=seed)
    K, gidx = _rows(n)
    return (K.take(gidx), m, v, mt, vt, clip)


def _damage(path, how):
    raw = path.read_bytes()
    if how == "garbage":
        path.write_bytes(b"not a program")
    elif how == "truncated":
        path.write_bytes(raw[:len(raw) // 2])
    elif how == "one bit":
        flipped = bytearray(raw)
        flipped[len(raw) - 100] ^= 0x10   # inside the executable: only the SHA-256 sees it
        path.write_bytes(bytes(flipped))
    elif how == "foreign":   # a whole, valid program of another kernel under this one's name
        other = [p for p in path.parent.iterdir() if p.suffix == programs.SUFFIX and p != path][0]
        path.write_bytes(other.read_bytes())
    os.chmod(path, 0o600)


@pytest.mark.parametrize("how", ["garbage", "truncated", "one bit", "foreign"])
def test_a_damaged_or_foreign_entry_is_ignored_and_replaced(cache_dir, how):
    args = _lower_args()
    want = np.asarray(B.batch_lower_pc(*args))
    programs.call(B.batch_lower_pc, *args)
    (name,) = _stored(cache_dir)
    programs.call(B.batch_lower_pc, *_lower_args(n=128))   # another shape: a second program
    path = cache_dir / name
    good = path.read_bytes()
    _damage(path, how)
    programs.enable(cache_dir)   # a fresh process
    assert path.read_bytes() != good
    assert np.array_equal(_bits(programs.call(B.batch_lower_pc, *args)), _bits(want))
    assert programs.unwrap_entry(path.read_bytes(), name[:-len(programs.SUFFIX)]) is not None   # replaced by a whole one
    assert len(_stored(cache_dir)) == 2


def test_the_integrity_check_refuses_what_it_must():
    """The control of the test above: `unwrap_entry` takes a whole entry stored under its own
    name, and refuses a flipped bit anywhere, a cut and another name."""
    body = bytes(range(256)) * 4
    raw = programs.wrap_entry("abc-123", body)
    assert programs.unwrap_entry(raw, "abc-123") == body
    assert programs.unwrap_entry(raw, "abc-124") is None
    assert programs.unwrap_entry(raw[:-1], "abc-123") is None
    for i in (0, len(programs.MAGIC) + 2, len(raw) // 2, len(raw) - 1):
        flipped = bytearray(raw)
        flipped[i] ^= 1
        assert programs.unwrap_entry(bytes(flipped), "abc-123") is None, i


_FRESH = ("import sys\n"
          "import jax, numpy as np\n"
          "from jaxguard.core import programs, bound as B\n"
          "from jaxguard.core.config import GuardConfig\n"
          "count = []\n"
          "jax.monitoring.register_event_duration_secs_listener(\n"
          "    lambda e, d, **kw: count.append(e) if e == '/jax/core/compile/backend_compile_duration' else None)\n"
          "programs.enable(sys.argv[1])\n"
          "K = B.stack_rows([B.pack_constants(GuardConfig(lr=1e-3, step=1).constants(), 0.01)])\n"
          "x = np.full(256, 1e-3, np.float32)\n"
          "args = (K.take(np.zeros(256, np.int64)), x, x, x, x, x)\n"
          "r = np.asarray(programs.call(B.batch_lower_pc, *args))\n"
          "n = len(count)\n"
          "assert np.array_equal(r, np.asarray(B.batch_lower_pc(*args)))\n"
          "made = programs.counts()\n"
          "print(n, made['compiled'], made['loaded'])\n")


def _fresh_compiles(directory, xla_flags=None):
    """XLA compilations of a fresh process's one call through the cache (before the direct
    call it is checked against); `programs.counts` agrees."""
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    if xla_flags is not None:
        env["XLA_FLAGS"] = xla_flags
    out = subprocess.run([sys.executable, "-c", _FRESH, str(directory)], capture_output=True, text=True, timeout=600,
                         env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    n, compiled, loaded = map(int, out.stdout.split()[-3:])
    assert (compiled, loaded) == ((1, 0) if n else (0, 1))   # programs.counts says which it was
    return n


def test_a_fresh_process_loads_the_executable_without_compiling(tmp_path):
    d = tmp_path / "programs"
    assert _fresh_compiles(d) >= 1
    (name,) = _stored(d)
    assert _fresh_compiles(d) == 0
    os.chmod(d / name, 0o666)   # writable by others: not read (it is a pickle), compiled again
    assert _fresh_compiles(d) >= 1


def test_an_executable_is_not_reused_under_other_xla_flags(tmp_path):
    """A stored executable is what XLA made of the program under the process's XLA_FLAGS
    (an instruction set, fast math): a process with other flags compiles and stores its
    own; one with the same flags loads it (the control)."""
    d = tmp_path / "programs"
    _fresh_compiles(d)
    assert len(_stored(d)) == 1
    assert _fresh_compiles(d) == 0 and len(_stored(d)) == 1          # the same flags: the stored one
    assert _fresh_compiles(d, "--xla_cpu_max_isa=AVX2") >= 1
    assert len(_stored(d)) == 2                                     # other flags: its own


def test_disabled_is_the_direct_call(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv(programs.CACHE_ENV, "0")
    programs.enable()                 # the default, read from the environment: off
    assert not programs.enabled()
    args = _lower_args(seed=2)
    assert np.array_equal(_bits(programs.call(B.batch_lower_pc, *args)), _bits(B.batch_lower_pc(*args)))
    assert not (tmp_path / "jaxguard").exists()


def test_on_by_default_in_the_users_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(programs.CACHE_ENV, raising=False)
    programs.enable()
    assert programs.enabled()
    programs.call(B.batch_lower_pc, *_lower_args(seed=4))
    (version,) = os.listdir(tmp_path / "jaxguard" / "programs")
    (name,) = _stored(tmp_path / "jaxguard" / "programs" / version)
    assert os.stat(tmp_path / "jaxguard" / "programs" / version / name).st_mode & 0o777 == 0o600   # this user's


def _file(path, size, age_s):
    import time
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_prune_removes_the_least_recently_used_programs_only(tmp_path):
    """`prune` keeps the cache at 3/4 of its bound once over it, oldest modification time
    first, and never touches a file that is not one of its programs."""
    old = [_file(tmp_path / "v1" / f"{i}.jaxexport", 100, 1000 - i) for i in range(4)]   # 0 the oldest
    new = [_file(tmp_path / "v2" / f"{i}.xla", 100, i) for i in range(4)]
    mine = _file(tmp_path / "v1" / "notes.txt", 10_000, 5000)            # the user's: kept
    stale, fresh = _file(tmp_path / "v1" / "a.tmp", 7, 2 * 86400), _file(tmp_path / "v1" / "b.tmp", 7, 60)
    assert programs.prune(tmp_path, 800) == 7 and not stale.exists()     # under the bound: only the stale tmp
    assert all(p.exists() for p in old + new + [mine, fresh])
    assert programs.prune(tmp_path, 700) == 300                          # 800 > 700: down to 525
    assert [p.exists() for p in old] == [False, False, False, True]      # the three oldest went
    assert all(p.exists() for p in new + [mine, fresh])
    assert programs.prune(tmp_path / "missing", 1) == 0


def test_a_bounded_cache_keeps_what_it_uses_and_drops_another_versions(tmp_path):
    """The bound (`enable(max_bytes=..., prune_root=...)`): another version's programs,
    older, are removed by the first store of this one; what a process loads has its time
    renewed, so this version's programs outlive those it no longer uses."""
    root = tmp_path / "programs"
    other = [_file(root / "jax-old" / f"{i}.xla", 200_000, 3600) for i in range(5)]
    args = _lower_args(seed=3)
    programs.enable(root / "jax-new", max_bytes=1_000_000, prune_root=root)
    want = np.asarray(programs.call(B.batch_lower_pc, *args))
    assert not any(p.exists() for p in other[:2])            # 1.0 MB over the bound: down to 0.75 MB
    assert any(p.exists() for p in other)
    (name,) = _stored(root / "jax-new")
    exe = root / "jax-new" / name
    t = exe.stat().st_mtime - 7200
    os.utime(exe, (t, t))
    programs.enable(root / "jax-new", max_bytes=1_000_000, prune_root=root)   # a later process
    assert np.array_equal(_bits(programs.call(B.batch_lower_pc, *args)), _bits(want))
    assert exe.stat().st_mtime > t + 3600                     # loaded: renewed


@pytest.mark.parametrize("value, want", [("", 512 << 20), ("64", 64 << 20), ("0", 0), ("-1", None)])
def test_cache_bound_from_the_environment(monkeypatch, value, want):
    monkeypatch.setenv(programs.CACHE_ENV, value)
    assert programs.cache_bytes() == want


def test_cache_bound_refuses_a_non_integer_in_one_line(monkeypatch, tmp_path):
    from jaxguard.errors import ConfigError
    monkeypatch.setenv(programs.CACHE_ENV, "1G")
    with pytest.raises(ConfigError, match=r"JAXGUARD_PROGRAM_CACHE_MB='1G' is not an integer; set megabytes"):
        programs.cache_bytes()
    # the CLI: one line, before any work
    env = dict(os.environ, JAXGUARD_PROGRAM_CACHE_MB="1G", XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "jaxguard", "compress", str(tmp_path / "missing.pt"), "-o",
                          str(tmp_path / "x.jg")], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        "jaxguard: error: JAXGUARD_PROGRAM_CACHE_MB='1G' is not an integer; set megabytes (default 512, 0 for no "
        "program cache, -1 for no bound)"], out.stderr


# --------------------------------------------------------------------- whole saves, fresh processes

_SAVES = r"""
import hashlib, json, os, sys
import jax
compiles = []
jax.monitoring.register_event_duration_secs_listener(
    lambda e, d, **kw: compiles.append(e) if e == '/jax/core/compile/backend_compile_duration' else None)
import numpy as np
import jaxguard as jg
from jaxguard.core import programs
from jaxguard.format import reader
sys.path.insert(0, sys.argv[2])
from test_dense_reject import adversarial

def strip(x):
    if isinstance(x, dict):
        return {k: strip(v) for k, v in x.items() if k != "encode_seconds"}
    return [strip(v) for v in x] if isinstance(x, list) else x

def state(m, v, p):
    import optax
    import jax.numpy as jnp
    params = {"w": jnp.asarray(p)}
    st = optax.adam(1e-3).init(params)
    adam = st[0]._replace(mu={"w": jnp.asarray(m)}, nu={"w": jnp.asarray(v)}, count=jnp.asarray(7, jnp.int32))
    return (adam,) + tuple(st[1:]), params

out, per_save = [], []
n = 24_000
rng = np.random.default_rng(0)
quiet = (np.float32(1e-3) * rng.standard_normal(n).astype(np.float32),)
quiet += (quiet[0] * quiet[0] * np.float32(1.5), rng.standard_normal(n).astype(np.float32))
# first a state whose rows stop at the first tiers, then adversarial ones that reach them all
for i, (m, v, p) in enumerate([quiet] + [adversarial(s, n=n) for s in (7, 8)]):
    st, params = state(m, v, p)
    path = os.path.join(sys.argv[1], f"s{i}.jg")
    before = len(compiles)
    jg.save(path, st, params, lr=1e-3)
    programs.settle()   # the kernels this save made ready for later ones, in the background
    per_save.append(len(compiles) - before)
    with open(path, "rb") as fh:   # the container less its entries' encode timings (wall time)
        header, payload = reader.parse(fh.read())
    out.append(hashlib.sha256(json.dumps(strip(header["entries"]), sort_keys=True).encode()
                              + header["decoded_sha256"].encode() + bytes(payload)).hexdigest())
print(json.dumps({"hashes": out, "compiles": per_save, "enabled": programs.enabled()}))
"""


def _saves(out_dir, cache_home, *, off=False):
    env = dict(os.environ, XDG_CACHE_HOME=str(cache_home))
    env.pop(programs.CACHE_ENV, None)
    if off:
        env[programs.CACHE_ENV] = "0"
    os.makedirs(out_dir, exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", _SAVES, str(out_dir), os.path.dirname(__file__)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc):
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_two_processes_fill_one_cache_and_later_saves_compile_nothing(tmp_path):
    """Two fresh processes fill one empty cache at once (as ranks starting together do);
    each then saves states whose rows reach other tiers without compiling; a third process
    loads every program and compiles nothing; the containers are bit for bit those of a
    process with the cache off (the direct calls), which compiles nothing after its first
    save either; the cache holds only whole programs."""
    home = tmp_path / "home"
    first, second = _saves(tmp_path / "a", home), _saves(tmp_path / "b", home)
    a, b = _result(first), _result(second)
    direct = _result(_saves(tmp_path / "off", tmp_path / "home_off", off=True))
    warm = _result(_saves(tmp_path / "c", home))
    assert a["enabled"] and not direct["enabled"]
    assert a["hashes"] == b["hashes"] == direct["hashes"] == warm["hashes"]
    for r in (a, b, direct):
        assert r["compiles"][0] > 0 and r["compiles"][1:] == [0, 0], r["compiles"]
    assert warm["compiles"] == [0, 0, 0]
    assert not (tmp_path / "home_off" / "jaxguard" / "programs").exists()   # the off switch wrote nothing
    (version,) = os.listdir(home / "jaxguard" / "programs")
    files = os.listdir(home / "jaxguard" / "programs" / version)
    assert files and all(f.endswith(programs.SUFFIX) for f in files)        # no temporary file left
    for f in files:
        raw = (home / "jaxguard" / "programs" / version / f).read_bytes()
        assert programs.unwrap_entry(raw, f[:-len(programs.SUFFIX)]) is not None


def test_a_small_state_prepares_no_program_it_cannot_call(cache_dir, monkeypatch):
    """The widening's closed form runs at `FAST_CHUNK` coordinates a call only for a group of
    that many: a 4,096-coordinate group on the full ladder prepares (compiles, stores) it at
    the small size alone, a group that large at both, and the container is the direct
    call's.  On a small group's ladder (`certify.SPEED_TIERS_ABOVE`) the closed form never
    runs, and the first save prepares it at no size."""
    from jaxguard.core import adaptive, certify, guard

    K, _ = _rows(3)
    sizes = lambda calls: sorted(args[1].shape[0] for fn, args, _s in calls if fn is fastbound.batch_fast_accept)  # noqa: E731
    assert sizes(adaptive.widen_calls(K, 4096)) == [certify.FAST_MIN_CHUNK]
    assert sizes(adaptive.widen_calls(K, certify.FAST_CHUNK)) == sizes(adaptive.widen_calls(K)) == [
        certify.FAST_MIN_CHUNK, certify.FAST_CHUNK]
    assert sizes(adaptive.widen_calls(K, 4096, closed_form=False)) == []

    rng = np.random.default_rng(3)
    m = (rng.standard_normal(4096) * 1e-3).astype(np.float32)
    v, p = (m * m * np.float32(1.5)).astype(np.float32), rng.standard_normal(4096).astype(np.float32)
    cfg = GuardConfig(lr=1e-3, step=3, weight_decay=1e-2, op_model="optax-adamw")
    traced, kernel = [], fastbound.batch_fast_accept

    @jax.jit
    def seen(K, gidx, *rest):   # the closed form, its sizes noted as each is traced (compiled)
        traced.append(gidx.shape[0])
        return kernel(K, gidx, *rest)
    monkeypatch.setattr(fastbound, "batch_fast_accept", seen)
    small = guard.encode(m, v, p, cfg)
    programs.settle()
    assert traced == [], traced
    monkeypatch.setattr(guard, "SPEED_TIERS_ABOVE", 0)   # the full ladder, as a larger group's
    monkeypatch.setattr(guard, "CELLS_TIERS_ABOVE", 0)
    cached = guard.encode(m, v, p, cfg)
    programs.settle()
    assert traced == [certify.FAST_MIN_CHUNK], traced
    monkeypatch.undo()
    programs.enable(None)
    direct = guard.encode(m, v, p, cfg)
    for k in direct.arrays:
        np.testing.assert_array_equal(_bits(cached.arrays[k]), _bits(direct.arrays[k]))
        np.testing.assert_array_equal(_bits(small.arrays[k]), _bits(direct.arrays[k]))


def _traced_kernels(k, release_at, gate, traced):
    """`k` jitted kernels; each notes (its index, the thread) when traced, which is when it
    compiles; kernel 0 waits at trace time for `gate`, which kernel `release_at` sets."""
    import threading

    def kernel(i):
        def f(x):
            traced.append((i, threading.current_thread().name))
            if i == 0:
                assert gate.wait(60), "the kernels queued behind kernel 0 were not made meanwhile"
            if i == release_at:
                gate.set()
            return x * (i + 1)
        f.__name__ = f.__qualname__ = f"kernel_{i}"   # the cache keys a kernel by its name
        return jax.jit(f)
    return [kernel(i) for i in range(k)]


@pytest.mark.parametrize("how", ["wait", "call"])
def test_a_thread_that_would_wait_makes_the_queued_kernels_meanwhile(cache_dir, monkeypatch, how):
    """While the pool's one thread makes the first kernel, the thread that waits for it
    (`Prepared.wait`, or a `call` of that kernel) makes the kernels no thread has started,
    from the last back, each once; before, it waited while the pool made them in turn
    (kernel 0 here only finishes once kernel 1 is made, so the old order never finishes)."""
    import threading

    monkeypatch.setattr(programs, "_cores", lambda: 2)   # one pool thread beside the caller
    gate, traced = threading.Event(), []
    kernels = _traced_kernels(4, 1, gate, traced)
    x = np.arange(4, dtype=np.float32)
    handle = programs.prepare([(f, (x,), {}) for f in kernels], wait=False)
    if how == "call":
        while not traced:   # the pool thread has started kernel 0
            threading.Event().wait(0.01)
        np.testing.assert_array_equal(np.asarray(programs.call(kernels[0], x)), x)
    handle.wait()
    me = threading.current_thread().name
    assert sorted(i for i, _ in traced) == [0, 1, 2, 3], traced            # each made once
    assert [i for i, t in traced if t == me] == [3, 2, 1], traced          # the tail, by the waiting thread
    assert [t for i, t in traced if i == 0][0].startswith("jaxguard-compile"), traced
    for i, f in enumerate(kernels):   # and ready: called again, nothing is traced
        np.testing.assert_array_equal(np.asarray(programs.call(f, x)), x * (i + 1))
    assert len(traced) == 4


def test_kernels_made_ready_in_the_background_are_not_made_by_a_waiting_thread(cache_dir, monkeypatch):
    """`prepare(..., background=True)` returns while its thread makes the kernels (kernel 0
    here is held at trace time until the test lets it go); a thread that waits for a kernel
    another thread makes does not take the queued background ones on meanwhile (they are
    for later saves); `settle` returns once all are ready, and a later `call` traces nothing."""
    import threading

    monkeypatch.setattr(programs, "_cores", lambda: 2)   # one pool thread beside the caller
    gate, traced, gate_a, traced_a = threading.Event(), [], threading.Event(), []
    kernels = _traced_kernels(3, -1, gate, traced)
    x = np.arange(4, dtype=np.float32)
    programs.prepare([(f, (x,), {}) for f in kernels], background=True)   # returns: kernel 0 is held
    (needed,) = _traced_kernels(1, -1, gate_a, traced_a)
    y = np.arange(5, dtype=np.float32)
    handle = programs.prepare([(needed, (y,), {})], wait=False)
    while not (traced and traced_a):
        threading.Event().wait(0.01)
    threading.Timer(0.5, gate_a.set).start()
    np.testing.assert_array_equal(np.asarray(programs.call(needed, y)), y)   # waits for the pool thread
    handle.wait()
    assert [i for i, _ in traced] == [0], traced   # kernels 1 and 2 wait for their own thread
    gate.set()
    programs.settle()
    assert [i for i, _ in traced] == [0, 1, 2], traced
    assert all(t.startswith("jaxguard-compile") for _, t in traced), traced
    for i, f in enumerate(kernels):
        np.testing.assert_array_equal(np.asarray(programs.call(f, x)), x * (i + 1))
    assert len(traced) == 3 and len(traced_a) == 1
    programs.settle()   # nothing pending: returns at once


def test_a_fork_waits_for_the_kernels_made_ready_in_the_background(cache_dir):
    """`os.fork` settles first: the child never holds a copy of a kernel half made (its
    per-kernel lock taken by a thread the child does not have)."""
    import threading
    import warnings

    gate, traced = threading.Event(), []
    kernels = _traced_kernels(2, -1, gate, traced)
    x = np.arange(4, dtype=np.float32)
    programs.prepare([(f, (x,), {}) for f in kernels], background=True)
    while not traced:
        threading.Event().wait(0.01)
    threading.Timer(0.3, gate.set).start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # jax's own warning about forking a threaded process
        pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    assert [i for i, _ in traced] == [0, 1], traced   # both were made before the fork returned
