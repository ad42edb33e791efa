"""Worker for tests/optax/test_faults.py and bench/faults.py: one rank of a faulted guarded DCP save.

    python tests/fault_dcp_worker.py RANK WORLD PORT DIR STEPS FAULT VICTIM API REPORT

WORLD gloo ranks train the FSDP2 model of tests/_dcp_worker.py STEPS steps and save it with
``dcp.save`` (API ``save``) or ``dcp.async_save(...).result()`` (API ``async``; ``save_overwrite``: ``dcp.save`` with
``GuardedSavePlanner(overwrite=True)``) and
`GuardedSavePlanner` to DIR; with FAULT ``none`` a plain DCP save goes to ``DIR.plain``
too (the exact state the audit compares with).  In rank VICTIM the fault is injected into
the real write path (torch's FileSystemWriter and jaxguard's encoder run unchanged around it):

  kill_encode          SIGKILL while the planner certifies (inside jaxguard's encode)
  kill_mid_file        SIGKILL with the first item of its data file written (fsynced)
  kill_after_files     SIGKILL with its data file written, before the ranks agree on .metadata
  kill_before_metadata SIGKILL (coordinator) with every data file written, before .metadata
  raise                an OSError (EIO) while writing its data file: the save raises

Each rank that returns writes REPORT.<rank>.json: {"ok", "error" (the first line), "lines",
"inner" (the first error DCP's CheckpointException wraps, when it is one)}.
"""
import errno
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_fs
from torch.distributed.checkpoint.state_dict import get_state_dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _dcp_worker as W  # noqa: E402


def die():
    os.kill(os.getpid(), signal.SIGKILL)


def inject(fault):
    import jaxguard.writer as jw
    real_item, real_write, real_finish = dcp_fs._write_item, dcp_fs.FileSystemWriter.write_data, \
        dcp_fs.FileSystemWriter.finish

    if fault == "kill_encode":
        jw.encode = lambda *a, **k: die()
    elif fault == "kill_mid_file":
        def item(transforms, stream, *a, **k):
            r = real_item(transforms, stream, *a, **k)
            stream.flush()
            os.fsync(stream.fileno())
            die()
            return r
        dcp_fs._write_item = item
    elif fault == "raise":
        def item(transforms, stream, *a, **k):
            stream.write(b"PARTIAL")
            raise OSError(errno.EIO, "Input/output error")
        dcp_fs._write_item = item
    elif fault == "kill_after_files":
        def write_data(self, plan, planner):
            fut = real_write(self, plan, planner)
            fut.wait()
            die()
        dcp_fs.FileSystemWriter.write_data = write_data
    elif fault == "kill_before_metadata":
        dcp_fs.FileSystemWriter.finish = lambda self, *a, **k: die()
    del real_finish


def main():
    rank, world, port, d, steps, fault, victim, api, report = sys.argv[1:10]
    rank, world, steps, victim = int(rank), int(world), int(steps), int(victim)
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh
    from torch_compat.dcp import GuardedSavePlanner
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    mesh = init_device_mesh("cpu", (world,))
    model, opt = W.build(mesh)
    for s in range(steps):
        W.train_step(model, opt, s, rank, world)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    if fault == "none":
        dcp.save(state, checkpoint_id=d + ".plain")
    if rank == victim:
        inject(fault)
    rep = {"rank": rank}
    try:
        planner = GuardedSavePlanner(tau=W.TAU, clip=W.CLIP, overwrite=api == "save_overwrite")
        if api == "async":
            dcp.async_save(state, checkpoint_id=d, planner=planner).result()
        else:
            dcp.save(state, checkpoint_id=d, planner=planner)
        rep["ok"] = True
    except BaseException as exc:  # noqa: BLE001 - the report says what the user saw
        text = str(exc).strip().splitlines()
        rep.update(ok=False, error=f"{type(exc).__name__}: {text[0] if text else ''}"[:300],
                   lines=len(str(exc).splitlines()))
        inner = [e for e, _ in getattr(exc, "failures", {}).values()]
        if inner:
            rep["inner"] = f"{type(inner[0]).__name__}: {str(inner[0]).strip().splitlines()[0][:240]}"
    json.dump(rep, open(f"{report}.{rank}.json", "w"))
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - a peer may be gone
        pass


if __name__ == "__main__":
    main()
