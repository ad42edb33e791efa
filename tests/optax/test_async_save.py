"""Non-blocking saves: orbax `CheckpointManager(enable_async_checkpointing=True)` with
`GuardedSave`, and `torch.distributed.checkpoint.async_save` with `GuardedSavePlanner` on 2
gloo ranks.  The save call returns before the guard has run (the guard is held on an event
that the test sets only after the call returned: an encode inside the call would time out),
the training loop may change the state meanwhile, the file is byte-identical to a blocking
save's, and a refusal in the background encode surfaces as a jaxguard error and commits
nothing."""
import json
import os
import pickle
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

ocp = pytest.importorskip("orbax.checkpoint", reason="needs orbax-checkpoint")

import jaxguard.checkpoint as jgc  # noqa: E402
from jaxguard import optax_adapter  # noqa: E402
from jaxguard.core import guard  # noqa: E402
from jaxguard.errors import JaxguardError  # noqa: E402
from jaxguard.format import reader  # noqa: E402

LR = 1e-3
HOLD_S = 60          # how long a held guard waits for the test before it gives up


def _state(n=3000):
    params = {"w": jnp.linspace(-1, 1, n, dtype=jnp.float32).reshape(-1, 50), "b": jnp.zeros(50)}
    tx = optax.adam(LR)
    st = tx.init(params)
    for k in range(3):
        g = jax.tree_util.tree_map(lambda p: jnp.cos(p * (k + 2.0)) * 0.05, params)
        u, st = tx.update(g, st, params)
        params = optax.apply_updates(params, u)
    return tx, params, st


@pytest.fixture
def held(monkeypatch):
    """The guard waits for `release` before it encodes; records the threads it ran on."""
    release, threads, encode_many = threading.Event(), [], guard.encode_many

    def many(items, **kw):
        threads.append(threading.get_ident())
        if not release.wait(HOLD_S):
            raise AssertionError("the guard was never released: the save call waited for the encode")
        return encode_many(items, **kw)

    monkeypatch.setattr(guard, "encode_many", many)
    return release, threads


def _save(mngr, step, params, st, **kw):
    mngr.save(step, args=ocp.args.Composite(opt_state=jgc.GuardedSave(st, params=params, lr=LR, **kw)))


def _canon(data):
    """A container as (header without the encode timings, payload): two blocking saves of one
    state differ only in the ``encode_seconds`` their headers record."""
    header, payload = reader.parse(data)

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("encode_seconds", "header_sha256")}
        return [strip(v) for v in x] if isinstance(x, list) else x

    return json.dumps(strip(header), sort_keys=True), bytes(payload)


def _files(d):
    return {os.path.relpath(os.path.join(r, f), d): open(os.path.join(r, f), "rb").read()
            for r, _, fs in os.walk(d) for f in fs if f.endswith(".jaxguard")}


@pytest.mark.parametrize("sharded", [False, True])
def test_orbax_async_save_returns_before_the_guard_and_writes_the_blocking_bytes(tmp_path, held, sharded):
    release, threads = held
    tx, params, st = _state()
    step = jax.jit(lambda p, s: tx.update(jax.tree_util.tree_map(jnp.sin, p), s, p)[1], donate_argnums=1)
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    with ocp.CheckpointManager(tmp_path / "async", options=opts) as mngr:
        _save(mngr, 1, params, st, sharded=sharded)
        assert threading.get_ident() not in threads      # the call returned; no guard ran on this thread
        saved = st
        st = step(params, st)                            # the next step donates (and rewrites) the state
        if not sharded:   # the save holds host views: the runtime kept the buffers (no donation)
            assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(saved))
        release.set()
        mngr.wait_until_finished()
        assert mngr.all_steps() == [1]
    assert threads and threading.get_ident() not in threads
    _, params, st = _state()
    with ocp.CheckpointManager(tmp_path / "sync", options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=False)) as mngr:
        _save(mngr, 1, params, st, sharded=sharded)
    got, want = _files(tmp_path / "async" / "1"), _files(tmp_path / "sync" / "1")
    assert len(got) == len(want) >= 1
    if sharded:      # file names carry each save's random id
        got, want = ({re.sub(r"\.[0-9a-f]{24}", "", k): v for k, v in f.items()} for f in (got, want))
    assert sorted(got) == sorted(want)
    for k in got:
        assert _canon(got[k]) == _canon(want[k]), k
    if not sharded:
        data, _ = optax_adapter.to_bytes(st, params, lr=LR)
        assert _canon(got["opt_state/" + jgc.FILENAME]) == _canon(data)
    with ocp.CheckpointManager(tmp_path / "async") as mngr:
        r = mngr.restore(1, args=ocp.args.Composite(opt_state=jgc.GuardedRestore(tx.init(params))))
    assert optax_adapter.audit(tx, st, r["opt_state"], params, lr=LR)["violations"] == 0


