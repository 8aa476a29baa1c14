"""Print how far distribution strategies and resumes move what is learned, measured side by side in one run.

    .venv/bin/python bench/parity.py            (needs .tiny: python -m sft_recipe.tiny --output_dir .tiny)

Every setup trains the tiny model for 8 steps (crossing an epoch boundary: 60 packed sequences) with the same seed,
data and global batch (8 sequences per step) on CPU in fp32, dropping the short last batch of the epoch except where
the row says so. Accumulation rows differ at step 8: the epoch's leftover micro-batch makes a short optimizer step.
Rows compare each setup with one process at batch 8: the largest relative difference of a per-step loss
and the largest absolute difference of a saved adapter tensor. Resume rows continue from the step-4 checkpoint of the
uninterrupted run of the same setup and compare steps 5-8 and the final adapter with it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).parent / "accelerate")
FLAGS = ["--model_name_or_path", ".tiny/model", "--dataset_name", ".tiny/data/jsonl", "--use_peft_lora", "True",
         "--lora_target_modules", "all-linear", "--lora_r", "8", "--lora_alpha", "16", "--lora_dropout", "0",
         "--max_steps", "8", "--max_seq_len", "128", "--report_to", "none", "--eval_strategy", "no",
         "--logging_steps", "1", "--seed", "3", "--learning_rate", "3e-3", "--packing", "True",
         "--save_strategy", "steps", "--save_steps", "4", "--dataloader_drop_last", "True"]
SETUPS = {
    "single, batch 8": ("cpu/single.yaml", ["--per_device_train_batch_size", "8"]),
    "single, batch 4 x accumulation 2": ("cpu/single.yaml", ["--per_device_train_batch_size", "4",
                                                             "--gradient_accumulation_steps", "2"]),
    "FSDP1, 2 ranks x 4": ("cpu/fsdp_config.yaml", ["--per_device_train_batch_size", "4"]),
    "FSDP2, 2 ranks x 4": ("cpu/fsdp2_config.yaml", ["--per_device_train_batch_size", "4"]),
    "FSDP2, 2 ranks x 2 x accumulation 2": ("cpu/fsdp2_config.yaml", ["--per_device_train_batch_size", "2",
                                                                      "--gradient_accumulation_steps", "2"]),
    # Known difference: without drop_last the short last batch of an epoch (step 8) is padded on 2 ranks.
    "FSDP2, 2 ranks x 4, drop_last off": ("cpu/fsdp2_config.yaml", ["--per_device_train_batch_size", "4",
                                                                   "--dataloader_drop_last", "False"]),
}
RESUMED = ("FSDP1, 2 ranks x 4", "FSDP2, 2 ranks x 4")


def train(config: str, out: Path, extra: list[str]) -> tuple[list[float], dict]:
    env = dict(os.environ, ACCELERATE_USE_CPU="true", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [ACCELERATE, "launch", "--config_file", f"configs/{config}", "train.py", "--output_dir", str(out),
           *FLAGS, *extra]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{config} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    losses = json.loads((out / "run_record.json").read_text())["training"]["losses"]
    return losses, load_file(str(out / "adapter_model.safetensors"))


def compare(losses, adapter, ref_losses, ref_adapter, from_step=0):
    loss_diff = max(abs(a - b) / abs(b) for a, b in list(zip(losses, ref_losses))[from_step:])
    weight_diff = max(float((adapter[k] - ref_adapter[k]).abs().max()) for k in ref_adapter)
    return loss_diff, weight_diff


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="parity-"))
    runs = {name: train(config, work / f"run{i}", extra) for i, (name, (config, extra)) in enumerate(SETUPS.items())}
    ref_losses, ref_adapter = runs["single, batch 8"]
    print(f"{'setup':<44}{'max rel. loss diff':>20}{'max abs. adapter diff':>24}")
    for name, (losses, adapter) in runs.items():
        print(f"{name:<44}{compare(losses, adapter, ref_losses, ref_adapter)[0]:>20.2e}"
              f"{compare(losses, adapter, ref_losses, ref_adapter)[1]:>24.2e}")
    for i, name in enumerate(RESUMED):
        config, extra = SETUPS[name]
        source = work / f"run{list(SETUPS).index(name)}"
        resumed = work / f"resumed{i}"
        resumed.mkdir()
        shutil.copytree(source / "checkpoint-4", resumed / "checkpoint-4")
        losses, adapter = train(config, resumed, [*extra, "--resume_from_checkpoint", "latest"])
        loss_diff, weight_diff = compare(losses, adapter, *runs[name], from_step=4)
        print(f"{'resume at step 4 vs uninterrupted, ' + name.split(',')[0]:<44}{loss_diff:>20.2e}{weight_diff:>24.2e}")
    shutil.rmtree(work)


if __name__ == "__main__":
    main()
