"""The torch-free C++ test of the CPU kernel variants (tests/cpp/kernel_test.cpp), built
natively: random trees (decode) and packed steps (prefill), GQA groups, head dims and both
dtypes against a scalar double-precision reference, every x86 variant included. The AVX-512 variant runs
natively where the CPU has AVX-512 and elsewhere on SIMDe's portable AVX-512 (Debian's
libsimde-dev, installed by scripts/test.sh), so its code is tested on CPUs without it too (an
AVX-512 host runs the native code only). test_cpu_kernel_arm.py builds the same test for aarch64."""

import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from chunk_llama.ops.build.spec import KernelBuild, cpu_compile_command
from chunk_llama.ops.cpu import isa

ROOT = Path(__file__).resolve().parents[1]
CPU_SRC = ROOT / "chunk_llama" / "csrc" / "cpu"
DRIVER = ROOT / "tests" / "cpp" / "kernel_test.cpp"
PREFILL_CASES = ROOT / "tests" / "cpp" / "prefill_cases.cpp"  # linked beside the driver
# -O1 without OpenMP: the kernel runs its items serially, which is all a correctness test needs
# (and -O1 halves the build, which is most of the test's time)
FLAGS = ["-std=c++17", "-O1", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=off", "-Wall", "-Wextra", "-Werror",
         "-Wno-psabi", "-Wno-unknown-pragmas", f"-I{CPU_SRC}", f"-I{ROOT / 'tests' / 'cpp'}"]


# The warnings the kernel library's sources compile without (test_wheel.py's cross-compile holds
# the aarch64 library to them; the NEON driver's kernel objects are that compile's)
LIBRARY_WARNINGS = ("-Wall", "-Wextra", "-Werror", "-Wno-psabi", "-Wno-unknown-pragmas")


def build_driver(compiler: str, variants: list[str], out_dir: Path, *, extra: dict[str, list[str]] | None = None,
                 link: list[str] = (), library: KernelBuild | None = None) -> Path:
    """Compiles the driver and kernel_<variant>.cpp of each variant in parallel, links them.
    `library`: the variants that library holds compiled as its build compiles them (its flags,
    OpenMP on, LIBRARY_WARNINGS), instead of the driver's -O1 without OpenMP (which the others
    keep, with their `extra` flags after it)."""
    extra = extra or {}

    def command(source: Path, flags: list[str]) -> list[str]:
        obj = out_dir / f"{source.stem}.o"
        if library is not None and f"cpu/{source.name}" in library.sources:
            return cpu_compile_command(compiler, library, f"cpu/{source.name}", obj, LIBRARY_WARNINGS)
        return [compiler, *FLAGS, *flags, "-c", str(source), "-o", str(obj)]

    commands = [command(DRIVER, extra.get("driver", [])), command(PREFILL_CASES, extra.get("driver", []))] + [
        command(CPU_SRC / f"kernel_{v}.cpp", extra.get(v, [])) for v in variants]

    def compile_one(args: list[str]) -> str:
        done = subprocess.run(args, check=False, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stderr[-4000:]}"
        return args[-1]

    with ThreadPoolExecutor(max_workers=2) as pool:
        objects = list(pool.map(compile_one, commands))
    binary = out_dir / "kernel_test"
    openmp = ["-fopenmp"] if library is not None else []
    done = subprocess.run([compiler, *objects, *openmp, *link, "-o", str(binary)], check=False,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-4000:]
    return binary


def run_driver(command: list[str], variants: list[str], timeout: float) -> str:
    done = subprocess.run([*command, *variants], check=False, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join([*command, *variants])}:\n{done.stdout[-4000:]}{done.stderr[-2000:]}"
    for variant in variants:
        assert f"variant {variant}: 59 cases" in done.stdout, done.stdout
        assert f"variant {variant} prefill: 35 cases" in done.stdout, done.stdout
        assert f"variant {variant} prefill with context: 35 cases" in done.stdout, done.stdout
        assert f"variant {variant} linear: 96 cases" in done.stdout, done.stdout
        assert f"variant {variant} quant: 48 cases" in done.stdout, done.stdout
    assert "0 failing" in done.stdout, done.stdout
    assert re.search(r"fp16 rounding: \d+ floats, 0 wrong", done.stdout), done.stdout
    return done.stdout


@pytest.mark.skipif(isa.host_arch() != "x86_64", reason="the x86 variants build only on x86-64")
def test_every_x86_variant_with_avx512_native_or_on_simde(tmp_path):
    if shutil.which("g++") is None:
        pytest.fail("g++ is missing (scripts/test.sh expects a C++ compiler)")
    extra = {}
    if "avx512" not in isa.host_variants():
        if not Path("/usr/include/simde/x86/avx512.h").exists():
            pytest.fail("SIMDe is missing: scripts/test.sh installs Debian's libsimde-dev")
        # The emulated variant at -O0: SIMDe turns each vector operation into a loop, and the
        # kernels' unrolled tiles into very large functions, which took GCC 6 minutes at -O1 (its
        # RTL passes) against 16 s at -O0, while the slower code runs its cases in 30 s (Zen 3)
        emulate = ["-DCHUNK_ATTN_EMULATE_AVX512"]
        extra = {"driver": emulate, "avx512": [*emulate, "-O0"]}
    binary = build_driver("g++", ["avx512", "avx2", "generic"], tmp_path, extra=extra)
    runnable = [v for v in ("avx2", "generic") if v in isa.host_variants()]
    run_driver([str(binary)], ["avx512", *runnable], timeout=300)


def test_item_ranges_take_every_item_once_under_racing_threads(tmp_path):
    """The integer kernel's work stealing (csrc/cpu/item_ranges.h), alone under OpenMP: 1-8
    threads, some sleeping on items, over 0-1,000 items (tests/cpp/item_ranges_test.cpp)."""
    if shutil.which("g++") is None:
        pytest.fail("g++ is missing (scripts/test.sh expects a C++ compiler)")
    binary = tmp_path / "item_ranges_test"
    subprocess.run(["g++", *FLAGS, "-fopenmp", str(ROOT / "tests" / "cpp" / "item_ranges_test.cpp"), "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    done = subprocess.run([str(binary)], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert re.search(r"item_ranges: 560 trials, [1-9]\d* items taken from another thread's range, 0 failing",
                     done.stdout), done.stdout
