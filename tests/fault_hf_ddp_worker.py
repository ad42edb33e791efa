"""Worker for bench/faults.py: `GuardedTrainer` under DDP (torchrun, 2 gloo ranks on CPU),
a fault in one rank while it saves ``DIR/checkpoint-3``.

    torchrun --nproc_per_node 2 tests/fault_hf_ddp_worker.py DIR SEED FAULT [RESUME]

Trains 3 steps (SEED picks the data order) and saves ``checkpoint-3``; with RESUME (a
checkpoint path) it resumes from it for one step instead, saves nothing, and rank 0 prints
``RESUMED``. FAULT ``kill_rank1``: rank 1 is SIGKILLed once it wrote its RNG state into the
checkpoint being saved; ``kill_rank0_between_renames``: rank 0 is SIGKILLed after the commit
moved the previous ``checkpoint-3`` aside; ``none``: save normally.
"""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
import transformers  # noqa: E402

from fault_hf_worker import kill_between_renames  # noqa: E402
from helpers import byte_tokens, tiny_gpt2  # noqa: E402
from jaxguard.integrations.hf import GuardedTrainer  # noqa: E402


class Bytes(torch.utils.data.Dataset):
    x = byte_tokens(32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def main():
    d, seed, fault = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    resume = sys.argv[4] if len(sys.argv) > 4 else None
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    trainer_class = GuardedTrainer
    if fault == "kill_rank1" and rank == 1:
        class KilledAfterItsRngFile(GuardedTrainer):
            def _save_rng_state(self, out):
                super()._save_rng_state(out)
                os.kill(os.getpid(), signal.SIGKILL)
        trainer_class = KilledAfterItsRngFile
    if fault == "kill_rank0_between_renames" and rank == 0:
        kill_between_renames()
    args = transformers.TrainingArguments(
        output_dir=d, max_steps=3 + (resume is not None), per_device_train_batch_size=4, learning_rate=1e-3,
        optim="adamw_torch", lr_scheduler_type="constant", max_grad_norm=0.2,
        save_strategy="no" if resume else "steps", save_steps=3, report_to="none", use_cpu=True, seed=0,
        data_seed=seed, dataloader_num_workers=0, disable_tqdm=True, ddp_backend="gloo")
    tr = trainer_class(model=tiny_gpt2(32), args=args, train_dataset=Bytes())
    try:
        tr.train(resume_from_checkpoint=resume)
    except Exception as exc:  # noqa: BLE001 - the line the user sees
        print(f"ERROR: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
        sys.exit(3)
    if resume and rank == 0:
        print("RESUMED", tr.state.global_step)


if __name__ == "__main__":
    main()
