"""`python -m waygate`: the same as the `waygate` console script."""

import sys

from waygate.cli import main

sys.exit(main())
