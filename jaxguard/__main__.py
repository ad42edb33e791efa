import sys

from jaxguard.cli.main import main

sys.exit(main())
