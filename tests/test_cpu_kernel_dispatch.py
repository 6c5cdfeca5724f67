"""Choosing the CPU kernel variant, reporting the backend, one-time fallback logs, the
first-use build message and the build's separation of instruction sets."""

import ctypes
import logging
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import make_tree

from chunk_llama import ops
from chunk_llama.logs import forget_logged
from chunk_llama.ops.build import jit, native
from chunk_llama.ops.build import spec as build
from chunk_llama.ops.build.spec import KernelBuild, cpu_build
from chunk_llama.ops.cpu import isa


def test_auto_is_the_best_variant_the_cpu_runs(monkeypatch):
    monkeypatch.delenv(isa.ENV, raising=False)
    assert isa.selected_variant() == isa.host_variants()[0]
    monkeypatch.setenv(isa.ENV, "auto")
    assert isa.selected_variant() == isa.host_variants()[0]
    assert isa.host_variants()[-1] == "generic"
    if isa.host_arch() == "x86_64" and "avx2" in isa._cpu_flags():
        assert "avx2" in isa.host_variants()


def test_unknown_and_unrunnable_variants_are_clear_errors(monkeypatch):
    monkeypatch.setenv(isa.ENV, "sse9")
    with pytest.raises(ValueError, match="'sse9' is not a CPU kernel variant; choose one of auto, avx512"):
        isa.selected_variant()
    foreign = "neon" if isa.host_arch() == "x86_64" else "avx2"
    monkeypatch.setenv(isa.ENV, foreign)
    with pytest.raises(ValueError, match=f"there is no {foreign} variant for {isa.host_arch()}"):
        isa.selected_variant()
    if isa.host_arch() == "x86_64":
        # a CPU with AVX2 but without AVX-512, whatever this one has
        monkeypatch.setattr(isa, "_cpu_flags", lambda: frozenset({"avx2", "fma", "f16c", "sse2"}))
        isa.host_variants.cache_clear()
        isa._select.cache_clear()
        try:
            monkeypatch.setenv(isa.ENV, "avx512")
            with pytest.raises(ValueError, match=r"avx512: this CPU cannot run it \(it lacks avx512f\); "
                                                 r"this CPU: .*runs avx2, generic"):
                isa.selected_variant()
        finally:
            isa.host_variants.cache_clear()
            isa._select.cache_clear()


def test_backend_info(monkeypatch):
    monkeypatch.delenv(isa.ENV, raising=False)
    cpu = torch.device("cpu")
    assert ops.backend_info(cpu, torch.float32, 64, 64) == {"backend": "cpu", "isa": isa.host_variants()[0],
                                                            "reason": None}
    monkeypatch.setenv(isa.ENV, "generic")
    assert ops.backend_info(cpu, torch.bfloat16, 128, 16)["isa"] == "generic"
    info = ops.backend_info(cpu, torch.float32, 72, 64)
    assert info["backend"] == "reference" and info["isa"] is None and "head dims 32, 64, 80, 96, 128, 256, not 72" in info["reason"]
    assert "multiple of 16, not 40" in ops.backend_info(cpu, torch.float32, 64, 40)["reason"]
    assert "not float16" in ops.backend_info(cpu, torch.float16, 64, 64)["reason"]
    monkeypatch.setenv("CHUNK_LLAMA_FORCE_REFERENCE", "1")
    assert ops.backend_info(cpu, torch.float32, 64, 64) == {"backend": "reference", "isa": None,
                                                            "reason": "CHUNK_LLAMA_FORCE_REFERENCE is set"}


