"""train.py with one line printed from inside TRL's fused LM head at the first step: where the head's weight and the
backbone's hidden states are, and whether the weight is still a sharded DTensor. For bench/gpu_check.py's offload
rows: on the H200 (2026-12-04) `qlora+offload` (FSDP2, fsdp_offload_params true) died at its first step in
SFTTrainer.compute_loss, gathering `outputs.label_mask.sum()` ("Tensors must be CUDA and dense"): the fused head
(trl.trainer.utils.add_fused_lm_head) moves the labels to `lm_head.weight.device`, so the mask was on the CPU. This
line says whether the head's weight was still the CPU-offloaded shard there, the fact the fix depends on.
    accelerate launch --config_file configs/fsdp2_config.yaml bench/train_probing_fused_head.py [train.py flags]
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sft_recipe.startup import prepare_imports  # noqa: E402

prepare_imports(sys.argv[1:])  # as train.py decides (sft_recipe/startup.py), before this imports the libraries

import trl.trainer.utils as trl_utils  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

chunked = trl_utils._ChunkedLogProbFunction
original_apply = chunked.apply
said = []


def apply(hidden, weight, *args):
    if not said:
        said.append(True)
        print(f"fused head probe: weight {type(weight).__name__} on {weight.device} {tuple(weight.shape)}, hidden "
              f"states on {hidden.device}", flush=True)
    return original_apply(hidden, weight, *args)


chunked.apply = apply
# TRL gathers a head weight that is still a DTensor (a shard FSDP2 never unsharded) before the call above: say so.
original_full_tensor = DTensor.full_tensor


def full_tensor(self, *args, **kwargs):
    if not said:
        print(f"fused head probe: full_tensor() of a DTensor on {self.device} {tuple(self.shape)}", flush=True)
    return original_full_tensor(self, *args, **kwargs)


DTensor.full_tensor = full_tensor
sys.argv[0] = str(REPO / "train.py")
runpy.run_path(str(REPO / "train.py"), run_name="__main__")
