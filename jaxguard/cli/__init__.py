"""The `jaxguard` console script and the demo: the top layer, the only place in jaxguard
that imports `torch_compat`."""
from jaxguard.cli.main import main

__all__ = ["main"]
