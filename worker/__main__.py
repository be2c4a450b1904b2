"""`python -m worker ...`: the worker process entry point (what the supervisor spawns)."""

import sys

from worker.proc import main

sys.exit(main(sys.argv[1:]))
