"""Worker for tests/optax/test_jax_multiprocess.py (run as a script, one per JAX process).

    python tests/mp_jax_worker.py write PROCESS_ID NUM_PROCESSES PORT OUTDIR   # 2 x 2 CPU devices
    python tests/mp_jax_worker.py read OUTDIR                                  # 1 x 4 CPU devices

`write`: an optax adamw state over a global 2x2 mesh (kernel split over both axes, an
embedding split over one and replicated over the other, a replicated bias) trained 6
steps; saved with `jaxguard.save` and with orbax `CheckpointManager` + `GuardedSave`;
both restored in the same job into other shardings; then 3 more steps with
`encode_state_jit` inside the jitted step, written with `jaxguard.write` and compared
with `jaxguard.save` of the same state.  `read`: restores everything in one process on
a 1-D mesh of 4 devices and runs the real optax first-update audit.  Each writes a JSON
report to OUTDIR; the test asserts on them.
"""
import hashlib
import json
import os
import time

T0 = time.time()
import sys

os.environ.setdefault("XLA_FLAGS", "")
MODE = sys.argv[1]
NDEV = 2 if MODE == "write" else 4
os.environ["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={NDEV}"

import faulthandler  # noqa: E402
import signal  # noqa: E402

faulthandler.register(signal.SIGUSR1, all_threads=True)
import jax  # noqa: E402

if MODE == "write":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    PID, NPROC, PORT, OUT = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    jax.distributed.initialize(f"localhost:{PORT}", num_processes=NPROC, process_id=PID)
else:
    PID, OUT = 0, sys.argv[2]

# the same persistent XLA cache as tests/conftest.py: the guard kernels compile once per machine
jax.config.update("jax_compilation_cache_dir", os.path.join(os.environ.get("XDG_CACHE_HOME") or
                                                            os.path.expanduser("~/.cache"), "jaxguard", "xla"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import jaxguard as jg  # noqa: E402
import jaxguard.checkpoint as jgc  # noqa: E402
from jaxguard.optax_adapter import audit  # noqa: E402
from jaxguard.optax_state import dotted, flat_by_dotted  # noqa: E402

LR, WD, CLIP = 1e-3, 1e-2, 0.2
TX = optax.adamw(LR, weight_decay=WD)
SPECS = {"w1": P("a", "b"), "b1": P(), "w2": P("b", None), "emb": P("a", None)}
OTHER = {"w1": P(None, "z"), "b1": P("z"), "w2": P("z", None), "emb": P(None, "z")}


def host_params():
    r = np.random.default_rng(0)
    return {"w1": r.normal(0, 0.3, (64, 96)).astype(np.float32), "b1": np.zeros(96, np.float32),
            "w2": r.normal(0, 0.3, (96, 16)).astype(np.float32), "emb": r.normal(0, 1, (200, 16)).astype(np.float32)}


def batch(step):
    r = np.random.default_rng(100 + step)
    ids = (r.zipf(1.3, 32) % 200).astype(np.int32)
    return r.normal(0, 1, (32, 64)).astype(np.float32), ids, r.normal(0, 1, (32, 16)).astype(np.float32)


def loss(p, x, ids, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] + p["emb"][ids]
    return jnp.mean((h - y) ** 2)


def place(tree, mesh, specs):
    """Global arrays from host values (every process holds the same host tree)."""
    def put(path, x):
        name = dotted(path).split(".")[-1]
        sh = NamedSharding(mesh, specs[name] if np.ndim(x) and name in specs else P())
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sh, lambda idx: x[idx])
    return jax.tree_util.tree_map_with_path(put, tree)


def state_shardings(state, mesh, specs):
    return jax.tree_util.tree_map_with_path(
        lambda path, x: NamedSharding(mesh, specs[dotted(path).split(".")[-1]] if len(x.shape) else P()), state)


def gathered(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True))
                                  if isinstance(x, jax.Array) and not x.is_fully_addressable else np.asarray(x), tree)


