# shellcheck shell=bash
# Sourced by the run_peft*.sh launchers, never run by itself: what they share, written once.
#   source scripts/lib/launch_common.sh    (after MODEL, DATASET and OUTPUT_DIR are set)
# - GUIDE_FLAGS: the guide's train.py flags (its LoRA + FSDP run, run_peft_fsdp.sh). A launcher passes them, then
#   only the flags where it differs, then the user's "$@": the last value given for a flag wins.
# - accelerate_launch: the `accelerate launch` words from ACCELERATE_CONFIG, NUM_PROCESSES and LAUNCH_ARGS (for a
#   DeepSpeed config, after checking that DeepSpeed is installed: exit 2 naming the fix).
# - run_and_exit CMD...: runs CMD; exits 75 when CMD wrote a new preemption note in OUTPUT_DIR (130 when Ctrl-C
#   wrote it; resume either with --resume_from_checkpoint latest), else with CMD's status, saying how to resume when
#   CMD failed after writing a checkpoint.
# - TORCH_ELASTIC_SHUTDOWN_TIMEOUT: how long torchrun lets the ranks finish their step and checkpoint after it forwards
#   Ctrl-C/SIGTERM before it SIGKILLs them. torch's default, 30 s, is shorter than one step plus a checkpoint of a
#   large model; the scripts give 600 s unless it is set.
# - recipe_script_for CONFIG: the launcher whose flags fit an accelerate config (run_peft_slurm.sh uses it).

GUIDE_FLAGS=(
  --seed 100
  --model_name_or_path "$MODEL"
  --dataset_name "$DATASET"
  --chat_template_format "chatml"
  --add_special_tokens False
  --append_concat_token False
  --splits "train,test"
  --max_seq_len 2048
  --num_train_epochs 1
  --logging_steps 5
  --log_level "info"
  --logging_strategy "steps"
  --eval_strategy "epoch"
  --save_strategy "epoch"
  --push_to_hub
  --hub_private_repo True
  --hub_strategy "every_save"
  --bf16 True
  --packing True
  --learning_rate 1e-4
  --lr_scheduler_type "cosine"
  --weight_decay 1e-4
  --warmup_steps 0
  --max_grad_norm 1.0
  --output_dir "$OUTPUT_DIR"
  --per_device_train_batch_size 8
  --per_device_eval_batch_size 8
  --gradient_accumulation_steps 4
  --gradient_checkpointing True
  --use_reentrant False
  --dataset_text_field "content"
  --use_flash_attn True
  --use_peft_lora True
  --lora_r 8
  --lora_alpha 16
  --lora_dropout 0.1
  --lora_target_modules "all-linear"
  --use_4bit_quantization False
)

export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-600}"

accelerate_launch() {
  # `accelerate launch` itself needs DeepSpeed for a DeepSpeed config, and stops with its own ImportError traceback
  # without it: ask first, and exit 2 with the recipe's message (package, version, fix) as train.py's checks do.
  if grep -qiE '^distributed_type:[[:space:]]*DEEPSPEED' "$ACCELERATE_CONFIG"; then
    python -m sft_recipe.config.optional_deps --accelerate_config "$ACCELERATE_CONFIG" || exit 2
  fi
  LAUNCH=(accelerate launch --config_file "$ACCELERATE_CONFIG")
  if [[ -n "${NUM_PROCESSES:-}" ]]; then LAUNCH+=(--num_processes "$NUM_PROCESSES"); fi
  # Extra launcher flags, word-split (run_peft_slurm.sh passes --num_machines/--machine_rank/... this way).
  if [[ -n "${LAUNCH_ARGS:-}" ]]; then read -r -a extra_launch <<< "$LAUNCH_ARGS"; LAUNCH+=("${extra_launch[@]}"); fi
}

# Only a preemption note written by THIS run means "preempted": one left by an earlier, since-resumed preemption must
# not turn a run that failed for another reason into "retry me".
note_fingerprint() {
  if [[ -f "$OUTPUT_DIR/preempted.json" ]]; then cksum < "$OUTPUT_DIR/preempted.json"; stat -c %Y "$OUTPUT_DIR/preempted.json"; fi
}

run_and_exit() {
  local before status=0 started
  before=$(note_fingerprint)
  started=$(date +%s)
  "$@" || status=$?
  # Preempted (SIGTERM/SIGUSR1/SIGHUP) or Ctrl-C: a checkpoint was written; the launcher reports any failed rank as 1.
  if [[ -f "$OUTPUT_DIR/preempted.json" && "$(note_fingerprint)" != "$before" ]]; then
    if grep -q '"signal": "SIGINT"' "$OUTPUT_DIR/preempted.json"; then exit 130; fi
    exit 75
  fi
  if (( status != 0 )); then say_how_to_resume "$status" "$started"; fi
  exit "$status"
}

# A launch that failed after this run wrote a checkpoint (a rank killed by the out-of-memory killer, a crash): one
# line after torch's report, which names the rank that failed first and its signal, with the resume command.
say_how_to_resume() {
  local status=$1 started=$2 marker folder newest="" newest_step=-1
  for marker in "$OUTPUT_DIR"/checkpoint-*/checkpoint_complete.json; do
    [[ -f "$marker" ]] && (( $(stat -c %Y "$marker") >= started )) || continue
    folder=${marker%/checkpoint_complete.json}
    if (( ${folder##*-} > newest_step )); then newest=$folder newest_step=${folder##*-}; fi
  done
  if [[ -n "$newest" ]]; then
    echo "run_peft: the launch failed (exit $status) after writing checkpoints. torch's report above names the rank" \
      "that failed first ('Root Cause') and how (exitcode -9, SIGKILL: usually the out-of-memory killer). Newest" \
      "checkpoint: $newest. Resume: run the same command with --resume_from_checkpoint latest." >&2
  fi
}

recipe_script_for() {
  case "$1" in
    *deepspeed*qlora*|*qlora*deepspeed*) echo run_peft_qlora_deepspeed.sh ;;
    *deepspeed*) echo run_peft_deepspeed.sh ;;
    *qlora*) echo run_peft_qlora_fsdp.sh ;;
    *) echo run_peft_fsdp.sh ;;
  esac
}
