#!/usr/bin/env bash
# Create .venv (once) and install the pinned dependencies into it.
#   bash scripts/setup.sh            # what `make demo` and `make test` run first
# torch is installed on its own first so a machine without GPUs can point pip at a CPU build
# (TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu), and a GPU machine gets the CUDA build by default.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.installed-$(cat requirements.txt requirements-dev.txt | sha256sum | cut -c1-16)"
if [[ -f "$stamp" ]]; then exit 0; fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
torch_pin=$(grep -E '^torch==' requirements.txt)
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then pip_install "$torch_pin" --index-url "$TORCH_INDEX_URL"; else pip_install "$torch_pin"; fi
pip_install -r requirements-dev.txt
touch "$stamp"
