#!/usr/bin/env bash
# Install everything and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# Compiles and links the torch-free CUDA library with nvcc (sm_80, sm_90, warnings as
# errors); says so when nvcc is absent.
.venv/bin/python scripts/check_cuda_build.py
# tests/test_wheel.py builds the platform wheel (the CPU library compiled in) and runs it in
# a fresh virtual environment with no compiler reachable; tests/test_extras.py runs each
# command with only its extra installed.
.venv/bin/python -m pytest -q -ra tests "$@"
# The private transformers APIs and generate's options on the lowest supported release
# (the suite above ran on the highest, from pyproject.toml's bounds).
bash scripts/test_lowest.sh
