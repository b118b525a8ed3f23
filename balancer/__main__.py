"""`python -m balancer`: the `balancer` command (balancer.cli.main)."""

import sys

from balancer.cli import main

sys.exit(main())
