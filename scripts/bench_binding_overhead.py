"""Cost of the CPU kernels' binding: the ctypes binding over the torch-free C interface
(`ops/cpu/binding.py`, what chunk-llama ships) against the C++ torch op it replaced (the glue
`csrc/cpu/tpp_cpu_torch.cpp` of commit 81a3301, JIT-built with torch.utils.cpp_extension),
in one process, the two interleaved (A, B, A, B, ...), medians.

    git archive 81a3301 csrc | tar -x -C /tmp/old
    python scripts/bench_binding_overhead.py --torch-op-csrc /tmp/old/csrc

Measures a decode step of the default model (SmolLM2-135M, float32, 30 layers: an
attention call per layer, and `small_linear` where the linear path takes it) at batch 1
and 32, milliseconds per step, as `bench_host_overhead.py` times a step; then the step's
first call of each op replayed alone, and `small_linear` on a 576 -> 576 weight (the
per-call cost, microseconds).

Both bindings run the same kernels (the kernel sources did not change); the engine's
backend objects call whichever `Switch.target` is at the time. One thread.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import chunk_llama
from chunk_llama import ChunkCache
from chunk_llama.ops.build import native
from chunk_llama.ops.build.spec import CPU_FLAGS, compiled_variants, cpu_build
from chunk_llama.ops.cpu.binding import CpuLibrary


def load_torch_op(csrc: Path, build_dir: Path):
    """The old torch op library (`torch.ops.chunk_llama_cpu`) built from `csrc` (81a3301's)."""
    from torch.utils import cpp_extension

    sources = [csrc / "cpu" / "tpp_cpu_torch.cpp", *(csrc / "cpu" / f"kernel_{v}.cpp" for v in compiled_variants())]
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name="chunk_llama_cpu_torch_op", sources=[str(s) for s in sources],
                       extra_include_paths=[str(csrc / "include")], extra_cflags=[*CPU_FLAGS],
                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False)
    return torch.ops.chunk_llama_cpu


class TorchOpBinding:
    """The old op behind the ctypes binding's methods; a plan's call passes the plan's
    layout as the list the old op took (the old backend passed `plan.layout` per layer)."""

    def __init__(self, ops, ctypes_binding):
        self.ops, self.helper = ops, ctypes_binding

    def decode_call(self, plan, layout, scratch, scale, window, items, isa):
        layout, tpp_decode = list(layout), self.ops.tpp_decode
        return lambda q, k, v: tpp_decode(q, k, v, plan, layout, scratch, float(scale), window, items, isa)

    def prefill_call(self, plan, layout, scratch, scale, window, isa):
        layout, tpp_prefill = list(layout), self.ops.tpp_prefill
        return lambda q, k, v: tpp_prefill(q, k, v, plan, layout, scratch, float(scale), window, isa)

    def small_linear(self, x, weight, bias, isa):
        return self.ops.small_linear(x, weight, bias, isa)

    def __getattr__(self, name):  # scratch sizes, layouts, variants: the same C++ either way
        return getattr(self.helper, name)


class Switch:
    """What the engine's backends hold as their library: each op goes to `target` (a plan's
    call is made when a step plans, so a step runs under one binding), and the first call
    of each op is kept, to replay it alone."""

    def __init__(self, target):
        self.target = target
        self.record(0)

    def decode_call(self, *args):
        call = self.target.decode_call(*args)
        if "tpp_decode" in self.first:
            return call

        def recorded(q, k, v):  # copies: the step's buffers hold the next step's plan later
            plan, layout, scratch, *scalars = args
            self.first.setdefault("tpp_decode", ((plan.clone(), layout, scratch.clone(), *scalars), (q.clone(), k, v)))
            return call(q, k, v)
        return recorded

    def prefill_call(self, *args):
        return self.target.prefill_call(*args)

    def small_linear(self, x, weight, bias, isa):
        if x.shape[0] == self.decode_rows:
            self.first.setdefault("small_linear", (x, weight, bias, isa))
        return self.target.small_linear(x, weight, bias, isa)

    def __getattr__(self, name):
        return getattr(self.target, name)

    def record(self, decode_rows: int) -> None:
        """Keep the first calls of a decode step of `decode_rows` sequences from now on."""
        self.first, self.decode_rows = {}, decode_rows


