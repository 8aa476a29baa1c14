#!/usr/bin/env bash
# The demo behind `make demo`: LoRA with real FSDP (FSDP1, 2 CPU processes over gloo) on the embedded tiny model,
# then the saved adapter is reloaded with PeftModel.from_pretrained and compared with its base on held-out prompts,
# and merged into its base with merge_adapter.py.
#   bash scripts/demo.sh [OUTPUT_DIR]      (needs .venv and .tiny: `make demo` prepares both)
set -euo pipefail
cd "$(dirname "$0")/.."
OUTPUT_DIR=${1:-runs/demo}
export PATH="$PWD/.venv/bin:$PATH" ACCELERATE_USE_CPU=true HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1
accelerate launch --config_file configs/cpu/fsdp_config.yaml train.py --config recipes/tiny_demo.yaml \
  --output_dir "$OUTPUT_DIR"
python -m sft_recipe.evaluate --adapter_dir "$OUTPUT_DIR" --dataset_name .tiny/data/jsonl --split test \
  --fail_if_not_better
# The guide's caveat 1 closed: merge the FSDP-trained adapter into its base in one plain process (checked).
python merge_adapter.py --adapter_dir "$OUTPUT_DIR" --output_dir "$OUTPUT_DIR-merged" --overwrite
echo "live metrics were in the log above; run record: $OUTPUT_DIR/run_record.json, loss curve: $OUTPUT_DIR/loss_curve.png"
