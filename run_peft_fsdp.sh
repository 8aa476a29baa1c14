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
LAUNCH=(accelerate launch --config_file "$ACCELERATE_CONFIG")
if [[ -n "${NUM_PROCESSES:-}" ]]; then LAUNCH+=(--num_processes "$NUM_PROCESSES"); fi
# Extra launcher flags, word-split (run_peft_slurm.sh passes --num_machines/--machine_rank/... this way).
if [[ -n "${LAUNCH_ARGS:-}" ]]; then read -r -a extra_launch <<< "$LAUNCH_ARGS"; LAUNCH+=("${extra_launch[@]}"); fi

# Only a preemption note written by THIS run means "preempted": one left by an earlier, since-resumed preemption must
# not turn a run that failed for another reason into "retry me".
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
--gradient_accumulation_steps 4 \
--gradient_checkpointing True \
--use_reentrant False \
--dataset_text_field "content" \
--use_flash_attn True \
--use_peft_lora True \
--lora_r 8 \
--lora_alpha 16 \
--lora_dropout 0.1 \
--lora_target_modules "all-linear" \
--use_4bit_quantization False \
"$@" || status=$?
# Preempted (SIGTERM/SIGUSR1): a checkpoint was written; exit 75 so a requeue wrapper can resume with
# --resume_from_checkpoint latest (the launcher itself reports any failed rank as 1).
if [[ -f "$OUTPUT_DIR/preempted.json" && "$(note_fingerprint)" != "$note_before" ]]; then exit 75; fi
exit "$status"
