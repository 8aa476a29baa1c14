"""The recipe's library: train.py tells the story, these modules do each step (README "Files" maps them)."""

import logging

# bitsandbytes 0.50 logs, at import, on CPUs with AVX512-BF16, that it could not fetch an optional CPU kernel from
# the Hub ("Failed to load CPU gemm_4bit_forward from kernels-community ..."): once per process, on every rank, and
# nothing a user can act on (the recipe runs without it). Set here so it is in force before anything imports
# bitsandbytes. When it can go: `python -c "import bitsandbytes"` prints nothing on such a CPU without this.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