@pytest.mark.parametrize("leaves", ["jax", "numpy"])
def test_orbax_async_saves_snapshot_without_copies_and_each_writes_its_own_state(tmp_path, leaves):
    """Three async saves of a changing state, each next step donating the last one's.  CPU JAX
    arrays are taken as host views, no copy: the runtime then does not donate them (the
    arrays are not deleted), so the views keep the saved values.  numpy leaves (which the
    caller may change in place) are copied into the first save's buffers, lent again once its
    encode finished.  Every step's file is that of a blocking save of the state at that step."""
    tx, params, st = _state()
    step = jax.jit(lambda p, s: tx.update(jax.tree_util.tree_map(jnp.sin, p), s, p)[1], donate_argnums=1)
    handler = jgc.GuardedCheckpointHandler()
    seen, states = [], []
    lend = handler._buffers.lend

    def spying_lend():
        snapshot, lent, viewed = lend()
        seen.append((lent, viewed))
        return snapshot, lent, viewed
    handler._buffers.lend = spying_lend
    reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
    reg.add("opt_state", jgc.GuardedSave, handler)
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    with ocp.CheckpointManager(tmp_path / "async", options=opts, handler_registry=reg) as mngr:
        for k in range(1, 4):
            states.append(jax.tree_util.tree_map(np.array, st))
            saved = st if leaves == "jax" else jax.tree_util.tree_map(np.array, st)
            _save(mngr, k, params, saved)
            st = step(params, st)
            if leaves == "numpy":
                jax.tree_util.tree_map(lambda x: x.fill(0) if isinstance(x, np.ndarray) and x.size > 1 else None,
                                       saved)   # the caller reuses its arrays: the save must not see it
            mngr.wait_until_finished()
    moments = [x for x in jax.tree_util.tree_leaves(states[0]) if np.size(x) > 1]
    if leaves == "jax":
        assert all(len(viewed) >= len(moments) and not [b for b in lent if b.size > 1] for lent, viewed in seen)
    else:
        first = {id(b) for b in seen[0][0]}
        assert len(first) >= len(moments) and all({id(b) for b in lent} == first for lent, _ in seen[1:])
    for k, want_state in enumerate(states, 1):
        got = open(tmp_path / "async" / str(k) / "opt_state" / jgc.FILENAME, "rb").read()
        want, _ = optax_adapter.to_bytes(jax.tree_util.tree_map(jnp.asarray, want_state), params, lr=LR)
        assert _canon(got) == _canon(want), k


def test_orbax_async_save_refuses_a_state_donated_while_it_was_read(tmp_path, held):
    """If an array the save took as a host view is donated (deleted) before the encode has
    read it, the save refuses in one line from wait_until_finished and commits no step."""
    release, _ = held
    tx, params, st = _state()
    opts = ocp.CheckpointManagerOptions(enable_async_checkpointing=True)
    with ocp.CheckpointManager(tmp_path / "async", options=opts) as mngr:
        _save(mngr, 1, params, st)
        st.inner_state[0].mu["w"].delete() if hasattr(st, "inner_state") else st[0].mu["w"].delete()
        release.set()
        with pytest.raises(Exception) as e:
            mngr.wait_until_finished()
        assert mngr.all_steps() == []
    assert "was donated to a later step" in str(e.value)


def test_orbax_background_refusal_raises_a_jaxguard_error_and_commits_no_step(tmp_path, monkeypatch):
    encode_many = guard.encode_many

    def one_ulp_off(items, **kw):          # certified values the reader does not decode to
        encs = encode_many(items, **kw)
        for e in encs:
            m = np.array(e.decoded[0], np.float32)
            m.reshape(-1)[0] = np.nextafter(m.reshape(-1)[0], np.float32(np.inf))
            e.decoded = (m, e.decoded[1])
        return encs

    monkeypatch.setattr(guard, "encode_many", one_ulp_off)
    _, params, st = _state()
    with ocp.CheckpointManager(tmp_path / "c", options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=True)) as mngr:
        _save(mngr, 1, params, st)               # returns: the refusal happens in the background
        with pytest.raises(BaseException) as info:
            mngr.wait_until_finished()
        chain, exc = [], info.value
        while exc is not None:
            chain.append(exc)
            exc = exc.__cause__ or exc.__context__
        assert any(isinstance(e, JaxguardError) for e in chain), [type(e).__name__ for e in chain]
        assert any("certified" in str(e) for e in chain), [str(e) for e in chain]
        assert mngr.all_steps() == []
    assert not (tmp_path / "c" / "1").exists()
    assert not list((tmp_path / "c").rglob(jgc.FILENAME))


