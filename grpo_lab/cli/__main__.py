"""`python -m grpo_lab.cli ...`: the same as the `grpo-lab` command (jobs start it this way)."""

import sys

from .main import main

sys.exit(main())
