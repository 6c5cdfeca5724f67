#!/usr/bin/env bash
# Install everything and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Compiles the torch-free CUDA sources with nvcc (sm_80, sm_90); says so when nvcc is absent.
.venv/bin/python scripts/check_cuda_build.py
exec .venv/bin/python -m pytest -q -ra tests "$@"
