#!/usr/bin/env bash
# LoRA + DeepSpeed ZeRO-3: the guide's Llama-2-70B run on 8 GPUs (the alternative engine to run_peft_fsdp.sh).
#   bash run_peft_deepspeed.sh [extra train.py flags, which override run_peft_fsdp.sh's]
# Needs `pip install deepspeed` (not in requirements.txt: only this engine uses it). Overridable without editing:
#   MODEL=meta-llama/Llama-2-70b-hf  DATASET=smangrul/ultrachat-10k-chatml  OUTPUT_DIR=llama-sft-lora-deepspeed
#   ACCELERATE_CONFIG=configs/deepspeed_config.yaml  NUM_PROCESSES=(from the config)
# --gradient_accumulation_steps must equal the config's gradient_accumulation_steps (4); DeepSpeed refuses a mismatch.
# Tiny CPU dry run (no GPU, no Hub; gloo instead of NCCL, fp32; ACCELERATE_USE_CPU must stay unset for DeepSpeed):
#   python -m sft_recipe.tiny --output_dir .tiny
#   ACCELERATE_CONFIG=configs/cpu/deepspeed_config.yaml NUM_PROCESSES=2 MODEL=.tiny/model DATASET=.tiny/data/jsonl \
#     OUTPUT_DIR=runs/ds-dry bash run_peft_deepspeed.sh --ddp_backend gloo --bf16 False --use_flash_attn False \
#     --push_to_hub False --max_steps 3 --max_seq_len 128
# The flags are run_peft_fsdp.sh's (upstream's DeepSpeed scripts pass the same ones): only the engine and the folder differ.
set -euo pipefail
cd "$(dirname "$0")"
export OUTPUT_DIR=${OUTPUT_DIR:-llama-sft-lora-deepspeed}
export ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-configs/deepspeed_config.yaml}
exec bash run_peft_fsdp.sh "$@"
