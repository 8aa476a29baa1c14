#!/usr/bin/env bash
# LoRA + FSDP: the guide's Llama-2-70B run on 8 GPUs (FSDP1 FULL_SHARD, bf16, packing, gradient checkpointing).
#   bash run_peft_fsdp.sh [extra train.py flags, which override the ones below]
# Everything is overridable without editing this file:
#   MODEL=meta-llama/Llama-2-70b-hf  DATASET=smangrul/ultrachat-10k-chatml  OUTPUT_DIR=llama-sft-lora-fsdp
#   ACCELERATE_CONFIG=configs/fsdp_config.yaml  NUM_PROCESSES=(from the config)  LAUNCH_ARGS=(extra launcher flags)
# Tiny CPU dry run (no GPU, no Hub), as the tests do:
#   python -m sft_recipe.tiny --output_dir .tiny
#   ACCELERATE_USE_CPU=true ACCELERATE_CONFIG=configs/cpu/fsdp2_config.yaml NUM_PROCESSES=2 MODEL=.tiny/model \
#     DATASET=.tiny/data/jsonl OUTPUT_DIR=runs/lora-dry bash run_peft_fsdp.sh --use_flash_attn False \
#     --defer_push_to_hub True --max_steps 3 --max_seq_len 128
set -euo pipefail
cd "$(dirname "$0")"

MODEL=${MODEL:-meta-llama/Llama-2-70b-hf}
DATASET=${DATASET:-smangrul/ultrachat-10k-chatml}
OUTPUT_DIR=${OUTPUT_DIR:-llama-sft-lora-fsdp}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-configs/fsdp_config.yaml}
source scripts/lib/launch_common.sh  # GUIDE_FLAGS (this run's flags), accelerate_launch, run_and_exit
accelerate_launch
run_and_exit "${LAUNCH[@]}" train.py "${GUIDE_FLAGS[@]}" "$@"
