"""Runs tests/fault_jax_worker.py jobs (real processes, gloo on localhost) and checks what
a fault left behind; shared by tests/optax/test_faults.py (a subset) and bench/faults.py (the matrix)."""
import glob
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "fault_jax_worker.py")
LR, WD, CLIP = 1e-3, 1e-2, 0.2
GRACE = 3.0   # seconds the survivors of a SIGKILL get before the "scheduler" tears the job down


def free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def env():
    e = dict(os.environ)
    e["PYTHONPATH"] = os.path.dirname(HERE) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("XLA_FLAGS", None)
    e["JAX_PLATFORMS"] = "cpu"
    return e


def fill(mnt):
    """Fill the filesystem mounted at `mnt` with ``mnt/ballast`` until a write fails (a full disk)."""
    fd = os.open(os.path.join(mnt, "ballast"), os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError:
        pass
    finally:
        os.close(fd)


def kill_mid_write(storage, suffix=""):
    """Make `storage.atomic_write_with` (jaxguard.format.storage) write half of each file whose
    path ends with `suffix` to its temporary file, fsync it, and SIGKILL this process."""
    import io
    import signal
    real = storage.atomic_write_with

    def half_then_die(p, write, **kw):
        if not str(p).endswith(suffix):
            return real(p, write, **kw)

        def w(fh):
            buf = io.BytesIO()
            write(buf)
            fh.write(buf.getvalue()[:len(buf.getvalue()) // 2])
            fh.flush()
            os.fsync(fh.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        return real(p, w, **kw)
    storage.atomic_write_with = half_then_die


def _tear_down(procs, victim, grace_end, t_end, killed):
    """Wait for the job: after the fault, the others until `grace_end` (then killed, as a
    scheduler would, and listed in `killed`); every process until `t_end`."""
    try:
        if grace_end is not None:
            if victim is not None:
                procs[victim].wait(timeout=max(0.1, t_end - time.time()))
                grace_end = time.time() + GRACE
            for i, p in enumerate(procs):
                try:
                    p.wait(timeout=max(0.1, grace_end - time.time()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    killed.append(i)
        for p in procs:
            p.wait(timeout=max(1, t_end - time.time()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise


def run_save(d, steps, fault="none", victim=-1, nproc=2, timeout=600, truth=None, report=None):
    """One multi-process save of a `steps`-step state to `d` with `fault` in process `victim`.

    Returns:
      {"reports": {pid: report}, "returncodes": [...], "killed": [pids torn down], "log": tail}.
    """
    report = report or d.rstrip("/") + ".report"
    for f in glob.glob(report + ".*.json"):
        os.unlink(f)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, "save", str(i), str(nproc), str(port), d, str(steps), fault,
                               str(victim), report] + ([truth] if truth else []), env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(nproc)]
    killed = []
    kill = fault.startswith("kill") and 0 <= victim < nproc
    _tear_down(procs, victim if kill else None, 0.0 if kill else None, time.time() + timeout, killed)
    logs = [p.stdout.read() for p in procs]
    reports = {}
    for i in range(nproc):
        f = f"{report}.{i}.json"
        if os.path.exists(f):
            reports[i] = json.load(open(f))
    return {"reports": reports, "returncodes": [p.returncode for p in procs], "killed": killed,
            "log": [x[-3000:] for x in logs], "fatal": {i: fatal_line(x) for i, x in enumerate(logs) if fatal_line(x)}}


FATAL = re.compile(r"^F\d{4} [\d:.]+\s+\d+ ([\w.]+:\d+)\] (.*)$", re.M)


def fatal_line(log):
    """The LOG(FATAL) line of an absl/XLA abort in a process's output (``file:line]`` and the
    message's first two sentences), or None."""
    m = FATAL.search(log or "")
    return f"{m.group(1)}] {'. '.join(m.group(2).split('. ')[:2]).rstrip('.')[:260]}." if m else None


def run_loops(d, steps_list, rounds):
    """Jobs (one process each) saving to the same `d` at once; returns their reports."""
    procs = [subprocess.Popen([sys.executable, WORKER, "loop", d, str(s), str(rounds), f"{d}.loop{s}.json"],
                              env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for s in steps_list]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    return [json.load(open(f"{d}.loop{s}.json")) for s in steps_list]


def copy_checkpoint(src, dst):
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    shutil.copy(src + ".truth.npz", dst + ".truth.npz")


def truth(npz):
    """(tx, params, state) of the exact state a save wrote (``DIR.truth.npz``)."""
    import jax
    import optax
    from jaxguard.optax_state import dotted
    z = np.load(npz)
    tx = optax.adamw(LR, weight_decay=WD)
    hp = {k.split(".", 1)[1]: z[k] for k in z.files if k.startswith("params.")}
    tmpl = {"params": hp, "state": tx.init(hp)}
    flat, tdef = jax.tree_util.tree_flatten_with_path(tmpl)
    full = jax.tree_util.tree_unflatten(tdef, [z[dotted(p)] for p, _ in flat])
    return tx, full["params"], full["state"]


def digest(tree):
    import jax
    h = hashlib.sha256()
    for x in jax.tree_util.tree_leaves(tree):
        h.update(np.ascontiguousarray(np.asarray(x)).tobytes())
    return h.hexdigest()


def check(d, npz):
    """Load `d` (1 process, host arrays) and audit it against the exact state in `npz`.

    Returns:
      {"digest", "violations", "max_gap_lr", "save_id"} or {"error": the one line}.
    """
    import jax
    import jaxguard as jg
    from jaxguard import sharded
    from jaxguard.optax_adapter import audit
    tx, params, state = truth(npz)
    like = jax.tree_util.tree_map(np.asarray, state)
    try:
        r = jg.load(d, like)
    except Exception as exc:  # noqa: BLE001 - the line the user sees
        return {"error": f"{type(exc).__name__}: {exc}"}
    res = audit(tx, state, r, params, lr=LR, clip=CLIP)
    return {"digest": digest(r), "violations": int(res["violations"]), "max_gap_lr": float(res["max_gap_lr"]),
            "save_id": sharded.read_manifest(d).get("save_id") if os.path.isdir(d) else None}


def run_orbax(d, steps, fault="none", sharded=False, timeout=600):
    """One 1-process orbax CheckpointManager (async) + GuardedSave job; returns (returncode, log tail)."""
    p = subprocess.run([sys.executable, WORKER, "orbax", d, str(steps), fault, "1" if sharded else "0"], env=env(),
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, (p.stdout + p.stderr)[-3000:]


def run_orbax_mp(d, steps, fault="none", victim=-1, nproc=2, timeout=600, report=None, blocked=90.0):
    """An `nproc`-process orbax CheckpointManager (async) + GuardedSave job (gloo).

    After a SIGKILL the survivors get `GRACE` seconds; after any other fault the job gets
    `blocked` seconds from its start (orbax's barriers wait up to ``AsyncOptions.timeout_secs``,
    1200 s by default); then what is left is torn down, as a scheduler would.

    Returns:
      {"reports": {pid: report}, "returncodes": [...], "killed": [pids torn down], "log": tails}.
    """
    report = report or d.rstrip("/") + ".report"
    for f in glob.glob(report + ".*.json"):
        os.unlink(f)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, WORKER, "orbaxmp", str(i), str(nproc), str(port), d, str(steps), fault,
                               str(victim), report], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(nproc)]
    logs = [[] for _ in procs]
    readers = [threading.Thread(target=lambda p=p, out=out: out.append(p.stdout.read()), daemon=True)
               for p, out in zip(procs, logs)]
    for t in readers:
        t.start()
    killed = []
    t_start = time.time()
    t_end = t_start + timeout
    kill = fault.startswith("kill") and 0 <= victim < nproc
    _tear_down(procs, victim if kill else None, None if fault == "none" else t_start + blocked, t_end, killed)
    for t in readers:
        t.join(timeout=10)
    reports = {i: json.load(open(f"{report}.{i}.json")) for i in range(nproc) if os.path.exists(f"{report}.{i}.json")}
    logs = ["".join(x) for x in logs]
    return {"reports": reports, "returncodes": [p.returncode for p in procs], "killed": killed,
            "log": [x[-3000:] for x in logs], "fatal": {i: fatal_line(x) for i, x in enumerate(logs) if fatal_line(x)}}


def check_orbax(d, npz):
    """Restore the latest step orbax reports at `d` and audit it against `npz`."""
    import jax
    import orbax.checkpoint as ocp
    import jaxguard.checkpoint as jgc
    from jaxguard.optax_adapter import audit
    tx, params, state = truth(npz)
    like = jax.tree_util.tree_map(np.asarray, state)
    try:
        with ocp.CheckpointManager(d) as mngr:
            step = mngr.latest_step()
            r = mngr.restore(step, args=ocp.args.Composite(opt_state=jgc.GuardedRestore(like)))["opt_state"]
    except Exception as exc:  # noqa: BLE001 - the line the user sees
        return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    res = audit(tx, state, r, params, lr=LR, clip=CLIP)
    return {"step": step, "digest": digest(r), "violations": int(res["violations"]),
            "max_gap_lr": float(res["max_gap_lr"])}


# ---------------------------------------------------------------- torch DCP (tests/fault_dcp_worker.py)
DCP_WORKER = os.path.join(HERE, "fault_dcp_worker.py")


def run_dcp_save(d, steps, fault="none", victim=-1, api="save", nproc=2, timeout=600, report=None):
    """One `nproc`-rank guarded DCP save (FSDP2, gloo) of a `steps`-step state to `d`; as `run_save`."""
    report = report or d.rstrip("/") + ".report"
    for f in glob.glob(report + ".*.json"):
        os.unlink(f)
    port = free_port()
    e = env()
    e["OMP_NUM_THREADS"] = "1"
    procs = [subprocess.Popen([sys.executable, DCP_WORKER, str(i), str(nproc), str(port), d, str(steps), fault,
                               str(victim), api, report], env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for i in range(nproc)]
    killed = []
    try:
        if fault.startswith("kill") and 0 <= victim < nproc:
            procs[victim].wait(timeout=timeout)
            grace_end = time.time() + GRACE
            for i, p in enumerate(procs):
                try:
                    p.wait(timeout=max(0.1, grace_end - time.time()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    killed.append(i)
        for p in procs:
            p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    logs = [p.stdout.read()[-3000:] for p in procs]
    reports = {i: json.load(open(f"{report}.{i}.json")) for i in range(nproc) if os.path.exists(f"{report}.{i}.json")}
    return {"reports": reports, "returncodes": [p.returncode for p in procs], "killed": killed, "log": logs}


def _dcp_load(path, guarded):
    sys.path.insert(0, HERE)
    import _dcp_worker as W
    from torch_compat.dcp import GuardedLoadPlanner
    return W.load_into(path, None, GuardedLoadPlanner(path) if guarded else None)


def check_dcp(d, plain):
    """Load guarded DCP `d` into one plain process (GuardedLoadPlanner) and audit it against the
    plain DCP save `plain` with the real torch Adam step.

    Returns:
      {"digest", "violations", "max_gap_lr", "weights_identical"} or {"error": the one line}.
    """
    import torch
    from jaxguard.audit import gradient_grid
    from torch_compat.dcp import first_update_audit
    try:
        test = _dcp_load(d, True)
    except BaseException as exc:  # noqa: BLE001 - the line the user sees
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}",
                "lines": len(str(exc).strip().splitlines())}
    ref = _dcp_load(plain, False)
    h = hashlib.sha256()
    for p in test[0].parameters():
        h.update(p.detach().numpy().tobytes())
        for k in ("exp_avg", "exp_avg_sq", "step"):
            h.update(test[1].state[p][k].detach().numpy().tobytes())
    same_w = all(torch.equal(a, b) for a, b in zip(ref[0].parameters(), test[0].parameters()))
    a = first_update_audit(ref, test, tau=0.01, clip=CLIP, grid=gradient_grid(CLIP))
    return {"digest": h.hexdigest(), "violations": int(a["violations"]), "max_gap_lr": float(a["max_gap_lr"]),
            "weights_identical": same_w}


def dcp_refusal(d):
    """The line `jaxguard verify` (torch_compat.dcp.verify_dir) and a guarded dcp.load give for `d`."""
    from torch_compat.dcp import verify_dir
    out = {}
    for who, fn in (("verify", lambda: verify_dir(d)), ("dcp.load", lambda: _dcp_load(d, True))):
        try:
            fn()
            out[who] = "loaded (no error)"
        except BaseException as exc:  # noqa: BLE001 - the line the user sees
            s = str(exc).strip()
            out[who] = f"{type(exc).__name__}: {s.splitlines()[0] if s else ''}"[:300]
            out[who + "_lines"] = len(s.splitlines())
            inner = [e for e, _ in getattr(exc, "failures", {}).values()]
            if inner:   # DCP's CheckpointException: the rank errors it wraps
                out[who + "_inner"] = sorted({f"{type(e).__name__}: {str(e).strip().splitlines()[0][:240]}"
                                              for e in inner})
                out[who + "_inner_one_line_jaxguard"] = all(
                    type(e).__name__ in ("CheckpointError", "ContainerError") and "\n" not in str(e).strip()
                    for e in inner)
    return out
