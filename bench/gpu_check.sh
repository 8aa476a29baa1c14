#!/usr/bin/env bash
# Do the GPU paths work, and how fast? One command for one lent H200, within 8 minutes, printing one table
# (steps and columns: see bench/gpu_check.py):
#   bash bench/gpu_check.sh                    on the GPU machine, with the wheel sets carried (see below)
#   bash bench/gpu_check.sh --install_only     install the carried wheels, check they import, and stop
#   GPU_CHECK_SMOKE=1 bash bench/gpu_check.sh  CPU smoke: tiny model, fp32, 2 steps a step (tests/test_gpu_check.py)
# The image (Python 3.12, torch 2.11, transformers 5.17, accelerate 1.15, pyarrow 25, pandas, matplotlib; no
# trl/datasets/bitsandbytes) gets the rest from wheels: `bash bench/fetch_gpu_wheels.sh` here, then ONE call
# (~31 MiB carried; seen 2026-12-04):
#   run(command="bash bench/gpu_check.sh", carry=["bench/wheels/core", "bench/wheels/qlora", "bench/wheels/gptq"])
# Put `bash bench/gpu_check.sh --install_only &&` in front to stop in 30 s where an import fails instead of
# spending the budget on steps that all fail the same way.
# torch is never installed (the image's stays). The gptq set goes to its own folder, on the path of the GPTQ step
# alone: a gptqmodel that cannot import (its regex engine pypcre is a C extension no wheel here has) makes PEFT's
# get_peft_model fail in every other step, since PEFT imports it whenever it is installed (seen on the H200).
# Knobs: GPU_CHECK_LAYERS (4), GPU_CHECK_STEPS (8), GPU_CHECK_BUDGET_S (450), UPSTREAM_SFT_DIR (upstream's
# examples/sft, for the side-by-side row), PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if [[ -n "${GPU_CHECK_SMOKE:-}" && -x .venv/bin/python && "$PYTHON" == python ]]; then PYTHON=.venv/bin/python; fi

shopt -s nullglob
# Into bench/.gpu-site (git-ignored, so it stays on the warm machine between calls), first on PYTHONPATH: the image's
# own site-packages are never modified (and an externally-managed Python cannot refuse the install). Only on a GPU
# machine: on a workstation these Python 3.12 wheels are not this environment's.
SITE=bench/.gpu-site
GPTQ_SITE=bench/.gpu-site-gptq  # bench/gpu_check.py puts it on the GPTQ step's path only
install() {  # install <target> <wheels...>
  local target=$1; shift
  # --no-deps: the sets list every dependency the image lacks; resolving would fetch (or fail to fetch) a torch.
  timeout 240 "$PYTHON" -m pip install -q --no-deps --no-index --disable-pip-version-check --upgrade \
    --target "$target" "$@" || echo "gpu_check: installing wheels into $target failed; steps that need them fail (soft)"
}
if [[ -z "${GPU_CHECK_SMOKE:-}" ]] && command -v nvidia-smi > /dev/null; then
  main_wheels=() gptq_wheels=()
  for wheel in bench/wheels/*/*.whl; do
    if [[ $wheel == bench/wheels/gptq/* ]]; then gptq_wheels+=("$wheel"); else main_wheels+=("$wheel"); fi
  done
  if (( ${#main_wheels[@]} )); then install "$SITE" "${main_wheels[@]}"; fi
  if (( ${#gptq_wheels[@]} )); then install "$GPTQ_SITE" "${gptq_wheels[@]}"; fi
fi
if [[ -d "$SITE" && -z "${GPU_CHECK_SMOKE:-}" ]]; then export PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
if [[ "${1:-}" == --install_only ]]; then
  # What every step imports; one line naming what is missing beats fourteen rows failing the same way.
  exec "$PYTHON" -c "import datasets, trl, peft, bitsandbytes, matplotlib, huggingface_hub.hf_api, transformers
print('gpu_check: imports ok: transformers', transformers.__version__, 'peft', peft.__version__, 'trl',
      trl.__version__, 'datasets', datasets.__version__, 'bitsandbytes', bitsandbytes.__version__)"
fi
exec "$PYTHON" bench/gpu_check.py
