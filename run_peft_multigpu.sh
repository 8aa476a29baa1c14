#!/usr/bin/env bash
# QLoRA on several GPUs of one machine with plain DDP through torchrun (no accelerate launcher, no FSDP): upstream's
# run_peft_multigpu.sh. Every GPU holds the whole 4-bit model (a 7B is ~4 GB of 4-bit weights): use it when the model
# fits one GPU and you want data parallelism. Non-reentrant activation checkpointing: DDP fails with reentrant
# checkpointing ("Expected to mark a variable ready only once"), which train.py refuses up front.
#   bash run_peft_multigpu.sh [extra train.py flags, which override the ones below]
# Overridable without editing this file:
#   MODEL=mistralai/Mistral-7B-v0.1  DATASET=smangrul/ultrachat-10k-chatml  OUTPUT_DIR=mistral-sft-lora-multigpu
#   NPROC_PER_NODE=8 (one process per GPU)  LAUNCH_ARGS=(extra torchrun flags, e.g. "--master_port 29600")
# Tiny CPU dry run (no GPU, no Hub; DDP over gloo), as tests/test_launch_paths.py does:
#   python -m sft_recipe.tiny --output_dir .tiny
#   ACCELERATE_USE_CPU=true NPROC_PER_NODE=2 MODEL=.tiny/model DATASET=.tiny/data/jsonl OUTPUT_DIR=runs/ddp-dry \
#     bash run_peft_multigpu.sh --use_flash_attn False --bf16 False --bnb_4bit_compute_dtype float32 \
#     --push_to_hub False --max_steps 3 --max_seq_len 128
set -euo pipefail
cd "$(dirname "$0")"

MODEL=${MODEL:-mistralai/Mistral-7B-v0.1}
DATASET=${DATASET:-smangrul/ultrachat-10k-chatml}
OUTPUT_DIR=${OUTPUT_DIR:-mistral-sft-lora-multigpu}
LAUNCH=(torchrun --nproc_per_node "${NPROC_PER_NODE:-8}" --nnodes 1)
if [[ -n "${LAUNCH_ARGS:-}" ]]; then read -r -a extra_launch <<< "$LAUNCH_ARGS"; LAUNCH+=("${extra_launch[@]}"); fi

# As in run_peft_fsdp.sh: torchrun reports a preempted rank as a failure (1); only a preemption note written by THIS
# run turns that into 75 ("resume me with --resume_from_checkpoint latest").
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
--gradient_accumulation_steps 8 \
--gradient_checkpointing True \
--use_reentrant False \
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
"$@" || status=$?
if [[ -f "$OUTPUT_DIR/preempted.json" && "$(note_fingerprint)" != "$note_before" ]]; then exit 75; fi
exit "$status"
