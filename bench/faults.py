"""The fault matrix of the sharded JAX save (2 processes x 2 CPU devices, gloo on localhost)
and of the single-file save: what survives each fault and the line the user sees.

    nice -n 19 python bench/faults.py [--out bench/results/faults.json] [--only kill_mid_file]

Every row starts from a committed checkpoint (4 training steps) copied to its own path,
then the same job 4 steps later saves to that path with the fault injected into the real
write path of one process (tests/fault_jax_worker.py says where each fault hits).  A row
passes when the checkpoint that `load` returns afterwards is the last committed one
(same save id, the same decoded bits, real optax first-update audit 0 over tau) and the
next save to that path commits and leaves only its own files.  bench/results/faults.md is
written from the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import fault_harness as H  # noqa: E402

KILLS = [("kill_encode", 1), ("kill_before_write", 1), ("kill_mid_file", 0), ("kill_mid_file", 1),
         ("kill_after_files", 1), ("kill_before_manifest", 0), ("kill_mid_manifest", 0),
         ("kill_after_manifest", 0), ("raise", 0), ("raise", 1)]


def seen(r, victim):
    out = []
    for i in sorted(set(range(len(r["returncodes"]))) | set(r["reports"])):
        rep = r["reports"].get(i)
        if rep is None:
            out.append(f"p{i}: " + ("SIGKILLed" if i == victim and r["returncodes"][i] == -9 else
                                    "torn down (blocked in the save's agreement)" if i in r["killed"] else
                                    f"aborted by JAX (SIGABRT): `{r['fatal'][i]}`"
                                    if r["returncodes"][i] == -6 and r.get("fatal", {}).get(i) else
                                    f"exit {r['returncodes'][i]}"))
        else:
            out.append(f"p{i}: " + ("saved" if rep["ok"] else rep["error"]))
    return out


def next_save_cleans(path):
    """A 1-process save to the same path: it commits and leaves only its own file."""
    import jaxguard as jg
    _, params, state = H.truth(path + ".truth.npz")
    s = jg.save(path, state, params, lr=H.LR, weight_decay=H.WD, sharded=True)
    return sorted(os.listdir(path)) == ["manifest.json", f"process_00000.{s['save_id']}.jaxguard"]


def row_kill(w, base, c0, fault, victim, nproc=2):
    f = os.path.join(w, f"{fault}_{victim}" + (f"_n{nproc}" if nproc != 2 else ""))
    H.copy_checkpoint(base, f)
    t = time.time()
    r = H.run_save(f, 8, fault, victim, nproc=nproc)
    from jaxguard import sharded
    named = set(sharded.read_manifest(f)["files"]) | {sharded.MANIFEST}
    left = sorted(set(os.listdir(f)) - named)          # what no manifest names: the next save removes it
    if fault == "kill_after_manifest":     # the new save had committed: it is the checkpoint now
        c = H.check(f, f + ".new.truth.npz")
        survived = "new checkpoint (committed before the kill)" if c.get("violations") == 0 and \
            c.get("save_id") != c0["save_id"] else "LOST"
    else:
        c = H.check(f, f + ".truth.npz")
        survived = "previous checkpoint" if c == c0 else "LOST"
    return {"path": f"jaxguard.save sharded ({nproc} proc)", "fault": fault, "victim": victim, "survived": survived,
            "check": c, "seen": seen(r, victim), "leftovers": left, "next_save_cleans": next_save_cleans(f),
            "seconds": round(time.time() - t, 1)}


def row_full_tmpfs(w, base, c0):
    mnt = os.path.join(w, "tmpfs")
    os.makedirs(mnt, exist_ok=True)
    used = sum(os.path.getsize(os.path.join(base, n)) for n in os.listdir(base))
    size = (used * 3 // 2 // 4096 + 2) * 4096          # room for the old checkpoint and half a new one
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt], capture_output=True, text=True)
    if m.returncode:
        return {"path": "jaxguard.save sharded (2 proc)", "fault": "full disk (tmpfs)", "victim": "-",
                "survived": "SKIPPED", "seen": [f"cannot mount a tmpfs: {m.stderr.strip()[:100]}"]}
    try:
        f = os.path.join(mnt, "ck")
        shutil.copytree(base, f)
        truth = os.path.join(w, "tmpfs_ck.truth.npz")
        shutil.copy(base + ".truth.npz", truth)
        r = H.run_save(f, 8, "full_disk", -1, truth=os.path.join(w, "tmpfs_new.truth.npz"),
                       report=os.path.join(w, "tmpfs_ck.report"))
        c = H.check(f, truth)
        return {"path": "jaxguard.save sharded (2 proc)", "fault": f"full disk (tmpfs {size} B)", "victim": "-",
                "survived": "previous checkpoint" if c == c0 else "LOST", "check": c, "seen": seen(r, -1),
                "leftovers": sorted(set(os.listdir(f)) - set(os.listdir(base)))}
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)


def row_concurrent(w):
    import jax
    import numpy as np
    import optax
    import jaxguard as jg
    from jaxguard import sharded
    d = os.path.join(w, "shared")
    t = time.time()
    reps = H.run_loops(d, [3, 7], rounds=10)
    like = jax.tree_util.tree_map(np.asarray, optax.adamw(H.LR, weight_decay=H.WD).init(
        {"w1": np.zeros((64, 96), np.float32), "b1": np.zeros(96, np.float32), "emb": np.zeros((200, 96), np.float32)}))
    dig, digf = H.digest(jg.load(d, like)), H.digest(jg.load(d + ".jg", like))
    which = [i for i, r in enumerate(reps) if r["digest"] == dig]
    whichf = [i for i, r in enumerate(reps) if r["digest_file"] == digf]
    sid = sharded.read_manifest(d)["save_id"]
    only = sorted(os.listdir(d)) == ["manifest.json", f"process_00000.{sid}.jaxguard"]
    errors = sorted({e for r in reps for e in r["errors"]})
    return {"path": "two 1-process jobs, same path (sharded + one file)", "fault": "concurrent writers x10 rounds",
            "victim": "-", "survived": (f"job {which[0]}'s whole sharded checkpoint, job {whichf[0]}'s whole file"
                                        if which and whichf and only else "MIXED"),
            "seen": errors[:3] or ["both saved every round"], "refused_commits": sum(len(r["errors"]) for r in reps),
            "seconds": round(time.time() - t, 1)}


def row_orbax(w, shard):
    d = os.path.join(w, f"orbax_{int(shard)}")
    t = time.time()
    rc, log = H.run_orbax(d, 4, "none", shard)
    assert rc == 0, log
    c0 = H.check_orbax(d, d + ".truth4.npz")
    rc, log = H.run_orbax(d, 8, "kill_mid_file", shard)
    c = H.check_orbax(d, d + ".truth4.npz")
    left = sorted(n for n in os.listdir(d) if n not in ("4",))
    return {"path": f"orbax CheckpointManager async + GuardedSave({'sharded=True' if shard else 'one file'})",
            "fault": "kill_mid_file", "victim": 0,
            "survived": "previous checkpoint (step 4)" if c == c0 and c0.get("violations") == 0 else "LOST",
            "check": c, "seen": [f"p0: {'SIGKILLed' if rc == -9 else f'exit {rc}'} in orbax's commit thread",
                                 "restore: CheckpointManager.latest_step() is 4"],
            "leftovers": left, "seconds": round(time.time() - t, 1)}


def orbax_mp_seen(r, victim):
    out = []
    for i, rc in enumerate(r["returncodes"]):
        rep = r["reports"].get(i)
        out.append(f"p{i}: " + ("SIGKILLed" if i == victim and rc == -9 and r.get("fault", "").startswith("kill") else
                                "saved" if rep and rep["ok"] else rep["error"] if rep else
                                "torn down (blocked in the save)" if i in r["killed"] else
                                f"aborted by JAX (SIGABRT): `{r['fatal'][i]}`" if rc == -6 and r["fatal"].get(i) else
                                f"exit {rc}"))
    return out


def orbax_leftovers(d):
    left = []
    for root, _, files in os.walk(d):
        rel = os.path.relpath(root, d)
        if rel == "4" or rel.startswith("4" + os.sep):
            continue
        left += [os.path.join(rel, f) for f in files]
    return sorted(left)


def row_orbax_mp(w, fault, victim):
    """orbax CheckpointManager (async) + GuardedSave with 2 JAX processes (gloo): step 4 committed,
    step 8 with `fault` in process `victim`."""
    d = os.path.join(w, f"orbaxmp_{fault}_{victim}")
    t = time.time()
    r = H.run_orbax_mp(d, 4)
    assert r["returncodes"] == [0, 0], r["log"]
    c0 = H.check_orbax(d, d + ".truth4.npz")
    r = H.run_orbax_mp(d, 8, fault, victim)
    c = H.check_orbax(d, d + ".truth4.npz")
    seen = orbax_mp_seen({**r, "fault": fault}, victim)
    seen.append(f"restore: CheckpointManager.latest_step() is {c.get('step')}")
    return {"path": "orbax CheckpointManager async + GuardedSave (2 proc, sharded)", "fault": fault, "victim": victim,
            "survived": "previous checkpoint (step 4)" if c == c0 and c0.get("violations") == 0 else "LOST",
            "check": c, "seen": seen, "leftovers": orbax_leftovers(d), "seconds": round(time.time() - t, 1)}


def row_orbax_mp_full_disk(w):
    """As `row_orbax_mp`, the step-8 save into a tmpfs holding step 4 and room for about half a step."""
    d0 = os.path.join(w, "orbaxmp_disk_base")
    t = time.time()
    r = H.run_orbax_mp(d0, 4)
    assert r["returncodes"] == [0, 0], r["log"]
    c0 = H.check_orbax(d0, d0 + ".truth4.npz")
    used = sum(os.path.getsize(os.path.join(a, f)) for a, _, fs in os.walk(d0) for f in fs)
    size = (used * 3 // 2 // 4096 + 2) * 4096
    mnt = os.path.join(w, "orbaxmp_tmpfs")
    os.makedirs(mnt, exist_ok=True)
    name = "orbax CheckpointManager async + GuardedSave (2 proc, sharded)"
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt], capture_output=True, text=True)
    if m.returncode:
        return {"path": name, "fault": "full disk (tmpfs)", "victim": "-", "survived": "SKIPPED",
                "seen": [f"cannot mount a tmpfs: {m.stderr.strip()[:100]}"]}
    try:
        d = os.path.join(mnt, "ck")
        shutil.copytree(d0, d)
        r = H.run_orbax_mp(d, 8, "full_disk", -1, report=os.path.join(w, "orbaxmp_tmpfs.report"))
        c = H.check_orbax(d, d0 + ".truth4.npz")
        seen = orbax_mp_seen({**r, "fault": "full_disk"}, -1)
        seen.append(f"restore: CheckpointManager.latest_step() is {c.get('step')}")
        return {"path": name, "fault": f"full disk (tmpfs {size} B)", "victim": "-",
                "survived": "previous checkpoint (step 4)" if c == c0 and c0.get("violations") == 0 else "LOST",
                "check": c, "seen": seen, "leftovers": orbax_leftovers(d), "seconds": round(time.time() - t, 1)}
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)


def rows_full_disk_in_process(w):
    """One process: a full tmpfs and a full fsspec filesystem under the single-file and sharded saves."""
    import errno
    import uuid
    import fsspec
    import jax
    import numpy as np
    from fsspec.implementations.memory import MemoryFileSystem
    import jaxguard as jg
    tx, params, state = H.truth(os.path.join(w, "base.truth.npz"))
    _, params2, state2 = H.truth(os.path.join(w, "kill_encode_1.new.truth.npz")) \
        if os.path.exists(os.path.join(w, "kill_encode_1.new.truth.npz")) else (tx, params, state)
    like = jax.tree_util.tree_map(np.asarray, state)

    class Quota(MemoryFileSystem):
        protocol = ("quota",)
        store, pseudo_dirs, quota = {}, [""], 1 << 40

        def pipe_file(self, path, value, **kw):
            if sum(len(f.getvalue()) for f in self.store.values()) + len(value) > self.quota:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().pipe_file(path, value, **kw)

    fsspec.register_implementation("quota", Quota, clobber=True)
    rows = []
    for where in ("tmpfs", "fsspec"):
        for kw in ({}, {"sharded": True}):
            if where == "tmpfs":
                mnt = os.path.join(w, f"tmpfs_{len(rows)}")
                os.makedirs(mnt)
                m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], capture_output=True)
                if m.returncode:
                    continue
                path = os.path.join(mnt, "ck")
            else:
                path = f"quota://{uuid.uuid4().hex}/ck"
            try:
                jg.save(path, state, params, lr=H.LR, weight_decay=H.WD, **kw)
                ref = H.digest(jg.load(path, like))
                if where == "tmpfs":
                    H.fill(mnt)
                else:
                    Quota.quota = sum(len(f.getvalue()) for f in Quota.store.values()) + 4096
                try:
                    jg.save(path, state2, params2, lr=H.LR, weight_decay=H.WD, **kw)
                    line = "saved (no error)"
                except Exception as exc:  # noqa: BLE001 - the line the user sees
                    line = f"{type(exc).__name__}: {exc}"
                got = H.digest(jg.load(path, like))
                rows.append({"path": "jaxguard.save " + ("sharded (1 proc)" if kw else "one file"),
                             "fault": "full disk (tmpfs 1 MiB)" if where == "tmpfs" else "full fsspec filesystem "
                             "(quota, ENOSPC)", "victim": "-",
                             "survived": "previous checkpoint" if got == ref else "LOST", "seen": [line]})
            finally:
                Quota.quota = 1 << 40
                if where == "tmpfs":
                    subprocess.run(["umount", "-l", mnt], check=False)
            print(json.dumps(rows[-1]), flush=True)
    return rows


ORBAX_MP = [("kill_encode", 1), ("kill_mid_file", 1), ("kill_before_manifest", 0), ("raise", 1), ("raise", 0)]
DCP_FAULTS = [("kill_encode", 1), ("kill_mid_file", 1), ("kill_after_files", 1), ("kill_before_metadata", 0),
              ("raise", 1)]
DCP_INPLACE = [("kill_mid_file", 1), ("kill_before_metadata", 0), ("raise", 1)]   # with overwrite=True


def dcp_seen(r, victim, nproc=2):
    out = []
    for i in range(nproc):
        rep = r["reports"].get(i)
        if rep is None:
            out.append(f"rank {i}: " + ("SIGKILLed" if i == victim and r["returncodes"][i] == -9 else
                                        "torn down (blocked)" if i in r["killed"] else f"exit {r['returncodes'][i]}"))
        else:
            out.append(f"rank {i}: " + ("saved" if rep["ok"] else rep["error"][:160] +
                                        (f" ({rep['lines']} lines)" if rep.get("lines", 1) > 1 else "") +
                                        (f", wrapping {rep['inner']}" if rep.get("inner") else "")))
    return out


def refusal_seen(d):
    ref = H.dcp_refusal(d)
    return [f"load {os.path.basename(d)}: jaxguard verify: {ref['verify']}",
            f"load {os.path.basename(d)}: dcp.load(planner=GuardedLoadPlanner): {ref['dcp.load']}" +
            (f" ({ref['dcp.load_lines']} lines)" if ref.get("dcp.load_lines", 1) > 1 else "") +
            (f", wrapping {'; '.join(ref['dcp.load_inner'])}" if ref.get("dcp.load_inner") else "")], ref


def rows_dcp(w):
    """Guarded torch DCP saves (2 gloo ranks, FSDP2) under every fault, in two layouts:
    one directory per step (step4 committed, the faulted save writes step8) and in place
    (the faulted save overwrites step4's directory)."""
    root = os.path.join(w, "dcp")
    base = os.path.join(root, "step4")
    r = H.run_dcp_save(base, 4)
    assert all(x["ok"] for x in r["reports"].values()), r["log"]
    c0 = H.check_dcp(base, base + ".plain")
    assert c0.get("violations") == 0 and c0["weights_identical"], c0
    rows = []
    cases = [(api, "per-step", f, v) for api in ("save", "async") for f, v in DCP_FAULTS] + \
        [("save", "in place", "kill_mid_file", 1)] + [("save_overwrite", "in place", f, v) for f, v in DCP_INPLACE]
    for api, layout, fault, victim in cases:
        t = time.time()
        d = os.path.join(root, f"{api}_{layout.replace(' ', '')}_{fault}_{victim}")
        shutil.copytree(base, os.path.join(d, "step4"))
        target = os.path.join(d, "step8" if layout == "per-step" else "step4")
        r = H.run_dcp_save(target, 8, fault, victim, api=api)
        c = H.check_dcp(os.path.join(d, "step4"), base + ".plain")
        seen = dcp_seen(r, victim)
        if layout == "per-step":
            lines, ref = refusal_seen(target)
            seen += lines
            survived = "previous step (step4 dir)" if c == c0 else "LOST"
            left = sorted(os.listdir(target)) if os.path.isdir(target) else []
        else:
            lines, ref = refusal_seen(target)
            seen += lines
            one = ref.get("verify_lines") == 1 and ref.get("dcp.load_inner_one_line_jaxguard")
            survived = "previous checkpoint (the save was refused before writing)" if c == c0 else \
                "LOST (DCP rewrote the rank files in place); refused in one line" if one else "LOST and NOT refused"
            left = sorted(os.listdir(target))
        api_name = {"async": "dcp.async_save", "save": "dcp.save", "save_overwrite": "dcp.save"}[api]
        planner = "GuardedSavePlanner(overwrite=True)" if api == "save_overwrite" else "GuardedSavePlanner"
        rows.append({"path": f"{api_name} + {planner} (2 ranks, {layout})", "fault": fault,
                     "victim": victim, "survived": survived, "check": c, "seen": seen, "leftovers": left,
                     "seconds": round(time.time() - t, 1)})
        print(json.dumps(rows[-1]), flush=True)
    for api in ("save", "async"):
        rows.append(row_dcp_full_disk(root, base, c0, api))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def row_dcp_full_disk(root, base, c0, api):
    mnt = os.path.join(root, f"tmpfs_{api}")
    os.makedirs(mnt, exist_ok=True)
    used = sum(os.path.getsize(os.path.join(base, n)) for n in os.listdir(base))
    size = (used * 3 // 2 // 4096 + 1) * 4096          # the old step and about half of a new one
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt], capture_output=True, text=True)
    name = f"{'dcp.async_save' if api == 'async' else 'dcp.save'} + GuardedSavePlanner (2 ranks, per-step)"
    if m.returncode:
        return {"path": name, "fault": "full disk (tmpfs)", "victim": "-", "survived": "SKIPPED",
                "seen": [f"cannot mount a tmpfs: {m.stderr.strip()[:100]}"]}
    try:
        shutil.copytree(base, os.path.join(mnt, "step4"))
        target = os.path.join(mnt, "step8")
        r = H.run_dcp_save(target, 8, "none_in_tmpfs", -1, api=api, report=os.path.join(root, f"tmpfs_{api}.report"))
        c = H.check_dcp(os.path.join(mnt, "step4"), base + ".plain")
        lines, _ = refusal_seen(target)
        return {"path": name, "fault": f"full disk (tmpfs {size} B)", "victim": "-",
                "survived": "previous step (step4 dir)" if c == c0 else "LOST", "check": c,
                "seen": dcp_seen(r, -1) + lines,
                "leftovers": sorted(os.listdir(target)) if os.path.isdir(target) else []}
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)