def test_orbax_async_save_of_a_state_it_cannot_guard_raises_at_its_own_step(tmp_path):
    params = {"w": jnp.ones(300)}
    st = optax.sgd(1e-3).init(params)                    # no Adam moments to guard
    with ocp.CheckpointManager(tmp_path / "c", options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=True)) as mngr:
        with pytest.raises(jgc.CheckpointError, match="Adam"):   # from the args, before orbax starts the step
            _save(mngr, 1, params, st)
        mngr.wait_until_finished()
        assert mngr.all_steps() == []
    assert not [n for n in os.listdir(tmp_path / "c") if "tmp" in n]


# ---------------------------------------------------------------- DCP on 2 gloo ranks
def _dcp_rank(rank, world, port, root):
    import time
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    import _dcp_worker as W
    from torch_compat.dcp import GuardedSavePlanner

    torch.set_num_threads(1)
    release, threads = threading.Event(), []

    class Held(GuardedSavePlanner):         # the real planner, held until the caller got its future
        def create_local_plan(self):
            threads.append(threading.get_ident())
            if not release.wait(HOLD_S):
                raise AssertionError("async_save waited for the guarded planner")
            return super().create_local_plan()

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    ckpt_pg = dist.new_group(backend="gloo")      # the save's collectives, apart from training's
    mesh = init_device_mesh("cpu", (world,))
    model, opt = W.build(mesh)
    for s in range(5):
        W.train_step(model, opt, s, rank, world)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/sync", planner=GuardedSavePlanner(),
             process_group=ckpt_pg)
    t0 = time.perf_counter()
    fut = dcp.async_save({"model": msd, "optim": osd}, checkpoint_id=f"{root}/async", planner=Held(),
                         process_group=ckpt_pg)
    returned_s = time.perf_counter() - t0
    on_caller = threading.get_ident() in threads
    W.train_step(model, opt, 5, rank, world)          # the loop goes on; the staged copy is saved
    release.set()
    fut.result()
    res = {"on_caller": on_caller, "planned": len(threads), "returned_s": returned_s,
           "planner_thread_is_caller": threading.get_ident() in threads}
    with open(os.path.join(root, f"async{rank}.json"), "w") as fh:
        json.dump(res, fh)
    dist.barrier()
    dist.destroy_process_group()


def _dcp_dir(d):
    """({shard key: _canon(container)}, the manifest's tensor-chunk hashes, the manifest's
    moments without the containers' own hashes and sizes, the totals without timings)."""
    from torch_compat import dcp as tdcp
    with open(f"{d}/.metadata", "rb") as fh:
        md = pickle.load(fh)
    shards = {}
    for idx, info in md.storage_data.items():
        if idx.fqn.startswith(tdcp.SHARD_PREFIX):
            with open(os.path.join(d, info.relative_path), "rb") as fh:
                fh.seek(info.offset)
                shards[idx.fqn] = _canon(fh.read(info.length))
    man = tdcp.manifest_of(md)
    moments = {k: {**e, "shards": [{f: v for f, v in sh.items() if f not in ("sha256", "bytes")} for sh in e["shards"]]}
               for k, e in man["moments"].items()}
    totals = {k: v for k, v in man["totals"].items() if "seconds" not in k and k != "container_bytes"}
    return shards, man["tensors"], moments, totals


def test_dcp_async_save_plans_in_the_background_and_writes_the_blocking_bytes(tmp_path):
    torch = pytest.importorskip("torch", reason="needs torch")
    import torch.multiprocessing as mp
    import _dcp_worker as W
    from torch_compat import dcp as tdcp
    root = str(tmp_path)
    mp.start_processes(_dcp_rank, args=(2, W.free_port(), root), nprocs=2, start_method="spawn", join=True)
    for r in range(2):
        res = json.load(open(os.path.join(root, f"async{r}.json")))
        assert not res["on_caller"] and not res["planner_thread_is_caller"] and res["planned"] == 1, res
    got = [_dcp_dir(f"{root}/{d}") for d in ("sync", "async")]
    assert got[0] == got[1]
    assert len(got[0][0]) >= 4 and got[0][1]      # the guarded shards of both ranks, and the weights' hashes
    assert torch is not None