def test_fallbacks_are_logged_once_per_reason(monkeypatch, caplog):
    forget_logged()
    q = torch.randn(2, 2, 72)
    pool, _ = make_tree([[1] * 50], chunk_size=48, num_kv_heads=1, head_dim=72)
    with caplog.at_level(logging.WARNING, logger="chunk_llama.ops"):
        assert ops.decode_backend(q, pool.k[0]) == "reference"
        assert ops.decode_backend(q, pool.k[0]) == "reference"
        pool40, _ = make_tree([[1] * 50], chunk_size=40, num_kv_heads=1, head_dim=64)
        assert ops.decode_backend(torch.randn(1, 1, 64), pool40.k[0]) == "reference"
        pool64, _ = make_tree([[1] * 50], chunk_size=64, num_kv_heads=1, head_dim=64)
        assert ops.decode_backend(torch.randn(1, 1, 64), pool64.k[0]) == "cpu"
        monkeypatch.setenv("CHUNK_LLAMA_FORCE_REFERENCE", "1")
        assert ops.decode_backend(torch.randn(1, 1, 64), pool64.k[0]) == "reference"
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 3, messages
    assert "head dims 32, 64, 80, 96, 128, 256, not 72" in messages[0]
    assert "multiple of 16, not 40" in messages[1]
    assert "CHUNK_LLAMA_FORCE_REFERENCE" in messages[2]


def test_first_use_build_says_what_it_builds_once(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("CHUNK_LLAMA_CACHE_DIR", str(tmp_path))
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" __attribute__((visibility("default"))) long twice(long x) { return 2 * x; }\n')
    spec = KernelBuild(name="chunk_llama_jit_test", sources=(str(source),), cflags=("-O0", "-fPIC"),
                       description="the tiny test library", estimate_seconds=7)
    library = ctypes.CDLL(str(jit.build_library(spec)))
    assert library.twice(21) == 42
    first = capfd.readouterr().err
    assert "chunk-llama: building the tiny test library (first use only, about 7 s)" in first
    # built: a later process (here: a second call) finds it in the cache, without the line
    assert jit.build_library(spec) == jit.build_dir(spec) / "libchunk_llama_jit_test.so"
    assert "building" not in capfd.readouterr().err
    assert "chunk_llama_jit_test" in (tmp_path / "build_seconds.json").read_text()


def test_a_missing_compiler_is_named_and_the_reference_runs(tmp_path, monkeypatch):
    """No packaged library and no compiler: the reason names what was looked for."""
    monkeypatch.setenv("CHUNK_LLAMA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))  # no c++, g++, clang++ there
    monkeypatch.delenv("CXX", raising=False)
    spec = KernelBuild(name="chunk_llama_no_compiler_test", sources=("cpu/c_api.cpp",), description="the test kernels")
    with pytest.warns(UserWarning, match="the test kernels are not available, using the PyTorch reference"):
        assert native.load(spec, lambda path, origin: path) is None
    assert native.failure(spec.name) == ("this installation carries no prebuilt libchunk_llama_no_compiler_test.so, "
                                         "and building it from source failed: no C++ compiler was found (looked for "
                                         "c++, g++, clang++ on PATH)")
    assert native.load(spec, lambda path, origin: path) is None  # not tried again


def test_variant_objects_define_nothing_outside_their_namespace():
    """Code compiled for a wider instruction set must not leak out of its translation
    unit: an inline function with external linkage defined there could be the copy the
    linker keeps for the baseline glue, and run on a CPU without those instructions."""
    from chunk_llama.ops.cpu import attention as cpu

    library = cpu.build()
    assert library is not None and library.origin == "built", "this test reads the objects of a build from source"
    objects = {v: jit.build_dir(cpu_build()) / f"kernel_{v}.o" for v in isa.compiled_variants()}
    for variant, obj in objects.items():
        assert obj.exists(), obj
        symbols = subprocess.run(["nm", "-C", "--defined-only", str(obj)], capture_output=True, text=True,
                                 check=True).stdout.splitlines()
        exported = [s for s in symbols if s.split(" ", 2)[1:2] and s.split(" ", 2)[1].isupper()]
        assert exported, f"{obj.name} defines no symbol: is the variant compiled at all?"
        leaked = [s for s in exported if f"chunk_attn_cpu::{variant}::" not in s]
        assert not leaked, f"{obj.name} defines symbols outside chunk_attn_cpu::{variant}: {leaked[:5]}"


def test_build_holds_every_variant_of_the_architecture():
    from chunk_llama.ops.cpu import attention as cpu

    module = cpu.build()
    assert list(module.variants()) == list(isa.compiled_variants())
    for name in isa.compiled_variants():
        assert module.host_runs(name) == (name in isa.host_variants()), name
    assert Path(build.CSRC / "cpu" / "kernel_generic.cpp").exists()