def _tree_digest(obj):
    import hashlib
    import torch
    h = hashlib.sha256()

    def walk(x, path):
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], path + (str(k),))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, path + (str(i),))
        else:
            h.update(repr(path).encode())
            h.update(x.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if isinstance(x, torch.Tensor)
                     else repr(x).encode())
    walk(obj, ())
    return h.hexdigest()


def rows_lightning(w):
    """Lightning's CheckpointIO (GuardedCheckpointIO): a kill mid-save (a real process) and a full tmpfs."""
    from jaxguard.integrations.lightning import GuardedCheckpointIO
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import fault_lightning_worker as LW
    worker = os.path.join(ROOT, "tests", "fault_lightning_worker.py")
    io_ = GuardedCheckpointIO()
    rows = []
    d = os.path.join(w, "lightning")
    os.makedirs(d)
    p = os.path.join(d, "last.ckpt")
    run = lambda seed, fault: subprocess.run([sys.executable, worker, p, str(seed), fault], env=H.env(),  # noqa: E731
                                             capture_output=True, text=True, timeout=600)
    assert run(0, "none").returncode == 0
    d0 = _tree_digest(io_.load_checkpoint(p))
    r = run(1, "kill_mid_file")
    got = _tree_digest(io_.load_checkpoint(p))
    rows.append({"path": "Lightning GuardedCheckpointIO.save_checkpoint (1 proc)", "fault": "kill_mid_file",
                 "victim": 0, "survived": "previous checkpoint" if got == d0 else "LOST",
                 "seen": [f"p0: {'SIGKILLed' if r.returncode == -9 else f'exit {r.returncode}'}",
                          "load_checkpoint: the previous checkpoint (same bits)" if got == d0 else "load: other bits"],
                 "leftovers": sorted(set(os.listdir(d)) - {"last.ckpt"})})
    mnt = os.path.join(w, "tmpfs_lightning")
    os.makedirs(mnt)
    m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", mnt], capture_output=True, text=True)
    if m.returncode:
        rows.append({"path": "Lightning GuardedCheckpointIO.save_checkpoint (1 proc)", "fault": "full disk (tmpfs)",
                     "victim": "-", "survived": "SKIPPED", "seen": [f"cannot mount a tmpfs: {m.stderr.strip()[:100]}"]})
        return rows
    try:
        q = os.path.join(mnt, "last.ckpt")
        io_.save_checkpoint(LW.checkpoint(0), q)
        ref = _tree_digest(io_.load_checkpoint(q))
        H.fill(mnt)
        try:
            io_.save_checkpoint(LW.checkpoint(1), q)
            line = "saved (no error)"
        except Exception as exc:  # noqa: BLE001 - the line the user sees
            line = f"{type(exc).__name__}: {exc}"
        got = _tree_digest(io_.load_checkpoint(q))
        rows.append({"path": "Lightning GuardedCheckpointIO.save_checkpoint (1 proc)", "fault": "full disk (tmpfs 1 MiB)",
                     "victim": "-", "survived": "previous checkpoint" if got == ref else "LOST", "seen": [line],
                     "leftovers": sorted(set(os.listdir(mnt)) - {"last.ckpt", "ballast"})})
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)
    return rows


