#!/usr/bin/env bash
# Download the wheels bench/gpu_check.sh installs on the lent GPU machine (Python 3.12 image with torch 2.11,
# transformers 5.17, accelerate 1.15, peft; no trl/datasets/bitsandbytes), into bench/wheels/<set>/ (git-ignored):
#   bash bench/fetch_gpu_wheels.sh [arrow|core|qlora|gptq|all]     (default: all) -- then prints each set's size
# The device call carries at most 64 MiB (working tree + carried paths), so the wheels travel in sets, one per call
# (installs persist on the machine while it stays warm; bench/gpu_check.sh --install_only installs what it was given):
#   arrow  pyarrow and pillow (59 MiB): the first call, with gptq (2 MiB)
#   core   the rest train.py needs beyond the image: trl, datasets and their deps, transformers/peft at the pinned
#          versions (~37 MiB)
#   qlora  bitsandbytes, slimmed to the CPU and CUDA 13 libraries the image's torch 2.11+cu130 loads (41 -> ~4 MiB)
#   gptq   optimum + GPT-QModel (pure Python) for the GPTQ step
# --no-deps with an explicit list: letting pip resolve would pull a CUDA torch (GBs) for the image's Python.
# Versions are this repo's pins (requirements.txt) and the versions its CPU venv resolved for their dependencies.
set -euo pipefail
cd "$(dirname "$0")"
WHEELS=${WHEELS:-wheels}
want=${1:-all}

CORE=(trl==1.16.0 datasets==5.2.0 transformers==5.24.0 peft==0.21.2 tokenizers==0.23.3 huggingface_hub==2.4.0
      pandas==3.1.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 typer==0.29.2 hf-xet==1.8.0
      python-dateutil==4.0.0 tzdata==2026.6
      matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 pyparsing==3.3.3)  # loss_curve.png
ARROW=(pyarrow==26.0.1 pillow==13.0.0)  # pillow: matplotlib's, in case the image lacks it
QLORA=(bitsandbytes==0.50.2)
GPTQ_PURE=(optimum==2.3.0 threadpoolctl==3.8.0)
GPTQ_SDIST=(gptqmodel==7.7.0 device-smi==0.5.7 tokenicer==0.0.14 logbar==0.4.15 defuser==0.0.28)  # sdists: built here

fetch() {  # fetch <set> <pins...>: binary wheels for CPython 3.12 on x86-64 Linux
  local set=$1; shift
  mkdir -p "$WHEELS/$set"
  pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 \
    --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any -d "$WHEELS/$set" "$@"
}

if [[ $want == arrow || $want == all ]]; then fetch arrow "${ARROW[@]}"; fi
if [[ $want == core || $want == all ]]; then fetch core "${CORE[@]}"; fi
if [[ $want == qlora || $want == all ]]; then
  fetch qlora "${QLORA[@]}"
  # The wheel carries one 21-27 MB library per CUDA/ROCm/XPU version; the image needs cuda13x (and cpu). The same
  # wheel without the others installs and imports the same on that image (pip installs the archive's files).
  python - "$WHEELS"/qlora/bitsandbytes-*.whl <<'PY'
import re, sys, zipfile
path = sys.argv[1]
keep = lambda name: not re.search(r"libbitsandbytes_(cuda1[12]\d|rocm\d+|xpu\d+)\.so$", name)
with zipfile.ZipFile(path) as src:
    entries = [(info, src.read(info)) for info in src.infolist() if keep(info.filename)]
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as dst:
    for info, data in entries:
        dst.writestr(info, data)
PY
fi
if [[ $want == gptq || $want == all ]]; then
  fetch gptq "${GPTQ_PURE[@]}"
  # Pure-Python sdists become py3 wheels here. pypcre (tokenicer's regex engine) has a C extension that this
  # Python 3.11 machine cannot build for 3.12: the GPTQ step is the one that fails soft if the image lacks it.
  pip wheel -q --no-deps -w "$WHEELS/gptq" "${GPTQ_SDIST[@]}"
fi
for set in arrow core qlora gptq; do
  if [[ -d "$WHEELS/$set" ]]; then printf '%-6s %s\n' "$set" "$(du -sh "$WHEELS/$set" | cut -f1)"; fi
done
