"""Compile every torch-free CUDA source with nvcc for sm_80 and sm_90 (failing on any error
or warning), and check the torch glue of the CUDA ops against torch's headers.

    python scripts/check_cuda_build.py

Runs without a GPU and without a CUDA build of torch (CI runs it when nvcc is present). A
CPU build of torch ships the c10/cuda headers but not the one its CMake generates
(c10/cuda/impl/cuda_cmake_macros.h): the glue check supplies it (it only says the
library is shared) and stops after syntax and types (-fsyntax-only), linking nothing.
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
        failed += check_glue(Path(nvcc), Path(tmp))
    return 1 if failed else 0


def cuda_includes(nvcc: Path, tmp: Path) -> list[Path]:
    """The include folders nvcc passes its host compiler (nvcc may be a wrapper script)."""
    empty = tmp / "empty.cu"
    empty.write_text("")
    verbose = subprocess.run([str(nvcc), "-v", "-E", str(empty)], capture_output=True, text=True).stderr
    folders = []
    for line in verbose.splitlines():
        if line.startswith("#$ INCLUDES="):
            folders += [Path(part.strip('"')[2:]) for part in line.split("=", 1)[1].split() if part.strip('"')[:2] == "-I"]
    return folders


def check_glue(nvcc: Path, tmp: Path) -> int:
    """The CUDA torch glue (csrc/cuda/tpp_torch.cpp) through the host compiler, against
    torch's headers and the CUDA toolkit's."""
    from torch.utils.cpp_extension import include_paths

    shim = tmp / "shim" / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [tmp / "shim", *map(Path, include_paths()), *cuda_includes(nvcc, tmp), ROOT / "csrc" / "include"]
    source = ROOT / "csrc" / "cuda" / "tpp_torch.cpp"
    start = time.perf_counter()
    # torch's own headers warn under -Wall (-w keeps the check to errors; the kernels above use -Werror)
    result = subprocess.run(["c++", "-std=c++17", "-fsyntax-only", "-w", *(f"-I{p}" for p in includes), str(source)],
                            capture_output=True, text=True)
    status = "ok" if result.returncode == 0 else "FAILED"
    print(f"check_cuda_build: {source.relative_to(ROOT)} (torch glue, syntax and types) {status} "
          f"({time.perf_counter() - start:.1f} s)")
    if result.returncode != 0:
        print(result.stdout + result.stderr)
    return int(result.returncode != 0)


if __name__ == "__main__":
    sys.exit(main())