def _hf_audit(ck, truth):
    """The optimizer.jg in `ck`: digest of the restored tree, and the real torch AdamW first-update
    audit against the exact state the worker dumped to `truth` (torch_compat.audit)."""
    import torch
    import torch_compat
    from jaxguard.audit import gradient_grid
    try:
        restored, _ = torch_compat.restore_tree(os.path.join(ck, "optimizer.jg"))
    except Exception as exc:  # noqa: BLE001 - the line the user sees
        return {"error": f"{type(exc).__name__}: {exc}"}
    t = torch.load(truth, weights_only=True)
    sd, it = t["optimizer"], iter(t["params"])
    params = {}
    for gi, g in enumerate(sd["param_groups"]):
        g["param_names"] = [f"group{gi}.param{i}" for i in range(len(g["params"]))]   # torch_compat.save's names
        params.update({n: next(it) for n in g["param_names"]})
    a = torch_compat.audit({"model": params, "optimizer": sd}, {"model": params, **restored}, tau=0.01, clip=H.CLIP,
                           grid=gradient_grid(H.CLIP, n_linear=3, n_log=6))
    return {"digest": _tree_digest(restored), "violations": int(a["violations"]), "max_gap_lr": float(a["max_gap_lr"])}


def _file_sha(p):
    import hashlib
    return hashlib.sha256(open(p, "rb").read()).hexdigest() if os.path.exists(p) else None


