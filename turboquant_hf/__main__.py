"""`python -m turboquant_hf ...` runs the `turboquant-hf` command line."""

import sys

from .cli import main

sys.exit(main())
