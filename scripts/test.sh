#!/usr/bin/env bash
# Install everything and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
if command -v nvcc >/dev/null 2>&1 && [ -f scripts/check_cuda_build.py ]; then
    .venv/bin/python scripts/check_cuda_build.py
else
    echo "nvcc not found or no CUDA sources: skipping the CUDA compile check"
fi
exec .venv/bin/python -m pytest -q -ra tests "$@"
