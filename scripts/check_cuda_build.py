"""Compile the CUDA library (the kernels and their C interface, chunk_llama/csrc/cuda/) with
nvcc for sm_80 and sm_90, warnings as errors, and link it, as the wheel's build does.

    python scripts/check_cuda_build.py

Runs without a GPU and without torch (CI runs it where nvcc is present; the wheel's build in
tests/test_wheel.py compiles every architecture it ships, without -Werror).
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("80", "90")
WERROR = ("-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror")


def load_build_module():
    """chunk_llama/ops/build/spec.py, without importing chunk_llama (and so torch)."""
    path = ROOT / "chunk_llama" / "ops" / "build" / "spec.py"
    spec = importlib.util.spec_from_file_location("chunk_llama_build", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> int:
    build = load_build_module()
    spec = build.cuda_build(ARCHS)
    try:
        build.find_compiler(spec)
    except build.BuildError as error:
        print(f"check_cuda_build: {error}; nothing checked")
        return 0
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            build.compile_library(spec, Path(tmp), extra_flags=WERROR)
        except build.BuildError as error:
            print(f"check_cuda_build: {spec.filename} FAILED\n{error}")
            return 1
    print(f"check_cuda_build: {', '.join(spec.sources)} for sm_{'/sm_'.join(ARCHS)} ok "
          f"({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
