"""`python -m sft_recipe.plan`: the planner's command line (cli.py)."""

import sys

from sft_recipe.plan.cli import main

sys.exit(main())
