"""`python -m splitserve.cli <command>`: what the `splitserve` console script runs."""

import sys

from splitserve.cli.entry import main

sys.exit(main())
