#!/usr/bin/env bash
# Do the GPU paths work, and how fast? One command for one lent H200, within 8 minutes, printing one table
# (steps and columns: see bench/gpu_check.py):
#   bash bench/gpu_check.sh                    on the GPU machine, with the wheel sets carried (see below)
#   bash bench/gpu_check.sh --install_only     install the carried wheels and stop (the first call of two)
#   GPU_CHECK_SMOKE=1 bash bench/gpu_check.sh  CPU smoke: tiny model, fp32, 2 steps a step (tests/test_gpu_check.py)
# The image (Python 3.12, torch 2.11, transformers 5.17, accelerate 1.15, peft; no trl/datasets/bitsandbytes) gets
# the rest from wheels: `bash bench/fetch_gpu_wheels.sh` here, then carry bench/wheels/<set> (64 MiB a call):
#   call 1: carry bench/wheels/arrow + bench/wheels/gptq, run `bash bench/gpu_check.sh --install_only`
#   call 2 (machine still warm, installs kept): carry bench/wheels/core + bench/wheels/qlora, run this script
# torch is never installed (the image's stays). Knobs: GPU_CHECK_LAYERS (4), GPU_CHECK_STEPS (8),
# GPU_CHECK_BUDGET_S (450), UPSTREAM_SFT_DIR (upstream's examples/sft, for the side-by-side row), PYTHON.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if [[ -n "${GPU_CHECK_SMOKE:-}" && -x .venv/bin/python && "$PYTHON" == python ]]; then PYTHON=.venv/bin/python; fi

shopt -s nullglob
wheels=(bench/wheels/*/*.whl)
# Into bench/.gpu-site (git-ignored, so it stays on the warm machine between calls), first on PYTHONPATH: the image's
# own site-packages are never modified (and an externally-managed Python cannot refuse the install). Only on a GPU
# machine: on a workstation these Python 3.12 wheels are not this environment's.
SITE=bench/.gpu-site
if (( ${#wheels[@]} )) && [[ -z "${GPU_CHECK_SMOKE:-}" ]] && command -v nvidia-smi > /dev/null; then
  # --no-deps: the sets list every dependency the image lacks; resolving would fetch (or fail to fetch) a torch.
  timeout 240 "$PYTHON" -m pip install -q --no-deps --no-index --disable-pip-version-check --upgrade \
    --target "$SITE" "${wheels[@]}" \
    || echo "gpu_check: installing the carried wheels failed; steps that need them will fail (soft)"
fi
if [[ -d "$SITE" && -z "${GPU_CHECK_SMOKE:-}" ]]; then export PYTHONPATH="$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
if [[ "${1:-}" == --install_only ]]; then
  "$PYTHON" -c "import importlib.util as u; print('installed:', {m: bool(u.find_spec(m)) for m in
  ('pyarrow', 'datasets', 'trl', 'bitsandbytes', 'matplotlib', 'gptqmodel')})"
  exit 0
fi
exec "$PYTHON" bench/gpu_check.py
