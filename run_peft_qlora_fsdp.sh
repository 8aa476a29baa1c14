#!/usr/bin/env bash
# QLoRA + FSDP: the guide's Llama-2-70B run on 2x24 GB GPUs (4-bit NF4, double quant, bf16 storage, CPU offload).
#   bash run_peft_qlora_fsdp.sh [extra train.py flags, which override the ones below]
# Everything is overridable without editing this file:
#   MODEL=meta-llama/Llama-2-70b-hf  DATASET=smangrul/ultrachat-10k-chatml  OUTPUT_DIR=llama-sft-qlora-fsdp
#   ACCELERATE_CONFIG=configs/fsdp_config_qlora.yaml  NUM_PROCESSES=(from the config)
# Tiny CPU dry run (no GPU, no Hub), as the tests do:
#   python -m sft_recipe.tiny --output_dir .tiny
#   ACCELERATE_USE_CPU=true ACCELERATE_CONFIG=configs/cpu/fsdp_config.yaml NUM_PROCESSES=2 MODEL=.tiny/model \
#     DATASET=.tiny/data/jsonl OUTPUT_DIR=runs/qlora-dry bash run_peft_qlora_fsdp.sh --use_flash_attn False \
#     --bnb_4bit_compute_dtype float32 --push_to_hub False --max_steps 3 --max_seq_len 128
set -euo pipefail
cd "$(dirname "$0")"

MODEL=${MODEL:-meta-llama/Llama-2-70b-hf}
DATASET=${DATASET:-smangrul/ultrachat-10k-chatml}
OUTPUT_DIR=${OUTPUT_DIR:-llama-sft-qlora-fsdp}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-configs/fsdp_config_qlora.yaml}
source scripts/lib/launch_common.sh  # GUIDE_FLAGS, accelerate_launch, run_and_exit
accelerate_launch
# Where the QLoRA run differs from the guide's LoRA run: 4-bit NF4 with double quant stored in bf16 (the model dtype,
# which FSDP's flat parameters need), smaller batches for 24 GB, reentrant checkpointing.
run_and_exit "${LAUNCH[@]}" train.py "${GUIDE_FLAGS[@]}" \
--per_device_train_batch_size 2 \
--per_device_eval_batch_size 2 \
--gradient_accumulation_steps 2 \
--use_reentrant True \
--use_4bit_quantization True \
--use_nested_quant True \
--bnb_4bit_compute_dtype "bfloat16" \
--bnb_4bit_quant_storage_dtype "bfloat16" \
"$@"
