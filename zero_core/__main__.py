"""`python -m zero_core COMMAND ...`: the course's command line (see `python -m zero_core --help`)."""

import sys

from zero_core.cli import main

sys.exit(main())
