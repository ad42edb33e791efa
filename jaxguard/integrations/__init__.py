"""Trainer integrations: guarded optimizer state where users already save it.

Each submodule imports its framework only when it is imported itself, and
``import jaxguard`` imports none of them:

- `jaxguard.integrations.hf`: `GuardedTrainer`, a ``transformers.Trainer`` whose
  ``checkpoint-N/`` holds ``optimizer.jg`` instead of ``optimizer.pt``
  (``pip install 'jaxguard[hf]'``);
- `jaxguard.integrations.accelerate`: `save_state`/`load_state`, in place of
  ``Accelerator.save_state``/``load_state`` (``pip install 'jaxguard[hf]'``);
- `jaxguard.integrations.lightning`: `GuardedCheckpointIO`, a Lightning ``CheckpointIO``
  plugin (``pip install 'jaxguard[lightning]'``).

They live with the torch layer, in `torch_compat.integrations`; these modules hand on
the same objects at the import paths users have.  All three write through `jaxguard.format.storage`, so directories may be fsspec URLs where the
framework allows it, and certify the moments against the live parameters of the
optimizer (`torch_compat.save`). See docs/integrations.md.
"""
