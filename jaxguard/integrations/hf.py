"""`GuardedTrainer`, the Hugging Face Trainer integration, at the import path users have: the same objects as
`torch_compat.integrations.hf`, where it lives with the rest of the torch layer."""
from torch_compat.integrations.hf import GuardedTrainer, SCHEDULER_NAME

__all__ = ["GuardedTrainer", "SCHEDULER_NAME"]
