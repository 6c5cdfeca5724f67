#!/usr/bin/env bash
# Install everything and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Compiles the torch-free CUDA sources with nvcc (sm_80, sm_90); says so when nvcc is absent.
.venv/bin/python scripts/check_cuda_build.py
# tests/test_wheel.py builds the sdist and the wheel and runs a smoke test of the wheel
# in a fresh virtual environment (native CPU kernel built from the wheel's sources,
# one generate equal to stock transformers).
exec .venv/bin/python -m pytest -q -ra tests "$@"
