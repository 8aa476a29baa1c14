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

# exec: one process, so train.py's own exit code (2 for a configuration mistake, 75 when preempted) is the script's.
exec "$PYTHON" train.py \
--seed 100 \
--model_name_or_path "$MODEL" \
--dataset_name "$DATASET" \
--chat_template_format "chatml" \
--add_special_tokens False \
--append_concat_token False \
--splits "train,test" \
--max_seq_len 2048 \
--num_train_epochs 1 \
--logging_steps 5 \
--log_level "info" \
--logging_strategy "steps" \
--eval_strategy "epoch" \
--save_strategy "epoch" \
--push_to_hub \
--hub_private_repo True \
--hub_strategy "every_save" \
--bf16 True \
--packing True \
--learning_rate 1e-4 \
--lr_scheduler_type "cosine" \
--weight_decay 1e-4 \
--warmup_steps 0 \
--max_grad_norm 1.0 \
--output_dir "$OUTPUT_DIR" \
--per_device_train_batch_size 8 \
--per_device_eval_batch_size 8 \
--gradient_accumulation_steps 8 \
--gradient_checkpointing True \
--use_reentrant True \
--dataset_text_field "content" \
--use_peft_lora True \
--lora_r 8 \
--lora_alpha 16 \
--lora_dropout 0.1 \
--lora_target_modules "all-linear" \
--use_4bit_quantization True \
--use_nested_quant True \
--bnb_4bit_compute_dtype "bfloat16" \
--use_flash_attn True \
"$@"
