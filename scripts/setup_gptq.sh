#!/usr/bin/env bash
# Install what a GPTQ base needs (optimum + GPT-QModel) beside .venv, without touching its torch, for CPU runs/tests:
#   bash scripts/setup_gptq.sh        then   PYTHONPATH=.venv/gptq-site .venv/bin/python train.py --model_name_or_path <GPTQ model> ...
# gptqmodel 7.7.0 declares torch>=2.14.1 while this recipe pins torch 2.13.0; it runs on 2.13 (tests/test_gptq.py),
# so everything goes in with --no-deps into its own folder (.venv/gptq-site): pip can never replace torch, and runs
# that do not put the folder on PYTHONPATH never see it. Its CPU kernels are compiled on first use (~1 min, cached in
# ~/.cache/gptqmodel). On a GPU machine use `pip install optimum gptqmodel` with the CUDA torch instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TARGET=${GPTQ_SITE:-$VENV/gptq-site}
PINS=(gptqmodel==7.7.0 optimum==2.3.0 device-smi==0.5.7 pypcre==0.6.4 tokenicer==0.0.14 logbar==0.4.15
      defuser==0.0.28 threadpoolctl==3.8.0 requests==2.34.2 urllib3==2.8.0 charset-normalizer==3.5.3
      certifi==2026.10.19.post1)
stamp="$TARGET/.installed-$(printf '%s\n' "${PINS[@]}" | sha256sum | cut -c1-16)"
if [[ -f "$stamp" ]]; then exit 0; fi
rm -rf "$TARGET"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q --no-deps --target "$TARGET" "${PINS[@]}"
touch "$stamp"
