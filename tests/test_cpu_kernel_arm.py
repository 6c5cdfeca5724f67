"""The NEON variant of the CPU kernel, cross-compiled for aarch64 (Debian's
g++-aarch64-linux-gnu) and run under qemu-aarch64 (Debian's qemu-user), both installed
by scripts/test.sh: the torch-free test driver (tests/cpp/kernel_test.cpp) on
random trees, GQA groups, head dims and both dtypes against a scalar reference."""

import shutil

import pytest
import test_cpu_kernel_driver as driver

from chunk_llama.ops.build.spec import cpu_build

CROSS = "aarch64-linux-gnu-g++"
QEMU = "qemu-aarch64"


@pytest.mark.skipif(shutil.which(CROSS) is None or shutil.which(QEMU) is None,
                    reason=f"{CROSS} or {QEMU} is not installed (scripts/test.sh installs "
                           "g++-aarch64-linux-gnu and qemu-user)")
def test_neon_under_qemu(tmp_path):
    # static: qemu then needs no aarch64 sysroot to find libstdc++ and libc. The NEON kernels
    # are the objects an aarch64 wheel carries (its build's flags, OpenMP on; the same compile
    # commands as test_wheel.py's cross-compile, which a compiler cache then shares). The
    # generic variant, which an aarch64 library leaves out, is the quant cases' reference
    # decoding: built at -O0 (11 s, where -O3 took 404 on a Zen 3), its kernels run natively
    # only (test_cpu_kernel_driver.py), the same portable source at a tenth of emulation's cost.
    binary = driver.build_driver(CROSS, ["neon", "generic"], tmp_path, extra={"generic": ["-O0"]},
                                 link=["-static"], library=cpu_build("aarch64"))
    out = driver.run_driver([QEMU, str(binary)], ["neon"], timeout=150)
    assert "variant neon" in out
