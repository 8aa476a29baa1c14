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
#   PYTHONPATH=.venv/gptq-site .venv/bin/python -m sft_recipe.train.gptq --build_tiny .tiny/gptq
#   PYTHONPATH=.venv/gptq-site ACCELERATE_USE_CPU=true ACCELERATE_CONFIG=configs/cpu/fsdp_config.yaml NUM_PROCESSES=2 \
#     MODEL=.tiny/gptq DATASET=.tiny/data/jsonl OUTPUT_DIR=runs/gptq-dry bash run_peft_fsdp_gptq.sh \
#     --use_flash_attn False --bf16 False --max_steps 3 --max_seq_len 128
set -euo pipefail
cd "$(dirname "$0")"

MODEL=${MODEL:-hugging-quants/Meta-Llama-3.1-8B-Instruct-GPTQ-INT4}
DATASET=${DATASET:-smangrul/ultrachat-10k-chatml}
OUTPUT_DIR=${OUTPUT_DIR:-llama3-8B-gptq-sft-lora-fsdp}
ACCELERATE_CONFIG=${ACCELERATE_CONFIG:-configs/fsdp_config.yaml}
source scripts/lib/launch_common.sh  # GUIDE_FLAGS, accelerate_launch, run_and_exit
accelerate_launch
# Where it differs from the guide's LoRA run: LoRA on the GPTQ layers by name, and no upload (as upstream).
run_and_exit "${LAUNCH[@]}" train.py "${GUIDE_FLAGS[@]}" \
--lora_target_modules "q_proj,k_proj,v_proj,o_proj,up_proj,gate_proj" \
--push_to_hub False \
"$@"
