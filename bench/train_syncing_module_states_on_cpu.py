"""train.py with FSDP1's sync_module_states allowed on the CPU (compat.allow_fsdp1_module_sync_on_cpu, test-only):
what FSDP1 with `fsdp_cpu_ram_efficient_loading: true` does on GPUs, run in CPU tests through the real launcher.
For side-by-side runs only (tests/e2e/test_quantized_once.py, bench/quantized_load.py), never in normal use:
    ACCELERATE_USE_CPU=true accelerate launch --config_file <an FSDP1 CPU config with sync and efficient loading on> \
        bench/train_syncing_module_states_on_cpu.py [train.py flags]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sft_recipe.startup import prepare_imports  # noqa: E402

prepare_imports(sys.argv[1:])  # as train.py decides (sft_recipe/startup.py), before this imports the libraries

from sft_recipe.compat import allow_fsdp1_module_sync_on_cpu  # noqa: E402  (after the path)

allow_fsdp1_module_sync_on_cpu()
sys.argv[0] = str(REPO / "train.py")
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
