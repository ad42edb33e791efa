"""Trainer integrations at the import paths users have: ``jaxguard.integrations.hf``
(`GuardedTrainer`), ``.accelerate`` (`save_state`/`load_state`) and ``.lightning``
(`GuardedCheckpointIO`) hand on the same objects as `torch_compat.integrations`, where
they live with the torch layer (they save torch state).  ``import jaxguard`` imports none
of them; each imports its framework only when it is imported itself.  See
docs/integrations.md.
"""
