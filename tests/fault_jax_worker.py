"""Worker for tests/optax/test_faults.py and bench/faults.py: one JAX process of a faulted save.

    python tests/fault_jax_worker.py save PID NPROC PORT DIR STEPS FAULT VICTIM REPORT [TRUTH]
    python tests/fault_jax_worker.py loop DIR STEPS ROUNDS REPORT        # one process, 2 devices
    python tests/fault_jax_worker.py orbax DIR STEPS FAULT SHARDED       # one process, 2 devices

`save`: NPROC processes x 2 CPU devices (gloo) train an optax adamw state STEPS steps over
a global mesh and save it with `jaxguard.save(DIR, ...)`; process 0 first writes the exact
state to TRUTH (default ``DIR.truth.npz`` when FAULT is ``none``, else ``DIR.new.truth.npz``).  In process VICTIM the fault FAULT is
injected into the real write path (the code under test runs unchanged around it):

  kill_encode          SIGKILL while certifying (inside the guard's encode)
  kill_before_write    SIGKILL after encoding, before any byte is written
  kill_mid_file        SIGKILL with half of its container written (fsynced) to the temporary file
  kill_after_files     SIGKILL with its container and index written, before the processes agree
  kill_before_manifest SIGKILL (primary) with every file written, before the manifest is written
  kill_mid_manifest    SIGKILL (primary) with half of the manifest in its temporary file
  kill_after_manifest  SIGKILL (primary) after the manifest landed, before old files are removed
  raise                an OSError (EIO) while writing its container: the save raises

Each process that returns writes REPORT.<pid>.json: {"ok", "error" (the one line), "save_id"}.

`loop`: one process saves a state of STEPS steps ROUNDS times to DIR (sharded) and to
DIR.jg (one file), and once to DIR.own (its private copy); a second job does the same with
other STEPS at the same time (two jobs, one path).

`orbaxmp PID NPROC PORT DIR STEPS FAULT VICTIM [REPORT]`: NPROC processes (gloo) save step STEPS with
orbax `CheckpointManager` (async) + `GuardedSave` (sharded, as every multi-process save is)
to DIR, FAULT injected in process VICTIM as above; with FAULT ``none`` process 0 writes
the exact state to ``DIR.truth<STEPS>.npz``; with REPORT each process that returns writes
REPORT.<pid>.json as `save` does (the first line of what orbax raised, and its line count).

`orbax`: one process saves step STEPS with orbax `CheckpointManager` (async) +
`GuardedSave(..., sharded=SHARDED)` to DIR, FAULT injected as above into the commit
thread's write; with FAULT ``none`` the exact state goes to ``DIR.truth<STEPS>.npz``.
"""
import errno
import hashlib
import io
import json
import os
import signal
import sys

MODE = sys.argv[1]
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax  # noqa: E402

if MODE in ("save", "orbaxmp"):
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    PID, NPROC, PORT = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    jax.distributed.initialize(f"localhost:{PORT}", num_processes=NPROC, process_id=PID)
else:
    PID, NPROC = 0, 1
jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                            os.path.expanduser("~/.cache"), "jaxguard", "xla"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxguard as jg  # noqa: E402
from jaxguard import sharded  # noqa: E402
from jaxguard.format import storage  # noqa: E402
from jaxguard.optax_state import dotted, flat_by_dotted  # noqa: E402

LR, WD, CLIP = 1e-3, 1e-2, 0.2
TX = optax.adamw(LR, weight_decay=WD)
SPECS = {"w1": P("a", "b"), "b1": P(), "emb": P("a", None)}
if NPROC == 3:   # axis "a" has 3 processes: shard the dimensions 3 divides (96), rows over "b"
    SPECS = {"w1": P("b", "a"), "b1": P(), "emb": P(None, "a")}


def host_params():
    r = np.random.default_rng(0)
    return {"w1": r.normal(0, 0.3, (64, 96)).astype(np.float32), "b1": np.zeros(96, np.float32),
            "emb": r.normal(0, 1, (200, 96)).astype(np.float32)}


