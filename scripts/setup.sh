#!/usr/bin/env bash
# Create .venv (once) and install the pinned dependencies into it.
#   bash scripts/setup.sh            # what `make demo` and `make test` run first
# torch is installed on its own first: it is the big one, and a pip configured with a local CPU wheel (as on the
# CI machines) or a CUDA index then serves it before the rest resolves against it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
stamp="$VENV/.installed-$(cat requirements.txt requirements-dev.txt | sha256sum | cut -c1-16)"
if [[ -f "$stamp" ]]; then exit 0; fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
torch_pin=$(grep -E '^torch==' requirements.txt)
pip_install "$torch_pin"
pip_install -r requirements-dev.txt
touch "$stamp"
