"""`python -m sft_recipe.plan`: the planner's command line (cli.py).

The planner builds models on the meta device, shape by shape: no weight, and hundreds of thousands of short-lived
objects, which the cyclic garbage collector walked again and again (with the library's modules beside them). This
short process runs without it (sft_recipe/startup.py says the same of train.py's imports): `--guide`, 7.6 -> 6.4
CPU-s on the 2-core machine (farm-bench, 3 pairs); and transformers' scan of its model files is read from the cache.
"""

import sys

from sft_recipe.startup import prepare_tool_imports

prepare_tool_imports(imports_peft=False)  # before the planner imports transformers (its models scan cached)
from sft_recipe.plan.cli import main  # noqa: E402

sys.exit(main())
