"""What each native kernel library compiles, declared once (FlashInfer's JIT-spec idea).

A `KernelBuild` names the library, its sources (relative to `csrc/`), flags and the
torch ops namespace it registers; `jit.load_extension` builds and loads it, caching by
name, torch version and a hash of the sources and flags. The CPU library holds every
instruction-set variant of the architecture (`isa.compiled_variants`); the CUDA one is
built for the GPU's own architecture.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from chunk_llama.ops import isa

# Baseline flags for every CPU file: each variant raises its own target with a pragma, so
# the glue (and the shared library) runs on any CPU of the architecture.
CPU_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-std=c++17")


@dataclass(frozen=True)
class KernelBuild:
    """name: the library (and its cache folder's stem); sources: files under csrc/;
    namespace: the `torch.ops` namespace its TORCH_LIBRARY registers; description and
    estimate_seconds: for the line printed before a first build."""

    name: str
    sources: tuple[str, ...]
    namespace: str
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()
    cuda_cflags: tuple[str, ...] = ()
    description: str = ""
    estimate_seconds: float = 60.0


@functools.cache
def cpu_build(arch: str | None = None) -> KernelBuild:
    """The CPU library for `arch` (default: this machine's): the glue and one translation
    unit per variant. Measured about 15 s on the project's 2-core machine (glue and
    variants in parallel); replaced by the last build's own duration once there is one."""
    variants = isa.compiled_variants(arch)
    return KernelBuild(
        name=f"chunk_llama_cpu_{arch or isa.host_arch()}_{'_'.join(variants)}",
        sources=("cpu/tpp_cpu_torch.cpp", *(f"cpu/kernel_{v}.cpp" for v in variants)),
        namespace="chunk_llama_cpu",
        cflags=CPU_FLAGS,
        ldflags=("-fopenmp",),
        description=f"the CPU attention kernels ({', '.join(variants)} in one build)",
        estimate_seconds=15.0,
    )


@functools.cache
def cuda_build(arch: str) -> KernelBuild:
    """The CUDA library for compute capability `arch` ("90" for sm_90)."""
    return KernelBuild(
        name=f"chunk_llama_cuda_sm{arch}",
        sources=("cuda/tpp_kernels.cu", "cuda/tpp_torch.cpp"),
        namespace="chunk_llama_cuda",
        cflags=("-O3", "-std=c++17"),
        cuda_cflags=("-O3", "-std=c++17", f"-gencode=arch=compute_{arch},code=sm_{arch}", "--use_fast_math"),
        description=f"the CUDA attention kernels for sm_{arch}",
        estimate_seconds=120.0,
    )
