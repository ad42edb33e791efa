"""`python -m jaxguard.reader FILE [--json]`: the numpy-only reader's command line.

The reader itself, and its API, is `jaxguard.format.reader`."""

__all__ = ["main"]

import sys

from jaxguard.format.reader import main

if __name__ == "__main__":
    sys.exit(main())