def digest(tree):
    h = hashlib.sha256()
    for x in jax.tree_util.tree_leaves(gathered(tree)):
        h.update(np.ascontiguousarray(x).tobytes())
    return h.hexdigest()


def local_share(state):
    """Adam coordinates in this process's replica-0 shards (what it must certify)."""
    n = 0
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        if ".mu." in "." + dotted(path) + ".":
            n += sum(s.data.size for s in x.addressable_shards if s.replica_id == 0)
    return n


def log(msg):
    if os.environ.get("JG_MP_LOG"):
        print(f"[{PID}] {time.time() - T0:.0f}s {msg}", file=sys.stderr, flush=True)


def write_job():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
    params = place(host_params(), mesh, SPECS)
    abstract = jax.eval_shape(TX.init, params)
    st_sh = state_shardings(abstract, mesh, SPECS)
    p_sh = jax.tree_util.tree_map(lambda x: x.sharding, params)
    state = jax.jit(TX.init, out_shardings=st_sh)(params)

    @jax.jit
    def step(p, s, x, ids, y):
        g = jax.grad(loss)(p, x, ids, y)
        u, s = TX.update(g, s, p)
        return optax.apply_updates(p, u), s

    step = jax.jit(step, out_shardings=(p_sh, st_sh))
    for i in range(6):
        params, state = step(params, state, *batch(i))
    log('rep = {"process": PID')
    rep = {"process": PID, "devices": len(jax.devices()), "local_devices": len(jax.local_devices())}

    log('s = jg.save(f"{OUT}/jg"')
    s = jg.save(f"{OUT}/jg", state, params, lr=LR, weight_decay=WD)
    rep["save"] = {k: s[k] for k in ("coordinates", "escapes", "container_bytes", "checkpoint_bytes", "total")}
    rep["expected_share"] = local_share(state)
    man = json.load(open(f"{OUT}/jg/manifest.json"))
    mine = {(e, tuple(r["start"]), tuple(r["shape"])) for e, recs in man["shards"].items() for r in recs
            if r["file"] == f"process_{PID:05d}.{s['save_id']}.jaxguard"}
    held = set()
    for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
        d = dotted(path)
        if ".nu." in "." + d + ".":
            continue
        leaf = next(lf for lf in man["state"]["leaves"] if lf["path"] == d)
        for sh in x.addressable_shards:
            if sh.replica_id == 0:
                start = tuple(0 if sl.start is None else sl.start for sl in sh.index)
                held.add((leaf["entry"], start, tuple(sh.data.shape)))
    rep["file_holds_exactly_my_shards"] = mine == held
    rep["my_shard_count"] = len(mine)

    log('opts = ocp.CheckpointManagerOp')
    opts = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=True)
    with ocp.CheckpointManager(f"{OUT}/orb", options=opts) as mngr:
        mngr.save(6, args=ocp.args.Composite(params=ocp.args.StandardSave(params),
                                             opt_state=jgc.GuardedSave(state, params=params, lr=LR,
                                                                       weight_decay=WD)))
        mngr.wait_until_finished()
    log('mesh2 = Mesh(')
    mesh2 = Mesh(np.array(jax.devices()[::-1]), ("z",))
    like = jax.jit(TX.init, out_shardings=state_shardings(abstract, mesh2, OTHER))(params)
    log('r_jg = jg.load')
    r_jg = jg.load(f"{OUT}/jg", like)
    with ocp.CheckpointManager(f"{OUT}/orb") as mngr:
        r_orb = mngr.restore(6, args=ocp.args.Composite(opt_state=jgc.GuardedRestore(like)))["opt_state"]
    log('rep["restored_sharding_is_like')
    rep["restored_sharding_is_like"] = all(a.sharding == b.sharding for a, b in zip(
        jax.tree_util.tree_leaves(r_jg), jax.tree_util.tree_leaves(like)))
    rep["digest_jg"], rep["digest_orb"] = digest(r_jg), digest(r_orb)
    log('orig = gathered(')
    save_gathered(f"{OUT}/orig.npz", {"params": params, "state": state})

    log('# whole-state jitted')
    # whole-state jitted save hook: 3 steps, one trace
    traces = []

    def step_enc(p, s, x, ids, y, k):
        traces.append(1)
        p, s = step(p, s, x, ids, y)
        return p, s, jg.encode_state_jit(s, p, k, capacity=1 << 14)

    step_enc = jax.jit(step_enc)
    for i in range(6, 9):
        k = jg.state_constants(state, params, lr=LR, weight_decay=WD, step=i + 1)
        log(f"constants {i}")
        params, state, enc = step_enc(params, state, *batch(i), k)
        log(f"step {i}")
    log('rep["jit_traces"]')
    rep["jit_traces"] = len(traces)
    rep["write"] = jg.write(f"{OUT}/jit", enc, k)["total"]
    log('jg.save(f"{OUT}/jg9"')
    jg.save(f"{OUT}/jg9", state, params, lr=LR, weight_decay=WD)
    log('rep["digest_jit"]')
    rep["digest_jit"] = digest(jg.load(f"{OUT}/jit", like))
    rep["digest_jg9"] = digest(jg.load(f"{OUT}/jg9", like))
    save_gathered(f"{OUT}/orig9.npz", {"params": params, "state": state})
    json.dump(rep, open(f"{OUT}/write_{PID}.json", "w"))


