"""train.py as it ran before the recipe quantized each 4-bit weight on the rank's GPU: under FSDP the base still
loads onto the CPU (compat.quantized_base_device_map), but bitsandbytes quantizes it there, with the rank's share of
the machine's threads. For side-by-side runs only: bench/gpu_check.py's `qlora-cpuquant` row (its load seconds
beside the `qlora` row's, and the packed bytes compared).
    accelerate launch --config_file configs/fsdp2_config.yaml bench/train_quantizing_on_cpu.py [train.py flags]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import sft_recipe.train.load_plan as load_plan  # noqa: E402  (after the path)

load_plan.weight_quantization_device = lambda model_args, launch, device_map: None
sys.argv[0] = str(REPO / "train.py")
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
