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
source scripts/lib/launch_common.sh  # GUIDE_FLAGS, run_and_exit
# Upstream's flags: run_peft.sh's, with Unsloth on and LoRA on the seven projections by name.
run_and_exit "$PYTHON" train.py "${GUIDE_FLAGS[@]}" \
--gradient_accumulation_steps 8 \
--use_reentrant True \
--use_unsloth True \
--lora_target_modules "q_proj,k_proj,v_proj,o_proj,down_proj,up_proj,gate_proj" \
--use_4bit_quantization True \
--use_nested_quant True \
--bnb_4bit_compute_dtype "bfloat16" \
"$@"