def _dir_sha(d):
    """SHA-256 over every file's relative path and bytes under d (None if d is absent)."""
    import hashlib
    if not os.path.isdir(d):
        return None
    h = hashlib.sha256()
    for here, dirs, files in sorted(os.walk(d)):
        dirs.sort()
        for f in sorted(files):
            p = os.path.join(here, f)
            h.update(os.path.relpath(p, d).encode() + b"\0" + open(p, "rb").read())
    return h.hexdigest()[:16]


HF_FAULTS = {"kill_mid_file": "kill mid optimizer.jg", "kill_after_weights": "kill after the weights",
             "kill_between_renames": "kill between the two renames", "full_disk": "full disk (tmpfs 4 MiB)"}


def rows_hf(w, kinds=("hf", "hfasync", "accelerate")):
    """HF Trainer (GuardedTrainer) and accelerate (save_state): a guarded checkpoint committed, then a
    second run's save to the same place SIGKILLed at three points of its write path, and a full tmpfs.
    *Survived*: after the fault and the integration's own resume, the directory holds the first save's
    files, every byte (`_dir_sha`), and its optimizer.jg audits within tau."""
    worker = os.path.join(ROOT, "tests", "fault_hf_worker.py")
    names = {"hf": "HF GuardedTrainer checkpoint-4 (1 proc)", "accelerate": "accelerate save_state (1 proc)",
             "hfasync": "HF GuardedTrainer(jaxguard_async=True) checkpoint-4 (1 proc)"}
    rows = []

    def run(kind, d, seed, fault, truth):
        e = H.env()
        e["OMP_NUM_THREADS"] = "1"
        r = subprocess.run([sys.executable, worker, kind, d, str(seed), fault, truth], env=e, capture_output=True,
                           text=True, timeout=600)
        err = [x for x in r.stdout.splitlines() if x.startswith("ERROR: ")]
        return r.returncode, (err[-1][7:] if err else None), (r.stdout + r.stderr)[-2000:]

    for kind in kinds:
        for fault in HF_FAULTS:
            t = time.time()
            d = os.path.join(w, f"{kind}_{fault}")
            os.makedirs(d)
            mnt = None
            if fault.startswith("full_disk"):
                mnt = d
                m = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", mnt], capture_output=True,
                                   text=True)
                if m.returncode:
                    rows.append({"path": names[kind], "fault": "full disk (tmpfs)", "victim": "-",
                                 "survived": "SKIPPED", "seen": [f"cannot mount a tmpfs: {m.stderr.strip()[:100]}"]})
                    continue
            try:
                out = os.path.join(d, "run")
                ck = os.path.join(out, "checkpoint-4") if kind.startswith("hf") else out
                rc, err, log = run(kind, out, 0, "none", os.path.join(w, f"{kind}_{fault}.truth0.pt"))
                assert rc == 0, log
                c0 = _hf_audit(ck, os.path.join(w, f"{kind}_{fault}.truth0.pt"))
                assert c0.get("violations") == 0, c0
                dir0 = _dir_sha(ck)
                if fault.startswith("full_disk"):
                    H.fill(mnt)
                rc, err, log = run(kind, out, 1, "none" if fault.startswith("full_disk") else fault,
                                   os.path.join(w, f"{kind}_{fault}.truth1.pt"))
                left = sorted(set(os.listdir(os.path.dirname(ck))) - {os.path.basename(ck), "ballast"})
                seen = ["p0: SIGKILLed" if rc == -9 else err if err else f"p0: exit {rc}" + (
                    f" ({log.strip().splitlines()[-1][:200]})" if rc and log.strip() else "")]
                dir1 = _dir_sha(ck)
                seen.append(f"{os.path.basename(ck)}/ after the fault: " + (
                    "the previous one, every byte" if dir1 == dir0 else "ABSENT" if dir1 is None else "CHANGED"))
                if fault.startswith("full_disk"):
                    os.unlink(os.path.join(mnt, "ballast"))
                rrc, rerr, rlog = run(kind, out, 0, "none", "resume")
                dir2 = _dir_sha(ck)
                c = _hf_audit(ck, os.path.join(w, f"{kind}_{fault}.truth0.pt"))
                seen.append("resume from it: " + ("resumed" if rrc == 0 and "RESUMED" in rlog else rerr or f"exit {rrc}")
                            + (", from the previous checkpoint, every byte" if dir2 == dir0 else
                               ", from OTHER files" if rrc == 0 else ""))
                rows.append({"path": names[kind], "fault": HF_FAULTS[fault],
                             "victim": "-" if fault.startswith("full_disk") else 0,
                             "survived": "previous checkpoint (every file, same bytes)" if dir2 == dir0 and c == c0
                             else "LOST", "check": c, "seen": seen, "leftovers": left,
                             "next_save_cleans": (not (set(os.listdir(os.path.dirname(ck))) - {os.path.basename(ck),
                                                                                              "ballast"})) if left else None,
                             "seconds": round(time.time() - t, 1)})
                print(json.dumps(rows[-1]), flush=True)
            finally:
                if mnt:
                    subprocess.run(["umount", "-l", mnt], check=False)
    return rows