def interleaved(fns: dict, rounds: int, calls: int) -> dict[str, float]:
    """Median over `rounds` of the mean time of `calls` calls, per configuration, in
    microseconds; the configurations alternate round by round."""
    samples = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            samples[name].append((time.perf_counter() - start) / calls * 1e6)
    return {name: statistics.median(values) for name, values in samples.items()}


@torch.no_grad()
def decode_steps(model, switch: Switch, bindings: dict, batch: int, rounds: int) -> dict[str, float]:
    """Microseconds per decode step at `batch` (36-token prompts, then one token per step)."""
    cache = ChunkCache(model, kv_cache_bytes=1 << 28)
    prompt = list(range(5, 41))
    starts = [cache.add_sequence(i, prompt + [50 + i]) for i in range(batch)]
    input_ids, position_ids, last = cache.begin_prefill(list(range(batch)), starts)
    model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, logits_to_keep=last)
    cache.end_step(completed=True)
    lengths = [len(prompt) + 1] * batch

    def step():
        order = cache.begin_decode({i: 42 for i in range(batch)})
        position = torch.tensor([[lengths[i]] for i in order])
        for i in order:
            lengths[i] += 1
        model(input_ids=torch.full((batch, 1), 42), position_ids=position, past_key_values=cache, logits_to_keep=1)
        cache.end_step(completed=True)

    def under(binding):
        def run():
            switch.target = binding
            step()
        return run

    return interleaved({name: under(b) for name, b in bindings.items()}, rounds, 4)


def replay(bindings: dict, first: dict, rounds: int, batch: int, calls: int) -> list[tuple[str, dict]]:
    """Per-call microseconds of each op's first call in a decode step, replayed alone (a
    decode plan's call made once, then called per layer, as a step does)."""
    rows = []
    plan_args, qkv = first["tpp_decode"]
    made = {name: b.decode_call(*plan_args) for name, b in bindings.items()}
    rows.append((f"decode attention, per layer, batch {batch} (us)",
                 interleaved({name: (lambda c=c: c(*qkv)) for name, c in made.items()}, rounds, calls)))
    isa = plan_args[-1]
    small = (torch.randn(batch, 576), torch.randn(576, 576), None, isa)  # a q_proj of the default model
    for x, weight, bias, isa in ([first["small_linear"]] if "small_linear" in first else []) + [small]:
        rows.append((f"small_linear {x.shape[0]}x{weight.shape[1]} -> {weight.shape[0]} (us)",
                     interleaved({name: (lambda b=b: b.small_linear(x, weight, bias, isa))
                                  for name, b in bindings.items()}, rounds, calls)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torch-op-csrc", type=Path, required=True, help="csrc/ of commit 81a3301")
    parser.add_argument("--build-dir", type=Path, default=Path("/tmp/chunk_llama_torch_op_build"))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls", type=int, default=500, help="calls per round when an op is replayed alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spec = cpu_build()
    ctypes_binding = native.load(spec, CpuLibrary)
    if ctypes_binding is None:
        sys.exit(f"the CPU library is not available: {native.failure(spec.name)}")
    bindings = {"ctypes": ctypes_binding, "torch op": TorchOpBinding(load_torch_op(args.torch_op_csrc, args.build_dir),
                                                                     ctypes_binding)}
    switch = native._loaded[spec.name] = Switch(ctypes_binding)  # what every backend will hold

    model, _ = chunk_llama.load_default_model(dtype=torch.float32, device="cpu")
    chunk_llama.patch_model(model)
    print(f"| measurement | ctypes binding | torch op | ctypes - torch op |  (torch {torch.__version__}, 1 thread, "
          f"medians of {args.rounds} interleaved rounds)\n|---|---|---|---|", flush=True)
    for batch in args.batch:
        switch.record(batch)
        step_us = decode_steps(model, switch, bindings, batch, args.rounds)
        rows = [(f"decode step, default model, batch {batch} (ms)", {k: v / 1e3 for k, v in step_us.items()})]
        for label, values in rows + replay(bindings, switch.first, args.rounds, batch, args.calls):
            print(f"| {label} | {values['ctypes']:.3f} | {values['torch op']:.3f} | "
                  f"{values['ctypes'] - values['torch op']:+.3f} |", flush=True)

if __name__ == "__main__":
    main()
