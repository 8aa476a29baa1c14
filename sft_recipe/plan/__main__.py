"""`python -m sft_recipe.plan`: the planner's command line (cli.py).

The planner builds models on the meta device, shape by shape: no weight, and hundreds of thousands of short-lived
objects, which the cyclic garbage collector walked again and again (with the library's modules beside them). This
short process runs without it (sft_recipe/startup.py says the same of train.py's imports): `--guide`, 7.6 -> 6.4
CPU-s on the 2-core machine (farm-bench, 3 pairs).
"""

import sys

from sft_recipe.plan.cli import main
from sft_recipe.startup import pause_collector

pause_collector()
sys.exit(main())
