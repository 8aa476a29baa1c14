#!/usr/bin/env bash
# LoRA + FSDP on a GPTQ INT4 base: upstream's run_peft_fsdp_gptq.sh (Llama-3.1-8B-Instruct GPTQ-INT4, 8 GPUs).
# The base arrives already quantized (no bitsandbytes): LoRA trains on top of GPT-QModel's int4 layers.
#   bash run_peft_fsdp_gptq.sh [extra train.py flags, which override the ones below]
# Needs `pip install optimum gptqmodel` (not in requirements.txt: only GPTQ bases use them); without them, train.py
# stops before loading anything and says so. Overridable without editing this file:
#   MODEL=hugging-quants/Meta-Llama-3.1-8B-Instruct-GPTQ-INT4  DATASET=smangrul/ultrachat-10k-chatml
#   OUTPUT_DIR=llama3-8B-gptq-sft-lora-fsdp  ACCELERATE_CONFIG=configs/fsdp_config.yaml  NUM_PROCESSES=(from config)
# Targets q,k,v,o,up,gate by name as upstream: all-linear finds no GPTQ layer (they are not torch.nn.Linear).
# FSDP1 as upstream; FSDP2 works too with fsdp_cpu_ram_efficient_loading: false. A GPTQ adapter cannot be merged
# into the int4 base: merge it into the original bf16 model (python merge_adapter.py --base_model_name_or_path ...).
# Tiny CPU dry run (no GPU, no Hub), as tests/test_gptq.py does:
#   python -m sft_recipe.tiny --output_dir .tiny && bash scripts/setup_gptq.sh
#   PYTHONPATH=.venv/gptq-site .venv/bin/python -m sft_recipe.gptq --build_tiny .tiny/gptq
#   PYTHONPATH=.venv/gptq-site ACCELERATE_USE_CPU=true ACCELERATE_CONFIG=configs/cpu/fsdp_config.yaml NUM_PROCESSES=2 \
#     MODEL=.tiny/gptq DATASET=.tiny/data/jsonl OUTPUT_DIR=runs/gptq-dry bash run_peft_fsdp_gptq.sh \
#     --use_flash_attn False --bf16 False --max_steps 3 --max_seq_len 128
set -euo pipefail
cd "$(dirname "$0")"

MODEL=${MODEL:-hugging-quants/Meta-Llama-3.1-8B-Instruct-GPTQ-INT4}
DATASET=${DATASET:-smangrul/ultrachat-10k-chatml}
OUTPUT_DIR=${OUTPUT_DIR:-llama3-8B-gptq-sft-lora-fsdp}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-configs/fsdp_config.yaml}
LAUNCH=(accelerate launch --config_file "$ACCELERATE_CONFIG")
if [[ -n "${NUM_PROCESSES:-}" ]]; then LAUNCH+=(--num_processes "$NUM_PROCESSES"); fi
if [[ -n "${LAUNCH_ARGS:-}" ]]; then read -r -a extra_launch <<< "$LAUNCH_ARGS"; LAUNCH+=("${extra_launch[@]}"); fi

# As in run_peft_fsdp.sh: only a preemption note written by THIS run turns the launcher's failure into 75.
note_fingerprint() { if [[ -f "$OUTPUT_DIR/preempted.json" ]]; then cksum < "$OUTPUT_DIR/preempted.json"; stat -c %Y "$OUTPUT_DIR/preempted.json"; fi; }
note_before=$(note_fingerprint)
status=0
"${LAUNCH[@]}" train.py \
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
--gradient_accumulation_steps 4 \
--gradient_checkpointing True \
--use_reentrant False \
--dataset_text_field "content" \
--use_flash_attn True \
--use_peft_lora True \
--lora_r 8 \
--lora_alpha 16 \
--lora_dropout 0.1 \
--lora_target_modules "q_proj,k_proj,v_proj,o_proj,up_proj,gate_proj" \
--use_4bit_quantization False \
"$@" || status=$?
if [[ -f "$OUTPUT_DIR/preempted.json" && "$(note_fingerprint)" != "$note_before" ]]; then exit 75; fi
exit "$status"
