"""`python -m tierkv_hicache`: the same as the `tierkv-hicache` command."""

import sys

from tierkv_hicache import main

sys.exit(main())
