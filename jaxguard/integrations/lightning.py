"""`GuardedCheckpointIO`, the Lightning integration, at the import path users have: the same objects as
`torch_compat.integrations.lightning`, where it lives with the rest of the torch layer."""
from torch_compat.integrations.lightning import GuardedCheckpointIO

__all__ = ["GuardedCheckpointIO"]