def batch(step):
    r = np.random.default_rng(100 + step)
    return r.normal(0, 1, (32, 64)).astype(np.float32), (r.zipf(1.3, 32) % 200).astype(np.int32), \
        r.normal(0, 1, (32, 96)).astype(np.float32)


def loss(p, x, ids, y):
    return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) + p["emb"][ids] - y) ** 2)


def spec_of(path, x):
    name = dotted(path).split(".")[-1]
    return SPECS[name] if np.ndim(x) and name in SPECS else P()


def trained(steps, mesh):
    hp = host_params()
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec_of(path, x)),
                                                     lambda idx, x=x: x[idx]), hp)
    abstract = jax.eval_shape(TX.init, params)
    st_sh = jax.tree_util.tree_map_with_path(lambda path, x: NamedSharding(mesh, spec_of(path, x)), abstract)
    p_sh = jax.tree_util.tree_map(lambda x: x.sharding, params)
    state = jax.jit(TX.init, out_shardings=st_sh)(params)

    def step(p, s, x, ids, y):
        g = jax.grad(loss)(p, x, ids, y)
        u, s = TX.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step, out_shardings=(p_sh, st_sh))
    for i in range(steps):
        params, state = step(params, state, *batch(i))
    return params, state


def gathered(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
                                  if isinstance(x, jax.Array) and not x.is_fully_addressable else np.asarray(x), tree)


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def inject(fault):
    from jaxguard.sharded import commit   # the module whose calls the faults replace
    real_with, real_files, real_remove = storage.atomic_write_with, commit.write_process_files, commit.remove_unnamed

    def half_then_die(write):
        def w(fh):
            buf = io.BytesIO()
            write(buf)
            b = buf.getvalue()
            fh.write(b[:len(b) // 2])
            fh.flush()
            os.fsync(fh.fileno())
            die()
        return w

    def awith(path, write, **kw):
        p = str(path)
        if p.endswith(".jaxguard") and fault == "kill_mid_file":
            return real_with(path, half_then_die(write), **kw)
        if p.endswith(".jaxguard") and fault == "raise":
            def fail(fh):
                fh.write(b"JAXGUARD")
                raise OSError(errno.EIO, "Input/output error")
            return real_with(path, fail, **kw)
        if p.endswith(sharded.MANIFEST) and fault == "kill_before_manifest":
            die()
        if p.endswith(sharded.MANIFEST) and fault == "kill_mid_manifest":
            return real_with(path, half_then_die(write), **kw)
        return real_with(path, write, **kw)

    storage.atomic_write_with = awith
    if fault == "kill_encode":      # inside the guard's encode (jaxguard.writer calls it through the module)
        from jaxguard.core import guard
        guard.encode_many = lambda *a, **k: die()
    elif fault == "kill_before_write":
        commit.write_process_files = lambda *a, **k: die()
    elif fault == "kill_after_files":
        commit.write_process_files = lambda *a, **k: (real_files(*a, **k), die())
    elif fault == "kill_after_manifest":
        commit.remove_unnamed = lambda *a, **k: die()
    del real_remove


def one_line(exc):
    return f"{type(exc).__name__}: {exc}"


def digest_of(path):
    like = jax.tree_util.tree_map(np.asarray, TX.init(host_params()))
    h = hashlib.sha256()
    for x in jax.tree_util.tree_leaves(jg.load(path, like)):
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return h.hexdigest()


def save_job():
    d, steps, fault, victim, report = sys.argv[5], int(sys.argv[6]), sys.argv[7], int(sys.argv[8]), sys.argv[9]
    mesh = Mesh(np.array(jax.devices()).reshape(NPROC, 2), ("a", "b"))
    params, state = trained(steps, mesh)
    truth = sys.argv[10] if len(sys.argv) > 10 else d + (".truth.npz" if fault == "none" else ".new.truth.npz")
    full = gathered({"params": params, "state": state})
    if PID == 0:
        np.savez(truth, **flat_by_dotted(full))
    if PID == victim:
        inject(fault)
    rep = {"pid": PID}
    try:
        s = jg.save(d, state, params, lr=LR, weight_decay=WD)
        rep.update(ok=True, save_id=s["save_id"])
    except Exception as exc:  # noqa: BLE001 - the report says what the user saw
        rep.update(ok=False, error=one_line(exc))
    json.dump(rep, open(f"{report}.{PID}.json", "w"))


def loop_job():
    d, steps, rounds, report = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("a", "b"))
    params, state = trained(steps, mesh)
    jg.save(d + f".warm{steps}", state, params, lr=LR, weight_decay=WD, sharded=True)   # compile before the race
    open(f"{d}.ready{steps}", "w").close()
    import glob
    import time
    t_end = time.time() + 300
    while len(glob.glob(d + ".ready*")) < 2 and time.time() < t_end:   # both jobs start saving together
        time.sleep(0.01)
    errors = []
    for _ in range(rounds):
        for path, kw in ((d, {"sharded": True}), (d + ".jg", {})):
            try:
                jg.save(path, state, params, lr=LR, weight_decay=WD, **kw)
            except Exception as exc:  # noqa: BLE001 - a refused commit is allowed, a mix is not
                errors.append(one_line(exc))
    jg.save(d + f".own{steps}", state, params, lr=LR, weight_decay=WD, sharded=True)
    jg.save(d + f".own{steps}.jg", state, params, lr=LR, weight_decay=WD)
    json.dump({"errors": errors, "digest": digest_of(d + f".own{steps}"),
               "digest_file": digest_of(d + f".own{steps}.jg")}, open(report, "w"))


def orbax_job():
    import orbax.checkpoint as ocp
    import jaxguard.checkpoint as jgc
    d, steps, fault, shard = sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5] == "1"
    mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("a", "b"))
    params, state = trained(steps, mesh)
    if fault == "none":
        np.savez(f"{d}.truth{steps}.npz", **flat_by_dotted(gathered({"params": params, "state": state})))
    else:
        inject(fault)
    opts = ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True)
    with ocp.CheckpointManager(d, options=opts) as mngr:
        mngr.save(steps, args=ocp.args.Composite(opt_state=jgc.GuardedSave(state, params=params, lr=LR,
                                                                            weight_decay=WD, sharded=shard)))
        mngr.wait_until_finished()


