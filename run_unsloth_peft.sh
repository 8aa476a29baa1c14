#!/usr/bin/env bash
# Upstream's run_unsloth_peft.sh (one GPU, Unsloth's fused kernels, QLoRA on Mistral-7B) -- REFUSED by this recipe:
#   bash run_unsloth_peft.sh [extra train.py flags]
# train.py stops before loading any weight with exit code 2 and says why (no unsloth package or no CUDA GPU; this
# recipe trains through PEFT + TRL and does not implement Unsloth's model path) and what to run instead:
#   bash run_peft.sh    the same one-GPU QLoRA run (4-bit NF4, nested quant, LoRA r 8 on all projections), without Unsloth
# Kept so that a user following upstream's folder gets that answer, not "no such file". MODEL/DATASET/OUTPUT_DIR and
# PYTHON override as in run_peft.sh. Upstream's --use_bnb_4bit_quantization is this recipe's --use_4bit_quantization.
set -euo pipefail
cd "$(dirname "$0")"

MODEL=${MODEL:-mistralai/Mistral-7B-v0.1}
DATASET=${DATASET:-smangrul/ultrachat-10k-chatml}
OUTPUT_DIR=${OUTPUT_DIR:-mistral-sft-lora-unsloth}
PYTHON=${PYTHON:-python}

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
--use_unsloth True \
--lora_r 8 \
--lora_alpha 16 \
--lora_dropout 0.1 \
--lora_target_modules "q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj" \
--use_4bit_quantization True \
--use_nested_quant True \
--bnb_4bit_compute_dtype "bfloat16" \
--use_flash_attn True \
"$@"
