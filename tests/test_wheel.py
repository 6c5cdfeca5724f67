"""Packaging: the sdist and the wheel carry the native kernel sources (csrc/), and a wheel
installed in a fresh virtual environment builds and uses the native CPU kernel from
them (tests/wheel_smoke.py, run outside the repository).

The fresh environment gets only the wheel (`--no-deps`); it sees this environment's
site-packages through a .pth line (torch, transformers, ... are not installed again),
but not the editable install of chunk-llama, whose import hook lives in a .pth file
that Python does not process there. Its JIT cache is an empty folder, so the kernel
is really built from the wheel's sources (one build, about 15 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NATIVE = (".h", ".cuh", ".cu", ".cpp")  # what ops/jit.py hashes and compiles


def _run(args, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kwargs)
    command = " ".join(map(str, args))
    assert done.returncode == 0, f"{command} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done


def _repo_sources() -> dict[str, bytes]:
    """csrc-relative path -> bytes of every native source in the repository."""
    sources = {str(p.relative_to(REPO / "csrc")): p.read_bytes()
               for p in (REPO / "csrc").rglob("*") if p.is_file() and p.suffix in NATIVE}
    assert any(name.endswith(".cpp") for name in sources) and any(name.endswith(".cu") for name in sources)
    return sources


def _assert_wheel_carries_sources(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name.removeprefix("chunk_llama/csrc/"): archive.read(name)
                   for name in archive.namelist() if name.startswith("chunk_llama/csrc/")}
        names = archive.namelist()
    sources = _repo_sources()
    assert sorted(n for n in sources if n not in shipped) == [], f"{wheel.name} lacks kernel sources"
    assert [n for n in sources if shipped[n] != sources[n]] == [], f"{wheel.name} has stale kernel sources"
    assert "chunk_llama/ops/jit.py" in names and "chunk_llama/data/toolqa/systems.jsonl" in names


def _env(**extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "CHUNK_LLAMA_"))}
    env.update(PYTHONNOUSERSITE="1", **extra)
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """A wheel built from the working tree, as `pip install .` builds it."""
    out = tmp_path_factory.mktemp("dist")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", out, REPO])
    wheels = list(out.glob("chunk_llama-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def venv(tmp_path_factory, wheel) -> Path:
    """A fresh virtual environment with the wheel installed and this one's packages visible."""
    root = tmp_path_factory.mktemp("venv") / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", root])
    python = root / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel])
    purelib = _purelib(root)
    ours = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    (purelib / "zz_chunk_llama_test_deps.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    return root


def _purelib(venv: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_path('purelib'))"
    return Path(_run([venv / "bin" / "python", "-c", code]).stdout.strip())


def _smoke(venv: Path, tmp_path: Path, expect: str) -> tuple[dict, str]:
    run_dir = tmp_path / "run"  # outside the repository: nothing imports from the checkout
    run_dir.mkdir()
    script = shutil.copy(REPO / "tests" / "wheel_smoke.py", run_dir / "wheel_smoke.py")
    done = _run([venv / "bin" / "python", script, venv, expect], cwd=run_dir,
                env=_env(CHUNK_LLAMA_CACHE_DIR=str(tmp_path / "jit-cache")))
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_sdist_carries_the_sources_and_its_wheel_too(tmp_path):
    out = tmp_path / "dist"
    build_sdist = f"from setuptools import build_meta; print(build_meta.build_sdist({str(out)!r}))"
    done = _run([sys.executable, "-c", build_sdist], cwd=REPO)
    sdist = out / done.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"setup.py", "MANIFEST.in", "pyproject.toml"} <= names
    missing = sorted(f"csrc/{n}" for n in _repo_sources() if f"csrc/{n}" not in names)
    assert missing == [], f"{sdist.name} lacks kernel sources: {missing}"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
          "-w", out, sdist])
    _assert_wheel_carries_sources(next(out.glob("chunk_llama-*.whl")))


def test_wheel_carries_the_kernel_sources(wheel):
    _assert_wheel_carries_sources(wheel)


def test_installed_wheel_builds_and_uses_the_native_cpu_kernel(venv, tmp_path):
    report, stderr = _smoke(venv, tmp_path, "native")
    assert report["backend"].startswith("cpu:"), report
    assert report["reason"] is None
    assert Path(report["csrc"]).is_relative_to(venv.resolve()), report
    assert "chunk-llama: building the CPU attention kernel" in stderr, stderr  # built here, from the wheel


def test_installed_wheel_without_sources_says_so_and_falls_back(venv, tmp_path):
    sources, hidden = _purelib(venv) / "chunk_llama" / "csrc", tmp_path / "csrc-hidden"
    shutil.move(sources, hidden)
    try:
        report, stderr = _smoke(venv, tmp_path, "missing")
    finally:
        shutil.move(hidden, sources)
    assert report["backend"] == "reference"
    assert "the native kernel sources are missing" in report["reason"], report
    assert str(sources.resolve()) in report["reason"], report
    logged = "decode attention runs the PyTorch reference: the native kernel sources are missing"
    assert stderr.count(logged) == 1, stderr  # logged once, with the reason
    assert "chunk-llama: building" not in stderr, stderr
