"""`python -m waygate.demo`: run the demo echo backend (see waygate.demo.echo)."""

import sys

from waygate.demo.echo import main

sys.exit(main())
