"""Worker for bench/faults.py: one process saving a Lightning checkpoint with
`jaxguard.integrations.lightning.GuardedCheckpointIO`, the fault in the real write path.

    python tests/fault_lightning_worker.py PATH SEED FAULT

SEED picks the state (tests/write_paths.py's torch model and Adam moments at step 5);
FAULT ``kill_mid_file``: SIGKILL with half of the container written (fsynced) to the
temporary file; ``none``: save normally.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fault_harness as H  # noqa: E402
import write_paths as WP  # noqa: E402
from jaxguard.format import storage  # noqa: E402
from jaxguard.integrations.lightning import GuardedCheckpointIO  # noqa: E402


def checkpoint(seed):
    model, opt = WP.torch_state(seed)
    return {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "epoch": seed}


def main():
    path, seed, fault = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if fault == "kill_mid_file":
        H.kill_mid_write(storage)
    GuardedCheckpointIO().save_checkpoint(checkpoint(seed), path)


if __name__ == "__main__":
    main()
