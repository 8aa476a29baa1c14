"""train.py as it ran before the recipe placed quantized bases itself: `from_pretrained` gets no device_map, so
transformers' quantizer places the base (on a CPU machine: the CPU too). For tests/e2e/test_quantized_load.py only,
which trains the same run both ways side by side.
    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/cpu/fsdp_config.yaml \
        tests/e2e/train_with_quantizer_placement.py [train.py flags]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import sft_recipe.train.model as model_module  # noqa: E402  (after the path)

model_module.quantized_base_device_map = lambda model_args, launch: None
sys.argv[0] = str(REPO / "train.py")
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
