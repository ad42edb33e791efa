"""The library's one exception family.

Every error a user can cause is a `JaxguardError` (a `ValueError`) whose message is
one line naming the offending value and the fix. The CLI prints that line and exits
with status 2; nothing else escapes as a traceback.
"""

__all__ = ["JaxguardError", "ConfigError", "UnsupportedOptimizerError", "CheckpointError", "ContainerError",
           "JaxguardWarning", "install_hint"]


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


class JaxguardWarning(UserWarning):
    """A restore or save that works but whose guarantee may not hold as stated (e.g. state
    restored onto another device or kernel than the op model that certified it)."""


def install_hint(extra: str) -> str:
    """How to install the optional dependencies `extra` (``"torch"``, ``"remote"``, ...).

    jaxguard is installed from a clone (no release is on an index yet), so the first form
    is the one that works today.

    Args:
      extra: the name of an ``[project.optional-dependencies]`` group of pyproject.toml.

    Returns:
      ``pip install -e ".[extra]" in the jaxguard clone (or pip install "jaxguard[extra]")``.
    """
    return f'pip install -e ".[{extra}]" in the jaxguard clone (or pip install "jaxguard[{extra}]")'
