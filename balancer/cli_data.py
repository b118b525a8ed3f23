"""Old entry point ``python -m balancer.cli_data``: the data commands live in ``balancer.cli.data``."""

import sys

from balancer.cli.data import main

if __name__ == "__main__":
    sys.exit(main())
