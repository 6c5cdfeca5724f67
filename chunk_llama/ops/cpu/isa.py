"""Which variant of the CPU kernel runs: `CHUNK_LLAMA_CPU_ISA=auto|avx512|avx2|neon|generic`.

Every build holds all the variants of its architecture (x86-64: avx512, avx2,
generic; aarch64: neon, which every aarch64 CPU runs; anything else: generic), each compiled for its own
instruction set, so the choice is made at run time and needs no rebuild. `auto`
(the default) is the best variant this CPU runs. Naming a variant the CPU cannot
run, or one the architecture has not, is a ValueError that says what the CPU has.
Detection here reads the CPU's flags without building anything; the kernel checks
again with the compiler's own CPU detection before it runs a variant.
"""

from __future__ import annotations

import functools
import os
import platform

import torch

from chunk_llama.ops.build.spec import compiled_variants, host_arch

ENV = "CHUNK_LLAMA_CPU_ISA"
VARIANTS = ("avx512", "avx2", "neon", "generic")
# The instruction-set flags (as /proc/cpuinfo names them) each x86 variant is compiled for.
X86_NEEDS = {"avx512": ("avx512f", "avx2", "fma", "f16c"), "avx2": ("avx2", "fma", "f16c")}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (Linux; empty where unreadable).
    Linux lists AVX-512 only when the OS saves its registers, so a flag here is usable."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def native_bfloat16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX-BF16 on x86-64,
    BF16 on arm64, as /proc/cpuinfo lists them) and torch's oneDNN may use it (not held below
    it by `ONEDNN_MAX_CPU_ISA`)."""
    if not _cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"}:
        return False
    return native_half_gemm(torch.bfloat16)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache
def host_variants() -> tuple[str, ...]:
    """The variants this CPU runs, best first (ending with the one its whole architecture runs:
    generic, or neon on aarch64)."""
    arch = host_arch()
    if arch == "aarch64":
        return ("neon",)  # Advanced SIMD is part of ARMv8-A
    if arch != "x86_64":
        return ("generic",)
    flags = _cpu_flags()
    if not flags:  # not Linux: torch's own detection (it also names AVX512 only where usable)
        capability = torch.backends.cpu.get_cpu_capability()
        flags = {"AVX512": set(X86_NEEDS["avx512"]), "AVX2": set(X86_NEEDS["avx2"])}.get(capability, set())
    return tuple(v for v, needs in X86_NEEDS.items() if all(f in flags for f in needs)) + ("generic",)


def describe_host() -> str:
    """'AMD EPYC (x86_64; runs avx2, generic)': for messages."""
    return f"{cpu_model()} ({host_arch()}; runs {', '.join(host_variants())})"


def selected_variant() -> str:
    """The variant `CHUNK_LLAMA_CPU_ISA` names (default auto: the best this CPU runs)."""
    return _select(os.environ.get(ENV, "auto").strip().lower() or "auto")


@functools.cache
def _select(requested: str) -> str:
    if requested == "auto":
        return host_variants()[0]
    if requested not in VARIANTS:
        raise ValueError(f"{ENV}={requested!r} is not a CPU kernel variant; choose one of auto, {', '.join(VARIANTS)}")
    if requested not in compiled_variants():
        raise ValueError(f"{ENV}={requested}: there is no {requested} variant for {host_arch()} "
                         f"(this CPU: {describe_host()})")
    if requested not in host_variants():
        missing = [f for f in X86_NEEDS.get(requested, ()) if f not in _cpu_flags()]
        raise ValueError(f"{ENV}={requested}: this CPU cannot run it"
                         + (f" (it lacks {', '.join(missing)})" if missing else "")
                         + f"; this CPU: {describe_host()}")
    return requested


@functools.cache
def native_half_gemm(dtype: torch.dtype) -> bool:
    """Whether torch's oneDNN computes `dtype` (bfloat16, float16) products at least at the
    float32 kernel's rate here, as torch reports it (False where it cannot say)."""
    check = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    try:
        return bool(getattr(torch.ops.mkldnn, check)())
    except (AttributeError, RuntimeError):  # (a private op: a torch without it keeps F.linear for many rows)
        return False
