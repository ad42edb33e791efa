"""The library's one exception family.

Every error a user can cause is a `JaxguardError` (a `ValueError`) whose message is
one line naming the offending value and the fix. The CLI prints that line and exits
with status 2; nothing else escapes as a traceback.
"""


class JaxguardError(ValueError):
    """Base class for every error jaxguard raises on bad input."""


class ConfigError(JaxguardError):
    """A configuration value is out of range or inconsistent."""


class UnsupportedOptimizerError(JaxguardError):
    """The optimizer or one of its options is outside the pinned operation models."""


class CheckpointError(JaxguardError):
    """A checkpoint (torch dict or optax pytree) lacks what jaxguard needs."""


class ContainerError(JaxguardError):
    """A jaxguard container is corrupt, truncated, foreign or of another version."""
