"""train.py as it ran before the recipe placed quantized bases itself: `from_pretrained` gets no device_map, so
transformers' quantizer places the base (on a GPU: whole on each rank's GPU, upstream's path; on a CPU machine: the
CPU too). For side-by-side runs only: bench/gpu_check.py's `qlora-quantizer` row and tests/e2e/test_quantized_load.py.
    ACCELERATE_USE_CPU=true accelerate launch --config_file configs/cpu/fsdp_config.yaml \
        bench/train_with_quantizer_placement.py [train.py flags]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sft_recipe.startup import prepare_imports  # noqa: E402

prepare_imports(sys.argv[1:])  # as train.py decides (sft_recipe/startup.py), before this imports the libraries
import sft_recipe.train.load_plan as load_plan  # noqa: E402  (after the path)

load_plan.quantized_base_device_map = lambda model_args, launch: None
sys.argv[0] = str(REPO / "train.py")
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
