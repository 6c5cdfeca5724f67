"""Per-call cost of the small-row linear on one thread: the checked `CpuLibrary.small_linear`,
the hot-path call `ops/cpu/linear.py` uses (`small_linear_call`: only shapes checked), and the
step's whole linear (`linear.resolve`: checks, reshape and view, then the hot-path call),
interleaved in one process, medians of 9 rounds of 2,000 calls on a 1x576 -> 576 weight.

    python scripts/bench_small_linear.py
    CHUNK_LLAMA_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
        MKL_ENABLE_INSTRUCTIONS=AVX2 python scripts/bench_small_linear.py
"""

import statistics
import time

import torch

torch.set_num_threads(1)
from chunk_llama.ops.cpu import isa, linear
from chunk_llama.ops.cpu.attention import build

lib = build(); v = isa.selected_variant()
fast = lib.small_linear_call(v)
step_linear = linear.resolve(torch.float32, "cpu")
x = torch.randn(1, 576); w = torch.randn(576, 576); b = None
assert torch.equal(fast(x, w, b), lib.small_linear(x, w, b, v)) and torch.equal(step_linear(x, w, b), fast(x, w, b))
def t(f, n=2000):
    s = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - s) / n * 1e6
rows = {"checked small_linear": lambda: lib.small_linear(x, w, b, v), "hot-path call": lambda: fast(x, w, b),
        "step linear (_run + hot call)": lambda: step_linear(x, w, b)}
got = {k: [] for k in rows}
for _ in range(9):
    for k, f in rows.items(): got[k].append(t(f))
print(v, {k: round(statistics.median(g), 2) for k, g in got.items()}, "us, 1x576->576, medians of 9 interleaved rounds of 2000")