def orbaxmp_job():
    import orbax.checkpoint as ocp
    import jaxguard.checkpoint as jgc
    d, steps, fault, victim = sys.argv[5], int(sys.argv[6]), sys.argv[7], int(sys.argv[8])
    report = sys.argv[9] if len(sys.argv) > 9 else None
    mesh = Mesh(np.array(jax.devices()).reshape(NPROC, 2), ("a", "b"))
    params, state = trained(steps, mesh)
    full = gathered({"params": params, "state": state})
    if fault == "none" and PID == 0:
        np.savez(f"{d}.truth{steps}.npz", **flat_by_dotted(full))
    if PID == victim:
        inject(fault)
    opts = ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True)
    rep = {"pid": PID}
    try:
        with ocp.CheckpointManager(d, options=opts) as mngr:
            mngr.save(steps, args=ocp.args.Composite(opt_state=jgc.GuardedSave(state, params=params, lr=LR,
                                                                                weight_decay=WD)))
            mngr.wait_until_finished()
        rep.update(ok=True)
    except Exception as exc:  # noqa: BLE001 - the report says what the user saw
        text = str(exc).strip()
        rep.update(ok=False, error=f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"[:400],
                   lines=len(text.splitlines()))
    if report:
        json.dump(rep, open(f"{report}.{PID}.json", "w"))
    if not rep["ok"] and not report:
        raise SystemExit(rep["error"])


if __name__ == "__main__":
    {"save": save_job, "loop": loop_job, "orbax": orbax_job, "orbaxmp": orbaxmp_job}[MODE]()
