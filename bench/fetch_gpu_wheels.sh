#!/usr/bin/env bash
# Download the wheels bench/gpu_check.sh installs on the lent GPU machine into bench/wheels/<set>/ (git-ignored):
#   bash bench/fetch_gpu_wheels.sh [core|qlora|gptq|arrow|all]     (default: all = core, qlora, gptq) -- then sizes
# The image (Python 3.12, torch 2.11+cu130, transformers 5.17, accelerate 1.15, pyarrow 25.0.1, pandas 3.0.6,
# matplotlib 3.11.2, hf-xet, ...; no trl/datasets/bitsandbytes/httpx2; seen on the H200 2026-12-04) lacks only what
# the sets below hold, so all three travel in one device call (~31 MiB with the working tree; the limit is 64):
#   core   trl, datasets and their deps the image lacks, transformers/peft/tokenizers/huggingface_hub at the pinned
#          versions, and huggingface_hub 2.x's own needs (httpx2, httpcore2, truststore, click, pydantic) (~24 MiB)
#   qlora  bitsandbytes, slimmed to the CPU and CUDA 13 libraries the image's torch 2.11+cu130 loads (41 -> ~7 MiB)
#   gptq   optimum + GPT-QModel (pure Python) for the GPTQ step, installed apart from the rest (gpu_check.sh)
#   arrow  pyarrow and pillow (59 MiB), not in `all`: only for an image without pyarrow >= 24 (datasets 5.2's floor),
#          carried in a call of its own with --install_only
# --no-deps with an explicit list: letting pip resolve would pull a CUDA torch (GBs) for the image's Python.
# Versions are this repo's pins (requirements.txt) and the versions its CPU venv resolved for their dependencies.
set -euo pipefail
cd "$(dirname "$0")"
WHEELS=${WHEELS:-wheels}
want=${1:-all}

CORE=(trl==1.16.0 datasets==5.2.0 transformers==5.24.0 peft==0.21.2 tokenizers==0.23.3 huggingface_hub==2.4.0
      dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 typer==0.29.2 fsspec==2026.9.0
      httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 click==8.5.1 pydantic==2.14.4 pydantic_core==2.50.5
      annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0 annotated-doc==0.0.7)
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

if [[ $want == arrow ]]; then fetch arrow "${ARROW[@]}"; fi
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
