"""`save_state`/`load_state`, the accelerate integration, at the import path users have: the same objects as
`torch_compat.integrations.accelerate`, where it lives with the rest of the torch layer."""
from torch_compat.integrations.accelerate import load_state, optimizer_file, save_state

__all__ = ["save_state", "load_state", "optimizer_file"]
