"""`python -m zero_core COMMAND ...`: the course's command line (see `python -m zero_core --help`)."""

import os
import sys

from zero_core.cli import main

try:
    sys.exit(main(program=True))
except BrokenPipeError:  # the reader left early (`... | head`): nothing more to say, and no traceback
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(1)
