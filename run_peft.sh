#!/usr/bin/env bash
# QLoRA on ONE GPU, no launcher: upstream's run_peft.sh (Mistral-7B, 4-bit NF4 + nested quant, no quant storage
# dtype, reentrant checkpointing, flash-attn). The smallest setup that trains a 7B model: one 24 GB GPU.
#   bash run_peft.sh [extra train.py flags, which override the ones below]
# Overridable without editing this file:
#   MODEL=mistralai/Mistral-7B-v0.1  DATASET=smangrul/ultrachat-10k-chatml  OUTPUT_DIR=mistral-sft-lora
#   PYTHON=python (the interpreter that runs train.py)
# No --bnb_4bit_quant_storage_dtype: with one process nothing flattens parameters, so the 4-bit weights stay packed
# in uint8 (FSDP needs them in the model's dtype; see run_peft_qlora_fsdp.sh).
# Tiny CPU dry run (no GPU, no Hub), as tests/test_launch_paths.py does:
#   python -m sft_recipe.tiny --output_dir .tiny
#   ACCELERATE_USE_CPU=true MODEL=.tiny/model DATASET=.tiny/data/jsonl OUTPUT_DIR=runs/single-dry bash run_peft.sh \
#     --use_flash_attn False --bf16 False --bnb_4bit_compute_dtype float32 --push_to_hub False --max_steps 3 \
#     --max_seq_len 128
set -euo pipefail
cd "$(dirname "$0")"

MODEL=${MODEL:-mistralai/Mistral-7B-v0.1}
DATASET=${DATASET:-smangrul/ultrachat-10k-chatml}
OUTPUT_DIR=${OUTPUT_DIR:-mistral-sft-lora}
PYTHON=${PYTHON:-python}
source scripts/lib/launch_common.sh  # GUIDE_FLAGS, run_and_exit
# One process: train.py's own exit code (2 for a configuration mistake, 75 when preempted) is the script's.
# Where it differs from the guide's LoRA run: 4-bit NF4 + nested quant in uint8 storage, accumulation 8, reentrant.
run_and_exit "$PYTHON" train.py "${GUIDE_FLAGS[@]}" \
--gradient_accumulation_steps 8 \
--use_reentrant True \
--use_4bit_quantization True \
--use_nested_quant True \
--bnb_4bit_compute_dtype "bfloat16" \
"$@"
