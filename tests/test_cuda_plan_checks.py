"""The CUDA library's host-side checks (csrc/cuda/plan_checks.h), which machines without a GPU
can run: a plan's geometry, layout and arrays checked once when it is made, a layer's pools,
window, the plan's generation (a stale plan refused) and the workspace at each call.
tests/cpp/cuda_plan_test.cpp drives them, built with the host's C++ compiler."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "chunk_llama" / "csrc"


def test_cuda_plan_checks_without_a_gpu(tmp_path):
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.fail("no C++ compiler (scripts/setup_env.sh expects one)")
    binary = tmp_path / "cuda_plan_test"
    done = subprocess.run([compiler, "-std=c++17", "-O0", "-Wall", "-Wextra", "-Werror", f"-I{CSRC / 'include'}",
                           f"-I{CSRC / 'cuda'}", str(ROOT / "tests" / "cpp" / "cuda_plan_test.cpp"), "-o", str(binary)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "16 cases, 0 failing" in run.stdout, run.stdout + run.stderr
