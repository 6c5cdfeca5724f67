"""Compile every torch-free CUDA source with nvcc for sm_80 and sm_90; fail on any error or warning.

    python scripts/check_cuda_build.py

Runs without a GPU and without a CUDA build of torch (CI runs it when nvcc is present).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("80", "90")


def main() -> int:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("check_cuda_build: nvcc not found, nothing checked")
        return 0
    # torch-free sources only: the glue (tpp_torch.cpp, bindings.cpp) needs torch's CUDA headers
    sources = sorted((ROOT / "csrc" / "cuda").glob("*.cu"))
    flags = ["-std=c++17", "-O3", "-I", str(ROOT / "csrc" / "include"), "-Werror", "all-warnings",
             "-Xcompiler", "-Wall,-Wextra,-Werror"]
    for arch in ARCHS:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for source in sources:
            start = time.perf_counter()
            result = subprocess.run([nvcc, *flags, "-c", str(source), "-o", str(Path(tmp) / (source.stem + ".o"))],
                                    capture_output=True, text=True)
            status = "ok" if result.returncode == 0 else "FAILED"
            print(f"check_cuda_build: {source.relative_to(ROOT)} sm_{'/sm_'.join(ARCHS)} {status} "
                  f"({time.perf_counter() - start:.1f} s)")
            if result.returncode != 0:
                failed += 1
                print(result.stdout + result.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
