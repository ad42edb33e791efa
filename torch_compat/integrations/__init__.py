"""Trainer integrations: guarded optimizer state where users already save it.

Each submodule imports its framework only when it is imported itself, and neither
``import jaxguard`` nor ``import torch_compat`` imports any of them:

- `torch_compat.integrations.hf`: `GuardedTrainer`, a ``transformers.Trainer`` whose
  ``checkpoint-N/`` holds ``optimizer.jg`` instead of ``optimizer.pt``
  (``pip install 'jaxguard[hf]'``);
- `torch_compat.integrations.accelerate`: `save_state`/`load_state`, in place of
  ``Accelerator.save_state``/``load_state`` (``pip install 'jaxguard[hf]'``);
- `torch_compat.integrations.lightning`: `GuardedCheckpointIO`, a Lightning ``CheckpointIO``
  plugin (``pip install 'jaxguard[lightning]'``).

Users import them as ``jaxguard.integrations.hf`` (and ``.accelerate``, ``.lightning``):
those modules hand on the same objects.  All three write through `jaxguard.format.storage`
(a checkpoint directory is replaced whole by `jaxguard.format.storage.commit_directory`), and
certify the moments against the live parameters of the optimizer (`torch_compat.save`).
See docs/integrations.md.
"""
