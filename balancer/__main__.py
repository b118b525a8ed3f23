import sys

from balancer.cli import main

sys.exit(main())