def _acc_view(d):
    """What an accelerate checkpoint directory holds, comparable across saves of one state: every
    file's SHA-256 except the container's (its header records the encode time) and the RNG
    states' (a second save of the same state pickles other RNG states: the first consumed some),
    which count by name, and the restored tree's digest of optimizer.jg."""
    import hashlib
    import torch_compat
    if not os.path.isdir(d):
        return None
    files = {f: "present" if f.startswith("random_states") else
             hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()[:16]
             for f in sorted(os.listdir(d)) if f != "optimizer.jg"}
    try:
        files["optimizer.jg (restored)"] = _tree_digest(torch_compat.restore_tree(os.path.join(d, "optimizer.jg"))[0])
    except Exception as exc:  # noqa: BLE001 - recorded
        files["optimizer.jg (restored)"] = f"{type(exc).__name__}: {exc}"[:120]
    return files


def rows_hf_concurrent(w, rounds=5):
    """Two accelerate jobs (other data orders) save to one directory at the same moment (a file
    barrier lines them up), `rounds` times; each also saved its state to a private directory first.
    *Survived*: after every round the shared directory is one job's whole save (every file as in
    that job's private copy)."""
    worker = os.path.join(ROOT, "tests", "fault_hf_worker.py")
    t = time.time()
    winners, bad, errs = [], 0, []
    for r in range(rounds):
        d = os.path.join(w, f"acc_concurrent_{r}", "shared")
        os.makedirs(os.path.dirname(d))
        e = H.env()
        e["OMP_NUM_THREADS"] = "1"
        procs = [subprocess.Popen([sys.executable, worker, "accelerate", d, str(seed), "concurrent",
                                   os.path.join(w, f"acc_concurrent_{r}_{seed}.truth.pt")], env=e,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for seed in (1, 2)]
        outs = [p.communicate(timeout=600)[0] for p in procs]
        errs += [ln[7:] for o in outs for ln in o.splitlines() if ln.startswith("ERROR: ")]
        shared = _acc_view(d)
        which = [seed for seed in (1, 2) if shared is not None and shared == _acc_view(d + f".job{seed}")]
        winners.append(which[0] if which else None)
        bad += not which
    row = {"path": "accelerate save_state, two jobs, one directory", "fault": f"concurrent writers x{rounds} rounds",
           "victim": "-", "survived": "one job's whole checkpoint every round" if not bad else f"MIXED in {bad} rounds",
           "seen": [f"rounds won by job 1 / job 2: {winners.count(1)} / {winners.count(2)}",
                    "errors: " + ("; ".join(sorted(set(errs)))[:300] if errs else "none")],
           "leftovers": [], "seconds": round(time.time() - t, 1)}
    print(json.dumps(row), flush=True)
    return [row]


def rows_hf_ddp(w):
    """GuardedTrainer under DDP (torchrun, 2 gloo ranks on CPU): checkpoint-3 committed, then a second
    run (another data order) saves checkpoint-3 again with rank 1 SIGKILLed after its RNG file, or
    rank 0 SIGKILLed between the publishing renames; then a 2-rank resume from checkpoint-3."""
    worker = os.path.join(ROOT, "tests", "fault_hf_ddp_worker.py")
    rows = []
    for fault, victim in (("kill_rank1", 1), ("kill_rank0_between_renames", 0)):
        t = time.time()
        out = os.path.join(w, f"hfddp_{fault}")
        ck = os.path.join(out, "checkpoint-3")

        def torchrun(seed, f, *resume, port):
            e = H.env()
            e["OMP_NUM_THREADS"] = "1"
            r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                "--master_port", str(port), worker, out, str(seed), f, *resume], env=e,
                               capture_output=True, text=True, timeout=600)
            err = [x for x in r.stdout.splitlines() if x.startswith("ERROR: ")]
            return r.returncode, (err[-1][7:] if err else None), r.stdout + r.stderr
        port = 29700 + 10 * len(rows)
        rc, _, log = torchrun(0, "none", port=port)
        assert rc == 0, log[-2000:]
        dir0 = _dir_sha(ck)
        rc, err, log = torchrun(1, fault, port=port + 1)
        left = sorted(set(os.listdir(out)) - {"checkpoint-3"})
        dir1 = _dir_sha(ck)
        rrc, rerr, rlog = torchrun(0, "none", ck, port=port + 2)
        dir2 = _dir_sha(ck)
        seen = [f"rank {victim}: SIGKILLed; torchrun exit {rc}" + (f" ({err})" if err else ""),
                "checkpoint-3/ after the fault: " + ("the previous one, every byte" if dir1 == dir0 else
                                                     "ABSENT" if dir1 is None else "CHANGED"),
                "2-rank resume from it: " + ("resumed" if rrc == 0 and "RESUMED" in rlog else rerr or f"exit {rrc}")
                + (", from the previous checkpoint, every byte" if dir2 == dir0 else "")]
        rows.append({"path": "HF GuardedTrainer checkpoint-3 (DDP, 2 ranks)", "fault": fault.replace("_", " "),
                     "victim": victim, "survived": "previous checkpoint (every file, same bytes)"
                     if dir2 == dir0 and rrc == 0 else "LOST", "seen": seen, "leftovers": left,
                     "next_save_cleans": (not (set(os.listdir(out)) - {"checkpoint-3", "checkpoint-4"})) if left
                     else None, "seconds": round(time.time() - t, 1)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


NEGATIVE_CONTROL = "GuardedSavePlanner(overwrite=True)"


def table_row(r):
    c = r.get("check") or {}
    audit_ = c.get("violations", "-") if "violations" in c else ("-" if not c else c.get("error", "-"))
    seen_ = "<br>".join(x.replace("|", "\\|") for x in r["seen"])
    left = ", ".join(f"`{x}`" for x in r.get("leftovers", [])) if r.get("leftovers") else "none"
    nxt = {True: "yes", False: "NO", None: "-"}[r.get("next_save_cleans")]
    return f"| {r['path']} | {r['fault']} | {r['victim']} | {r['survived']} | {audit_} | {seen_} | {left} | {nxt} |"


def write_md(out, md):
    lines = ["# Faults during saves: what survives, what the user sees", "",
             f"Written by `bench/faults.py` ({out['machine']}; {out['seconds']} s). Each row starts from a committed "
             "checkpoint (2 JAX processes x 2 CPU devices, gloo on localhost, an optax adamw state of 25,440 "
             "Adam coordinates, 64x96 + 96 + 200x96, trained 4 steps), then the same job 4 steps later saves to the same path with the "
             "fault injected into the real write path of one process (tests/fault_jax_worker.py). *Survived* means: "
             "`jaxguard.load` afterwards returns the last committed checkpoint: the same save id, the same decoded "
             "bits (SHA-256 of every restored leaf), and the real optax first update is within tau*lr of the "
             "exact state's (audit: 44 gradient values x all coordinates + 1 uniform draw, 0 over tau). Survivors of "
             "a SIGKILL are torn down after 3 s, as a scheduler would. *Next save* is a 1-process save to the same "
             "path: it commits, and the directory then holds only its manifest and its file. The in-process rows "
             "(one process) compare the decoded bits only.", "",
             *([out["note"] + ".", ""] if out.get("note") else []),
             *([f"Rows added or rerun later and merged into this table (bench/faults.py --only; the same machine): "
                f"{', '.join(out['rerun'])}. The 3- and 4-process rows start from their own committed checkpoint "
                "(3 x 2 CPU devices, the same state sharded over the dimensions 3 divides; 4 x 2 CPU devices, "
                "sharded as the 2-process one).", ""]
               if out.get("rerun") else []),
             f"Baseline: digest `{out['baseline']['digest'][:16]}`, audit {out['baseline']['violations']} over tau, "
             f"worst gap {out['baseline']['max_gap_lr']:.4f} lr (tau 0.01).", "",
             "| path | fault | killed / failing process | survived | audit over tau | what the user saw | files no "
             "manifest names, after the fault | next save cleans |", "|---|---|---|---|---|---|---|---|"]
    head = next(i for i, x in enumerate(lines) if x.startswith("| path | fault"))
    neg = [r for r in out["rows"] if NEGATIVE_CONTROL in r["path"]]
    lines += [table_row(r) for r in out["rows"] if NEGATIVE_CONTROL not in r["path"]]
    lines += ["", "**torch DCP rows** (tests/fault_dcp_worker.py): 2 gloo ranks, the FSDP2 model of "
              "tests/_dcp_worker.py (24-41-6 MLP, Adam), step 4 committed with `dcp.save` + `GuardedSavePlanner`, "
              "then the same job at step 8 saves with the fault in one rank. *Per-step* is the layout DCP users "
              "keep (torchtitan, Lightning's DCP path: one directory per step): the faulted save writes `step8/`, "
              "and *survived* means `step4/` loads (one process, `GuardedLoadPlanner`) to the same bits (SHA-256 of "
              "every parameter and Adam tensor), weights identical to a plain DCP save, and the real torch Adam "
              "first update within tau*lr (44 gradient values x all 1,277 coordinates, 0 over tau). *In place* "
              "saves into `step4/` itself: `GuardedSavePlanner` refuses a directory that already holds a "
              "`.metadata` (nothing written; the negative control below shows why). "
              "The saving ranks see torch's own errors (a gloo `Connection closed by peer` line, or DCP's "
              "multi-line `CheckpointException` that wraps the one-line jaxguard/OS error); jaxguard cannot "
              "shorten those from a planner. The broken directory's load is refused in one `CheckpointError` "
              "line by `jaxguard verify` and by `GuardedLoadPlanner(checkpoint_id=...)` (at construction, before "
              "`dcp.load` unpickles anything).", "",
              "**orbax rows with 2 processes** (tests/fault_jax_worker.py `orbaxmp`): 2 JAX processes x 2 CPU "
              "devices (gloo) commit step 4 with an async `CheckpointManager` + `GuardedSave` (sharded), then save "
              "step 8 with the fault in one process: *kill_encode* SIGKILLs it inside the guard's encode "
              "(`jaxguard.core.guard.encode_many`), which the handler runs in orbax's commit thread on the host "
              "copy, before any byte of that process's file; *kill_mid_file* with half of its container in the "
              "temporary file; *kill_before_manifest* kills the primary in `finalize`; *raise* is an EIO while "
              "writing that process's container; the full disk is a tmpfs holding step 4 with room for about half "
              "a step. *Survived*: `CheckpointManager.latest_step()` is 4 and it restores (`GuardedRestore`) to the "
              "same bits, audit 0 over tau. The first run of the *raise* row found every process blocked (both torn "
              "down after the 600 s the bench waited; orbax's `AsyncOptions.timeout_secs` is 1200 s): the failing "
              "process's commit future raised before orbax's `async_write_complete` barrier, where the other waited, "
              "and orbax's save-progress barrier then held the failing one. The handler's commit futures now tell "
              "each other, through the JAX distributed client's key-value store, whether they wrote, and every "
              "process raises one line from `wait_until_finished` (tests/optax/test_faults.py). The survivors of a kill "
              "wait in orbax's barrier or in that agreement and are torn down after 3 s; left alone (measured once, "
              "process 1 killed mid-file, the survivor given 240 s), JAX's coordination service declares the dead "
              "process unhealthy after its heartbeat timeout (`jax.distributed.initialize(heartbeat_timeout_seconds"
              "=100)` by default) and the survivor is aborted with the LOG(FATAL) line below, 103 s after the "
              "kill. Leftovers are orbax's "
              "temporary step directory `8.orbax-checkpoint-tmp` (orbax does not list it as a step; "
              "`CheckpointManagerOptions(cleanup_tmp_directories=True)` removes such directories when a manager is "
              "created; not exercised here).", "",
              "**A survivor aborted by JAX (SIGABRT, exit -6)**: when the primary (process 0) is killed, another "
              "process may be terminated by JAX before it can raise jaxguard's line. Process 0 runs JAX's "
              "coordination service (the `jax.distributed.initialize` coordinator); when it dies, the other "
              "processes' error-polling thread gets `UNAVAILABLE` and XLA's distributed client aborts the process "
              "with a LOG(FATAL) on stderr, the line in the rows above (`client.h:80] Terminating process because "
              "the JAX distributed service detected fatal errors. ...`, then a C++ stack trace). It races with the "
              "gloo collective's failure, which raises jaxguard's one line: in the 2- and 3-process `jaxguard.save` "
              "rows every survivor raised the line, in the 4-process row one survivor of three aborted (twice, "
              "the first run and the rerun that kept its stderr), in the "
              "orbax row the survivor was waiting in orbax's barrier (orbax logs a `TimeoutError` for it) when the "
              "abort came. It is JAX's doing, and no Python code can catch it: a job whose coordinator died cannot "
              "continue, and a scheduler restarts it. Nothing is lost either way: the previous checkpoint is the "
              "one that loads.", "",
              "**HF Trainer and accelerate rows** (tests/fault_hf_worker.py): one process trains the tiny GPT-2 of "
              "tests/helpers.py (2 layers, 64 wide, torch AdamW, 4 steps) and saves with `GuardedTrainer` "
              "(`checkpoint-4/`) or `jaxguard.integrations.accelerate.save_state`; a second run with another data "
              "order then saves to the same place and is SIGKILLed with half of `optimizer.jg` in its temporary "
              "file, or when the framework has written the weights and jaxguard starts the optimizer file, or "
              "between the two renames that publish the directory; or the tmpfs is filled by a ballast file. "
              "*Survived*: after the fault and the integration's own resume (`train(resume_from_checkpoint=...)` "
              "for one step; `load_state`), the directory holds the first save's files, every byte (SHA-256 over "
              "every file), and its `optimizer.jg` audits against the exact state the first run dumped (real "
              "torch AdamW, `torch_compat.audit`, 0 over tau). Both frameworks write a checkpoint's files into "
              "the directory in place; the first run of these rows (before bc876dd) found a kill during "
              "`optimizer.jg` leaving the new run's `model.safetensors` beside the previous Adam state (MIXED, "
              "and the resume accepted it without a word; the weights check then refused it). The integrations "
              "now write the whole checkpoint into a hidden staging directory beside it and publish it by two "
              "renames (the previous directory moved aside, the new one renamed in, the previous one removed); "
              "a kill between the renames leaves the previous directory under `.NAME.TOKEN.jaxguard-old`, which the "
              "next `train()` / `save_state` / `load_state` moves back (the *files ... after the fault* column "
              "lists what each fault left). A killed save's stage `.NAME.TOKEN.jaxguard-staging` is named in that "
              "call's warning and removed by the first save after it is an hour old (it could be another job's "
              "save in progress: the sharded saves' rule), so *next save cleans* says NO for these fresh ones. "
              "Two accelerate jobs saving one directory at once (a file barrier starts their saves together) "
              "leave one job's whole save every round. A GuardedTrainer "
              "resume from a `checkpoint-N/` without any optimizer file (what the Trainer's in-place save leaves "
              "when killed after the weights; the Trainer resumes from it with Adam restarted from zero, without "
              "a word) is refused in one line (tests/integrations/test_integration_atomic_dirs.py). Not measured here: a plain "
              "Trainer/accelerate save under the same kills. DDP rows (tests/fault_hf_ddp_worker.py, torchrun, 2 gloo "
              "ranks on CPU): rank 1 killed once it wrote its RNG file into the stage, rank 0 killed between the "
              "renames; then a 2-rank resume. With `push_to_hub` (the Trainer uploads from the "
              "directory after the save returns) and accelerate's `automatic_checkpoint_naming` (a fresh "
              "directory per save, existing ones refused) the frameworks' in-place writes are kept.", "",
              "Not covered here: an `optimizer.jg` ENOSPC inside the HF/accelerate integrations (the same "
              "`storage.atomic_write_with` as the one-file rows); 4-process jobs killed "
              "before the write or at the manifest's other points (mid, after), under a full disk, and with 1 "
              "device per process; orbax with 2 processes saving "
              "one file (`GuardedSave(sharded=False)`: only the primary writes, and a failure there has no "
              "agreement yet: the other process waits in orbax's barrier); a check that the Trainer's other files "
              "(`scheduler.pt`, `rng_state.pth`, `trainer_state.json`) survive the full disk. The temporary file "
              "a killed single-file save leaves (the Lightning and HF/accelerate rows' `.<name>.<id>.tmp`) is "
              "removed by the next successful save of the same target once it is an hour old "
              "(`storage.STALE_TMP_SECONDS`; a younger one may be a live writer's): tests/format/test_storage.py checks "
              "it on a file aged by `os.utime`, not in this bench's kill rows. The Lightning rows compare the "
              "decoded bits only (no audit). The suite runs a subset (tests/optax/test_faults.py: SIGKILL mid-file, a "
              "raise in one process, two jobs on one path, full tmpfs and full fsspec filesystem for both save "
              "paths; orbax with 2 processes, a raise in one; DCP: SIGKILL mid-file per-step, the in-place refusal "
              "and a torn overwrite, a 2-rank save through `GuardedFileSystemReader`, the DCP fuzz corpus)."]
    if neg:
        lines += ["", "## Negative control: why an in-place DCP save is refused", "",
                  "`GuardedSavePlanner(overwrite=True)` lets a save go into a directory that already holds a "
                  "committed checkpoint (`step4/` here). DCP's FileSystemWriter rewrites the rank files "
                  "`__R_0.distcp` in place (open `wb`) and writes `.metadata` last, so an interrupted overwrite "
                  "cannot be made atomic from a planner: step 4 is LOST in every row below, by DCP's construction. "
                  "The loader refuses what is left in one line (the old `.metadata`'s SHA-256 of every item no "
                  "longer matches the rewritten files). That is why the default planner refuses the directory "
                  "(the *in place* row of the table above: nothing written, step 4 kept). These rows are not "
                  "default paths and are kept out of the table above.", "",
                  lines[head], lines[head + 1]] + [table_row(r) for r in neg]
    fz, fz0 = (os.path.join(os.path.dirname(md), n) for n in ("fuzz_manifest.json", "fuzz_manifest_before_fix.json"))
    if os.path.exists(fz) and os.path.exists(fz0):
        a, b = json.load(open(fz0)), json.load(open(fz))
        lines += ["", "## The sharded manifest reader, fuzzed (bench/fuzz/fuzz_manifest.py)", "",
                  f"Before the fix: {a['executions']} executions in {a['seconds']} s, {len(a['findings'])} findings "
                  f"(exceptions other than a one-line JaxguardError): " + "; ".join(f"`{x}`" for x in a["findings"])
                  + ".", "",
                  f"After: {b['executions']} executions in {b['seconds']} s (seed {b['seed']}), "
                  f"{len(b['findings'])} findings, {b['distinct_outcomes']} distinct refusals. The findings and 40 "
                  "refusals are kept in tests/fuzz_corpus/sharded_manifest/ and replayed by tests/optax/test_sharded.py."]
    fz, fz0 = (os.path.join(os.path.dirname(md), n) for n in ("fuzz_dcp_manifest.json",
                                                               "fuzz_dcp_manifest_before_fix.json"))
    if os.path.exists(fz) and os.path.exists(fz0):
        a, b = json.load(open(fz0)), json.load(open(fz))
        lines += ["", "## The DCP metadata and manifest reader, fuzzed (bench/fuzz/fuzz_dcp_manifest.py)", "",
                  "torch's `FileSystemReader.read_metadata` is a plain `pickle.load` of `.metadata` (torch does not "
                  "restrict it), so `jaxguard verify`/`inspect`/`restore` on a directory someone hands in ran any "
                  "code its pickle named, and so did `dcp.load` with `GuardedLoadPlanner`. jaxguard now reads "
                  "`.metadata` itself (torch_compat/dcp_metadata.py): every pickle length checked against the bytes "
                  "there (pickletools) before the C unpickler allocates, only the classes a DCP save writes "
                  "(metadata dataclasses, dtypes, `torch.Size`, layouts, memory formats, `TorchVersion`, paths), "
                  "then the structure (chunks inside and covering their tensor, every chunk and bytes item with "
                  "storage in a file of this directory, lengths at least the raw bytes, rank files present and long "
                  "enough, planner paths forming one state_dict, the manifest listing the same items and shards "
                  "with shapes equal to their parameters'). `GuardedLoadPlanner(checkpoint_id=...)` runs the same "
                  "check at construction, before `dcp.load`. Bytes items were already read with "
                  "`torch.load(weights_only=True)` only, after their SHA-256 matched.", "",
                  f"Before the fix: {a['executions']} executions in {a['seconds']} s (seed {a['seed']}), "
                  f"{len(a['findings'])} findings: " + "; ".join(f"`{x[:110]}`" for x in a["findings"]) +
                  ". A run with partly fixed checks was also SIGKILLed by the kernel (out of memory; the input was "
                  "not isolated): the pickletools pre-scan (lengths checked before the C unpickler allocates) and a "
                  "6 GiB address-space limit in the fuzzer were added, and no later run was killed. Runs during the "
                  "fix found 2 unhashable "
                  "`param_key` crashes in the new checks, fixed; a first 150 s run after the fix found one more (a "
                  "mutated `ChunkStorageMetadata` whose repr raised inside the refusal message: 14367 executions, "
                  "1 finding), fixed.", "",
                  f"After: {b['executions']} executions in {b['seconds']} s (seed {b['seed']}), "
                  f"{len(b['findings'])} findings, {b['distinct_outcomes']} distinct refusals; pickles naming "
                  "`os.system`, `exec`, `eval`, `pickle.loads`, `torch.load` are refused without running. The "
                  "findings and refusals are kept in tests/fuzz_corpus/dcp_manifest/ and replayed by "
                  "tests/optax/test_faults.py."]
    open(md, "w").write("\n".join(lines) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "faults.json"))
    ap.add_argument("--only", default=None)
    ap.add_argument("--md-from", default=None, help="only rewrite faults.md from this JSON")
    a = ap.parse_args()
    if a.md_from:
        write_md(json.load(open(a.md_from)), os.path.join(os.path.dirname(a.md_from), "faults.md"))
        return
    w = tempfile.mkdtemp(prefix="jg_faults_")
    base = os.path.join(w, "base")
    t0 = time.time()
    c0 = None
    if a.only in ("nproc3", "nproc4", "nproc4b"):     # 3 or 4 processes x 2 CPU devices: its own committed base
        r = H.run_save(base, 4, nproc=int(a.only[5]))
        assert all(x["ok"] for x in r["reports"].values()), r["log"]
        c0 = H.check(base, base + ".truth.npz")
    elif a.only not in ("dcp", "lightning", "orbaxmp", "hf", "hfasync"):
        r = H.run_save(base, 4)
        assert all(x["ok"] for x in r["reports"].values()), r["log"]
        c0 = H.check(base, base + ".truth.npz")
    rows = []
    for fault, victim in KILLS:
        if a.only and a.only != fault:
            continue
        rows.append(row_kill(w, base, c0, fault, victim))
        print(json.dumps(rows[-1]), flush=True)
    if not a.only or a.only == "full_disk":
        rows.append(row_full_tmpfs(w, base, c0))
        print(json.dumps(rows[-1]), flush=True)
    if not a.only or a.only == "orbax":
        for shard in (False, True):
            rows.append(row_orbax(w, shard))
            print(json.dumps(rows[-1]), flush=True)
    if not a.only or a.only == "concurrent":
        rows.append(row_concurrent(w))
        print(json.dumps(rows[-1]), flush=True)
    if not a.only or a.only == "full_disk":
        rows += rows_full_disk_in_process(w)
    if not a.only or a.only == "dcp":
        rows += rows_dcp(w)
    if not a.only or a.only == "lightning":
        rows += rows_lightning(w)
        print(json.dumps(rows[-2:]), flush=True)
    if a.only == "orbaxmp":
        for fault, victim in ORBAX_MP:
            rows.append(row_orbax_mp(w, fault, victim))
            print(json.dumps(rows[-1]), flush=True)
        rows.append(row_orbax_mp_full_disk(w))
        print(json.dumps(rows[-1]), flush=True)
    if a.only == "nproc3":
        for fault, victim in (("kill_mid_file", 2), ("kill_before_manifest", 0)):
            rows.append(row_kill(w, base, c0, fault, victim, nproc=3))
            print(json.dumps(rows[-1]), flush=True)
    if a.only == "hf":
        rows += rows_hf(w) + rows_hf_concurrent(w) + rows_hf_ddp(w)
    if a.only == "hfasync":
        rows += rows_hf(w, kinds=("hfasync",))
    if a.only == "nproc4":
        for fault, victim in (("kill_mid_file", 3), ("kill_before_manifest", 0)):
            rows.append(row_kill(w, base, c0, fault, victim, nproc=4))
            print(json.dumps(rows[-1]), flush=True)
    if a.only == "nproc4b":      # the other faults of the 2-process table, 4 processes
        for fault, victim in (("kill_encode", 1), ("kill_after_files", 2), ("raise", 2)):
            rows.append(row_kill(w, base, c0, fault, victim, nproc=4))
            print(json.dumps(rows[-1]), flush=True)
    out = {"machine": "2-core AMD EPYC, shared with other work", "baseline": c0, "rows": rows,
           "seconds": round(time.time() - t0, 1)}
    if a.only and os.path.exists(a.out):     # rerun rows replace theirs in the committed matrix
        old = json.load(open(a.out))
        key = lambda r: (r["path"], r["fault"], str(r["victim"]))  # noqa: E731
        new = {key(r): r for r in rows}
        kept = [new.get(key(r), r) for r in old["rows"]]      # a rerun row keeps its place in the table
        had = {key(r) for r in old["rows"]}
        out = {**old, "rows": kept + [r for r in rows if key(r) not in had],
               "rerun": sorted(set(old.get("rerun", [])) | {f"{a.only} ({round(time.time() - t0, 1)} s)"})}
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)
    write_md(out, os.path.join(os.path.dirname(a.out), "faults.md"))
    shutil.rmtree(w, ignore_errors=True)


if __name__ == "__main__":
    main()
