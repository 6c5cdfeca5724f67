"""What each native kernel library compiles, declared once (FlashInfer's JIT-spec idea), and
how: one function that compiles a declaration into a shared library.

The libraries are torch-free: C++ (and CUDA) with a C interface (`csrc/cpu/c_api.h`,
`csrc/cuda/c_api.h`), bound in Python with ctypes (`cpu/binding.py`, `cuda/binding.py`). So one
compiled library serves every torch release, and building one needs a compiler but no
torch. Two callers build them, both through `compile_library`: `setup.py`, which puts them
in the platform wheel (`chunk_llama/_native/`), and `jit.py`, on first use where the
package carries none for this host. This module uses the standard library only, since
`setup.py` loads it by path, before chunk-llama or torch is importable.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).resolve().parents[2] / "csrc"  # the kernel sources, inside the package
NATIVE_SUFFIXES = (".h", ".cuh", ".cu", ".cpp")  # what a build reads (and its digest covers)
# Baseline flags for every CPU file: each variant raises its own target with a pragma, so
# the glue (and the shared library) runs on any CPU of the architecture. Only the C
# interface is exported (c_api.h marks it). No contraction of a * b + c into an FMA: GCC
# contracts C++ (vector intrinsics included) where it sees both operations, which differs
# between the inlined copies of one expression; the kernels write each FMA they mean, so
# that two code paths that must agree bit for bit (batch invariance) round the same way.
CPU_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-std=c++17", "-fPIC",
             "-fvisibility=hidden")
CUDA_FLAGS = ("-O3", "-std=c++17", "--use_fast_math", "-Xcompiler", "-fPIC,-fvisibility=hidden")
# What a wheel's CUDA library holds (CHUNK_LLAMA_CUDA_ARCHS overrides it at build time): a
# cubin per architecture family the kernels support (compute capability 8.0 on; a cubin
# runs on later minor versions of its major one: sm_80 on 8.7, sm_100 on 10.3, sm_120 on
# 12.1), and PTX of the newest, which the driver compiles for GPUs newer than all of them.
RELEASE_CUDA_ARCHS = ("80", "86", "89", "90", "100", "110", "120")


@dataclass(frozen=True)
class KernelBuild:
    """name: the library (`lib<name>.so`, and its JIT cache folder's stem); sources: files
    under csrc/; cuda_archs: the GPU architectures compiled ("90" for sm_90) when the
    sources include CUDA, the last one also as PTX; description and estimate_seconds: for
    the line printed before a first build."""

    name: str
    sources: tuple[str, ...]
    cflags: tuple[str, ...] = CPU_FLAGS
    ldflags: tuple[str, ...] = ()
    cuda_archs: tuple[str, ...] = ()
    description: str = ""
    estimate_seconds: float = 60.0

    @property
    def cuda(self) -> bool:
        return bool(self.cuda_archs)

    @property
    def filename(self) -> str:
        return f"lib{self.name}.so"


@functools.cache  # (the dispatch asks per decode step)
def host_arch() -> str:
    """'x86_64', 'aarch64' or what `platform.machine()` says."""
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def compiled_variants(arch: str | None = None) -> tuple[str, ...]:
    """The CPU kernel variants a build for `arch` (default: this machine's) holds, best first,
    the last one run by every CPU of `arch`. aarch64's is neon alone: Advanced SIMD is part of
    ARMv8-A, so the portable variant would never be picked there, and leaving it out takes its
    compile, the build's longest, out of the first use (docs/BENCHMARKS.md)."""
    arch = arch or host_arch()
    if arch == "x86_64":
        return ("avx512", "avx2", "generic")
    if arch == "aarch64":
        return ("neon",)
    return ("generic",)


@functools.cache
def cpu_build(arch: str | None = None) -> KernelBuild:
    """The CPU library for `arch` (default: this machine's): the C interface and one
    translation unit per variant. The variants' kernels are nearly all of a build, generic's
    the longest (GCC 12: generic 93 s, avx512 52, avx2 44, the rest 3 on a Zen 5; generic 322 s
    and avx512 132 on a Zen 3, where the aarch64 cross-compile takes neon 258 s), so the
    sources are listed longest first, as `compile_library` starts them: on 2 cores generic
    beside avx512 then avx2 (docs/BENCHMARKS.md, "First-use build of the CPU library")."""
    variants = compiled_variants(arch)
    kernels = sorted(variants, key=lambda v: v != "generic")  # (a stable sort: generic, then the rest in order)
    return KernelBuild(
        name=f"chunk_llama_cpu_{arch or host_arch()}_{'_'.join(variants)}",
        sources=(*(f"cpu/kernel_{v}.cpp" for v in kernels), "cpu/c_api.cpp", "cpu/plan_checks.cpp",
                 "cpu/planned.cpp", "cpu/layer.cpp", "cpu/lora.cpp", "cpu/quant_api.cpp"),
        ldflags=("-fopenmp",),
        description=f"the CPU attention kernels ({', '.join(variants)} in one build)",
        estimate_seconds=120.0,
    )


def cuda_build(archs: tuple[str, ...]) -> KernelBuild:
    """The CUDA library for compute capabilities `archs` ("90" for sm_90); the CUDA runtime
    is linked statically, so the library needs only the NVIDIA driver."""
    return KernelBuild(
        name="chunk_llama_cuda_sm" + "_".join(archs),
        sources=("cuda/tpp_kernels.cu", "cuda/c_api.cu"),
        cflags=CUDA_FLAGS,
        ldflags=("-cudart", "static", "-Xlinker", "--exclude-libs,ALL"),
        cuda_archs=tuple(archs),
        description=f"the CUDA attention kernels for sm_{', sm_'.join(archs)}",
        estimate_seconds=15.0 * len(archs) + 10,
    )


def source_digest(spec: KernelBuild) -> str:
    """A hash of every kernel source and of the flags: what a built library is keyed by."""
    h = hashlib.sha256()
    for path in sorted(p for p in CSRC.rglob("*") if p.suffix in NATIVE_SUFFIXES):
        h.update(str(path.relative_to(CSRC)).encode())
        h.update(path.read_bytes())
    h.update(" ".join((*spec.sources, *spec.cflags, *spec.ldflags, *spec.cuda_archs)).encode())
    return h.hexdigest()[:16]


class BuildError(RuntimeError):
    """A compiler is missing or failed; the message says which and how."""


def find_compiler(spec: KernelBuild) -> str:
    """The compiler `spec` needs: nvcc (`$CUDA_HOME/bin` or PATH) for CUDA, else `$CXX`,
    c++, g++ or clang++. BuildError naming what was looked for where there is none."""
    if spec.cuda:
        home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
        nvcc = shutil.which("nvcc", path=str(Path(home) / "bin")) if home else None
        nvcc = nvcc or shutil.which("nvcc")
        if nvcc is None:
            raise BuildError("nvcc was not found (looked in $CUDA_HOME/bin and PATH): no CUDA toolkit")
        return nvcc
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    raise BuildError(f"no C++ compiler was found (looked for {', '.join(candidates)} on PATH)")


def _gencode(archs: tuple[str, ...]) -> list[str]:
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs]
    return flags + [f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"]


def _run(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stderr or done.stdout).strip()
        raise BuildError(f"{Path(command[0]).name} failed ({done.returncode}): {' '.join(command)}\n{output[-6000:]}")


def cpu_compile_command(compiler: str, spec: KernelBuild, source: str, obj: Path,
                        extra_flags: tuple[str, ...] = ()) -> list[str]:
    """The command `compile_library` compiles a C++ `source` of `spec` with (the tests build
    their drivers' kernel objects with it: the same command, so a compiler cache shares them)."""
    include = [f"-I{CSRC / 'include'}", f"-I{CSRC / 'cpu'}"]
    return [compiler, *spec.cflags, *extra_flags, *include, "-c", str(CSRC / source), "-o", str(obj)]


def compile_library(spec: KernelBuild, out_dir: Path, extra_flags: tuple[str, ...] = (),
                    jobs: int | None = None) -> Path:
    """Compile `spec` into `out_dir/lib<name>.so` (objects beside it), each source in
    parallel (`jobs`, default: the CPU count); returns the library's path. BuildError if a
    compiler is missing or fails. `extra_flags`: for every compile (e.g. warnings as errors)."""
    compiler = find_compiler(spec)
    out_dir.mkdir(parents=True, exist_ok=True)
    include = [f"-I{CSRC / 'include'}", f"-I{CSRC / 'cpu'}"]
    arch_flags = _gencode(spec.cuda_archs) if spec.cuda else []
    # nvcc compiles every architecture of a .cu file in parallel with --threads
    threads = ["--threads", str(jobs or os.cpu_count() or 1)] if spec.cuda else []

    def compile_one(source: str) -> Path:
        path = CSRC / source
        obj = out_dir / f"{path.stem}.o"
        if path.suffix == ".cu":
            _run([compiler, *spec.cflags, *extra_flags, *include, *arch_flags, *threads, "-c", str(path), "-o",
                  str(obj)])
        else:
            _run(cpu_compile_command(compiler, spec, source, obj, extra_flags))
        return obj

    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        objects = list(pool.map(compile_one, spec.sources))
    library = out_dir / spec.filename
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    link = [*arch_flags] if spec.cuda else []
    _run([compiler, "-shared", *link, *(str(o) for o in objects), *spec.ldflags, "-o", str(partial)])
    os.replace(partial, library)  # whole or absent: a reader never sees a half-written library
    return library


def timed_compile(spec: KernelBuild, out_dir: Path, **kwargs) -> tuple[Path, float]:
    """`compile_library` and its duration in seconds."""
    start = time.perf_counter()
    library = compile_library(spec, out_dir, **kwargs)
    return library, time.perf_counter() - start
