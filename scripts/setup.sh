#!/usr/bin/env bash
# Create .venv (once) and install the pinned dependencies into it.
#   bash scripts/setup.sh            # what `make demo` and `make test` run first
# torch is installed on its own first: it is the big one, and a pip configured with a local CPU wheel (as on the
# CI machines) or a CUDA index then serves it before the rest resolves against it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
stamp="$VENV/.installed-$(cat requirements.txt requirements-dev.txt | sha256sum | cut -c1-16)"
if [[ -f "$stamp" ]]; then exit 0; fi
# The interpreter: PYTHON if set; else python3 on PATH or the distribution's, an optimized build first
# (scripts/pick_python.py: pyenv's default build costs every launched rank ~8 % more CPU). An existing .venv is kept
# whatever it was built from: `rm -rf .venv` to build it again.
if [[ ! -x "$VENV/bin/python" ]]; then
  PYTHON=${PYTHON:-$(python3 scripts/pick_python.py python3 /usr/bin/python3)}
  "$PYTHON" -m venv "$VENV"
fi
pip_install() { "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
torch_pin=$(grep -E '^torch==' requirements.txt)
pip_install "$torch_pin"
pip_install -r requirements-dev.txt
touch "$stamp"
