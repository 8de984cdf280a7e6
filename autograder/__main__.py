"""`python -m autograder check NOTEBOOK` / `python -m autograder grade DIR` (see `--help`)."""

import sys

from autograder.cli import main

sys.exit(main())
