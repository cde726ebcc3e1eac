"""`python -m tierkv`: the same as the `tierkv` command."""

import sys

from tierkv.cli import main

sys.exit(main())