def save_gathered(path, tree):
    """Gather `tree` (a collective: every process calls it) and let process 0 write it, by dotted path."""
    full = gathered(tree)
    if PID == 0:
        np.savez(path, **{d: np.asarray(x) for d, x in flat_by_dotted(full).items()})


def from_npz(path, mesh, specs, template):
    z = np.load(path)
    flat, tdef = jax.tree_util.tree_flatten_with_path(template)
    return place(jax.tree_util.tree_unflatten(tdef, [z[dotted(p)] for p, _ in flat]), mesh, specs)


def real_gradient(params):
    g = jax.grad(loss)(params, *batch(99))
    gmax = max(float(jnp.max(jnp.abs(x))) for x in jax.tree_util.tree_leaves(g))
    return jax.tree_util.tree_map(lambda x: x * (CLIP / gmax), g)   # the real direction, |g| <= C


def read_job():
    mesh = Mesh(np.array(jax.devices()), ("z",))
    hp = host_params()
    template = {"params": hp, "state": TX.init(hp)}
    rep = {"devices": len(jax.devices())}
    for tag, path, npz in (("jg", "jg", "orig"), ("orb", None, "orig"), ("jit", "jit", "orig9"), ("jg9", "jg9", "orig9")):
        orig = from_npz(f"{OUT}/{npz}.npz", mesh, OTHER, template)
        like = jax.tree_util.tree_map(jnp.zeros_like, orig["state"])
        if path:
            r = jg.load(f"{OUT}/{path}", like)
        else:
            with ocp.CheckpointManager(f"{OUT}/orb") as mngr:
                r = mngr.restore(6, args=ocp.args.Composite(opt_state=jgc.GuardedRestore(like)))["opt_state"]
        rep[f"digest_{tag}"] = digest(r)
        res = audit(TX, orig["state"], r, orig["params"], lr=LR, clip=CLIP, gradients=[real_gradient(orig["params"])])
        rep[f"audit_{tag}"] = {k: res[k] for k in ("violations", "coordinates", "gradients", "max_gap_lr")}
        rep[f"changed_{tag}"] = int(sum(np.sum(np.asarray(a) != np.asarray(b)) for a, b in zip(
            jax.tree_util.tree_leaves(r), jax.tree_util.tree_leaves(orig["state"]))))
    json.dump(rep, open(f"{OUT}/read.json", "w"))


if __name__ == "__main__":
    write_job() if MODE == "write" else read_job()
