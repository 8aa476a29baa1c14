#!/usr/bin/env bash
# QLoRA + DeepSpeed ZeRO-3: the guide's Llama-2-70B run on 2x40 GB GPUs (4-bit NF4, double quant, bf16 storage).
#   bash run_peft_qlora_deepspeed.sh [extra train.py flags, which override run_peft_qlora_fsdp.sh's]
# Needs `pip install deepspeed` (not in requirements.txt: only this engine uses it). Overridable without editing:
#   MODEL=meta-llama/Llama-2-70b-hf  DATASET=smangrul/ultrachat-10k-chatml  OUTPUT_DIR=llama-sft-qlora-dsz3
#   ACCELERATE_CONFIG=configs/deepspeed_config_z3_qlora.yaml  NUM_PROCESSES=(from the config)
# 4-bit weights are packed in --bnb_4bit_quant_storage_dtype, which must be the model dtype (bfloat16 with bf16).
# Tiny CPU dry run (no GPU, no Hub; gloo, fp32 compute and storage; ACCELERATE_USE_CPU must stay unset; no
# checkpoints: bitsandbytes' CPU format cannot save ZeRO-3-partitioned 4-bit weights):
#   python -m sft_recipe.tiny --output_dir .tiny
#   ACCELERATE_CONFIG=configs/cpu/deepspeed_config.yaml NUM_PROCESSES=2 MODEL=.tiny/model DATASET=.tiny/data/jsonl \
#     OUTPUT_DIR=runs/qlora-ds-dry bash run_peft_qlora_deepspeed.sh --ddp_backend gloo --bf16 False \
#     --bnb_4bit_compute_dtype float32 --bnb_4bit_quant_storage_dtype float32 --use_flash_attn False \
#     --push_to_hub False --save_strategy no --max_steps 3 --max_seq_len 128
# The flags are run_peft_qlora_fsdp.sh's (upstream's DeepSpeed scripts pass the same ones): only the engine and the folder differ.
set -euo pipefail
cd "$(dirname "$0")"
export OUTPUT_DIR=${OUTPUT_DIR:-llama-sft-qlora-dsz3}
export ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-configs/deepspeed_config_z3_qlora.yaml}
exec bash run_peft_qlora_fsdp.sh "$@"
