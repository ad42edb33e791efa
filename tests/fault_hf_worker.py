"""Worker for bench/faults.py: one process training a tiny GPT-2 and saving a guarded
checkpoint through the HF Trainer (`GuardedTrainer`) or accelerate (`save_state`), the fault
in the real write path of ``optimizer.jg``.

    python tests/fault_hf_worker.py KIND DIR SEED FAULT TRUTH

KIND ``hf`` (``hfasync``: with ``jaxguard_async=True``, the optimizer file written and the
checkpoint published on the background thread): `GuardedTrainer` trains STEPS steps with ``output_dir=DIR`` and saves
``DIR/checkpoint-4`` (the Trainer's own save); ``accelerate``: an `accelerate.Accelerator`
loop trains STEPS steps and `jaxguard.integrations.accelerate.save_state(acc, DIR)`.
SEED picks the data order (so a second run writes another state to the same place).
TRUTH ``resume``: instead, resume from what is there (HF: ``train(resume_from_checkpoint=
DIR/checkpoint-4)`` for one step; accelerate: `load_state(acc, DIR)`) and print ``RESUMED``.
Otherwise, just before the optimizer file is written, the exact optimizer state and parameters go to
TRUTH (``torch.save``).  FAULT ``kill_mid_file``: SIGKILL with half of ``optimizer.jg``
written (fsynced) to its temporary file; ``kill_after_weights``: SIGKILL when the framework
has written the weights and jaxguard starts on the optimizer file; ``kill_between_renames``:
SIGKILL after the commit moved the previous directory aside, before it publishes the new
one; ``concurrent`` (accelerate): save the same state to ``DIR.jobSEED`` first, then to DIR
(two such jobs run at once in bench/faults.py); ``none``: save normally.  A save that raises
prints ``ERROR: <type>: <message>`` as its last line and exits 3.
"""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import fault_harness as H  # noqa: E402
from helpers import byte_tokens, tiny_gpt2  # noqa: E402
from jaxguard.format import storage  # noqa: E402

LR, CLIP, SEQ, STEPS = 1e-3, 0.2, 32, 4
CONCURRENT = False


def kill_mid_optimizer_file():
    H.kill_mid_write(storage, ".jg")


def kill_after_weights():
    import torch_compat
    from torch_compat import state
    torch_compat.save = state.save_snapshot = lambda *a, **kw: os.kill(os.getpid(), signal.SIGKILL)


def kill_between_renames():
    real = os.rename

    def rename(src, dst):
        real(src, dst)
        if str(dst).endswith(storage.OLD_SUFFIX):
            os.kill(os.getpid(), signal.SIGKILL)
    storage.os.rename = rename


def dump_truth(opt, model, truth):
    torch.save({"optimizer": opt.state_dict(), "params": [p.detach().clone() for g in opt.param_groups
                                                          for p in g["params"]]}, truth)


def hf(d, seed, truth, background=False):
    import transformers
    from jaxguard.integrations.hf import GuardedTrainer

    class Bytes(torch.utils.data.Dataset):
        x = byte_tokens(SEQ)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.x[i]}

    class Trainer(GuardedTrainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            opt = self.optimizer.optimizer if hasattr(self.optimizer, "optimizer") else self.optimizer
            dump_truth(opt, self.model, truth)
            return super()._save_optimizer_and_scheduler(output_dir)

    resume = os.path.join(d, f"checkpoint-{STEPS}") if truth == "resume" else None
    args = transformers.TrainingArguments(
        output_dir=d, max_steps=STEPS + (resume is not None), per_device_train_batch_size=8, learning_rate=LR, optim="adamw_torch",
        lr_scheduler_type="constant", weight_decay=0.01, max_grad_norm=CLIP, save_strategy="no" if resume else "steps",
        save_steps=STEPS, report_to="none", use_cpu=True, seed=0, data_seed=seed, dataloader_num_workers=0,
        disable_tqdm=True)
    Trainer(model=tiny_gpt2(SEQ), args=args, train_dataset=Bytes(), jaxguard_async=background).train(
        resume_from_checkpoint=resume)


def acc(d, seed, truth):
    import accelerate
    from jaxguard.integrations import accelerate as jg_acc
    model = tiny_gpt2(SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, foreach=False, fused=False)
    a = accelerate.Accelerator(cpu=True)
    model, opt = a.prepare(model, opt)
    if truth == "resume":
        jg_acc.load_state(a, d)
        return
    x = byte_tokens(SEQ)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    for i in range(STEPS):
        b = x[order[i * 8:(i + 1) * 8]]
        a.backward(model(input_ids=b, labels=b).loss)
        a.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    dump_truth(opt.optimizer if hasattr(opt, "optimizer") else opt, model, truth)
    if CONCURRENT:   # the same state to a private directory first: what this job's whole save holds
        jg_acc.save_state(a, d + f".job{seed}")
        import glob
        import time
        open(d + f".ready{seed}", "w").close()   # start the shared save together with the other job
        while len(glob.glob(d + ".ready*")) < 2:
            time.sleep(0.01)
    jg_acc.save_state(a, d)


def main():
    kind, d, seed, fault, truth = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    global CONCURRENT
    CONCURRENT = fault == "concurrent"
    {"concurrent": lambda: None, "kill_mid_file": kill_mid_optimizer_file, "kill_after_weights": kill_after_weights,
     "kill_between_renames": kill_between_renames, "none": lambda: None}[fault]()
    try:
        if kind.startswith("hf"):
            hf(d, seed, truth, background=kind == "hfasync")
        else:
            acc(d, seed, truth)
        if truth == "resume":
            print("RESUMED")
    except Exception as exc:  # noqa: BLE001 - the line the user sees
        print(f"ERROR: {type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}")
        sys.exit(3)


if __name__ == "__main__":
    main()
