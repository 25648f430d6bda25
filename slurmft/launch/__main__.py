"""``python -m slurmft.launch SCRIPT.py [ARGS...]``: what the sbatch template execs."""

import sys

from slurmft.launch.main import main

sys.exit(main())
