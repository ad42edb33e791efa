"""`python -m jaxguard.reader FILE [--json]`: the numpy-only reader's command line.

The reader lives in `jaxguard.format.reader`; this module keeps its documented name (and
the module attributes of the first release) working."""
import sys

from jaxguard.format.reader import *  # noqa: F401,F403  (the documented public reader API)
from jaxguard.format.reader import main

if __name__ == "__main__":
    sys.exit(main())
