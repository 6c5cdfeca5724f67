"""Cost of the CPU kernels' binding: the ctypes binding over the torch-free C interface
(`ops/cpu/binding.py` and the step's made plan, `ops/cpu/planned.py`: what chunk-llama ships)
against the C++ torch op it replaced (the glue `csrc/cpu/tpp_cpu_torch.cpp` of commit 81a3301,
JIT-built with torch.utils.cpp_extension), in one process, the two interleaved (A, B, A, B,
...), medians.

    git archive 81a3301 csrc | tar -x -C /tmp/old
    python scripts/bench_binding_overhead.py --torch-op-csrc /tmp/old/csrc

Measures a decode step of the default model (SmolLM2-135M, float32, 30 layers: an
attention call per layer, and `small_linear` where the linear path takes it) at batch 1
and 32, milliseconds per step, as `bench_host_overhead.py` times a step, with the fused
decoder layers off (`CHUNK_LLAMA_FUSED_LAYERS=0`: the torch op has no fused layer, so both
bindings run the attention op by op); then the step's first attention call replayed alone
(a layer's call on the step's made plan; the torch op's, on the plan tensor and its layout),
the making of the step's plan (the ctypes binding's only: the torch op checked the plan
at every call), and `small_linear` on a 576 -> 576 weight (the per-call cost, microseconds).

Both bindings run the same kernels; the engine's backend objects make their plans through
whichever `Switch.target` is at the time. One thread.
"""

from __future__ import annotations

import argparse
import os
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
from chunk_llama.ops.cpu.structs import DECODE_PLAN


def load_torch_op(csrc: Path, build_dir: Path):
    """The old torch op library (`torch.ops.chunk_llama_cpu`) built from `csrc` (81a3301's)."""
    from torch.utils import cpp_extension

    sources = [csrc / "cpu" / "tpp_cpu_torch.cpp", *(csrc / "cpu" / f"kernel_{v}.cpp" for v in compiled_variants())]
    build_dir.mkdir(parents=True, exist_ok=True)
    cpp_extension.load(name="chunk_llama_cpu_torch_op", sources=[str(s) for s in sources],
                       extra_include_paths=[str(csrc / "include")], extra_cflags=[*CPU_FLAGS],
                       extra_ldflags=["-fopenmp"], build_directory=str(build_dir), is_python_module=False)
    return torch.ops.chunk_llama_cpu


class TorchOpPlanned:
    """A step's attention through the old op: every call passes the plan, its layout (the
    list the old op took), the scratch and the scalars, and the op checks them all."""

    def __init__(self, ops, kind, index, layout, scratch, max_blocks_per_item, variant):
        self.op = ops.tpp_decode if kind == DECODE_PLAN else ops.tpp_prefill
        self.kind, self.index, self.layout, self.scratch = kind, index, list(layout), scratch
        self.items, self.variant = max_blocks_per_item, variant

    def run(self, q, k_cache, v_cache, scale, window=0, new_kv=None):
        if self.kind == DECODE_PLAN:
            return self.op(q.contiguous(), k_cache, v_cache, self.index, self.layout, self.scratch, float(scale),
                           window, self.items, self.variant)
        return self.op(q.contiguous(), k_cache, v_cache, self.index, self.layout, self.scratch, float(scale), window,
                       self.variant)


class SwitchHandle:
    """The plan handle the engine's backends hold: each step's plan is made through the
    binding `switch.target` names then (the torch op's scratch is sized by the ctypes plan,
    which checks the plan as the op would); the first decode plan and call are kept."""

    def __init__(self, switch):
        self.switch, self.handle = switch, switch.ctypes.new_plan()

    def make(self, kind, index, layout, geometry, capacity, scratch_of, variant, writes=None, row_order=None,
             max_blocks_per_item=0):
        planned = self.handle.make(kind, index, layout, geometry, capacity, scratch_of, variant, writes, row_order,
                                   max_blocks_per_item)
        if self.switch.target is not self.switch.ctypes:
            planned = TorchOpPlanned(self.switch.ops, kind, index, layout, planned._kept[1], max_blocks_per_item,
                                     variant)
        if kind == DECODE_PLAN and geometry[0] == self.switch.decode_rows and "tpp_decode" not in self.switch.first:
            args = (kind, index.clone(), list(layout), geometry, capacity, planned_scratch(planned).clone(),
                    variant, max_blocks_per_item)
            run = planned.run

            def recorded(q, k, v, scale, window=0, new_kv=None):  # copies: the buffers hold later steps' plans
                self.switch.first.setdefault("tpp_decode", (args, (q.contiguous().clone(), k, v, scale, window)))
                return run(q, k, v, scale, window, new_kv)

            planned.run = recorded
        return planned


def planned_scratch(planned):
    return planned.scratch if isinstance(planned, TorchOpPlanned) else planned._kept[1]


class Switch:
    """What the engine's backends hold as their library: plans go to `target`'s binding,
    everything else to the ctypes library; the first decode call of a step is kept, to
    replay it alone."""

    def __init__(self, ctypes_binding, ops):
        self.ctypes, self.ops, self.target = ctypes_binding, ops, ctypes_binding
        self.record(0)

    def new_plan(self):
        return SwitchHandle(self)

    def small_linear(self, x, weight, bias, isa):
        if x.shape[0] == self.decode_rows:
            self.first.setdefault("small_linear", (x, weight, bias, isa))
        if self.target is self.ctypes:
            return self.ctypes.small_linear(x, weight, bias, isa)
        return self.ops.small_linear(x, weight, bias, isa)

    def __getattr__(self, name):
        return getattr(self.ctypes, name)

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


def replay(switch: Switch, rounds: int, batch: int, calls: int) -> list[tuple[str, dict]]:
    """Per-call microseconds of the step's first decode attention call replayed alone (its plan
    made once, then called per layer, as a step does), and `small_linear`'s."""
    rows = []
    (kind, index, layout, geometry, capacity, scratch, variant, items), (q, k, v, scale, window) = \
        switch.first["tpp_decode"]
    handle = switch.ctypes.new_plan()

    def make_plan():
        return handle.make(kind, index, layout, geometry, capacity, lambda floats: scratch, variant,
                           max_blocks_per_item=items)

    made = {"ctypes": make_plan(), "torch op": TorchOpPlanned(switch.ops, kind, index, layout, scratch, items, variant)}
    rows.append((f"decode attention, per layer, batch {batch} (us)",
                 interleaved({name: (lambda c=c: c.run(q, k, v, scale, window)) for name, c in made.items()},
                             rounds, calls)))
    plan_us = interleaved({"ctypes": make_plan}, rounds, calls)["ctypes"]
    rows.append((f"making the step's plan, batch {batch} (us)", {"ctypes": plan_us, "torch op": float("nan")}))
    small = (torch.randn(batch, 576), torch.randn(576, 576), None, variant)  # a q_proj of the default model
    for x, weight, bias, isa in ([switch.first["small_linear"]] if "small_linear" in switch.first else []) + [small]:
        rows.append((f"small_linear {x.shape[0]}x{weight.shape[1]} -> {weight.shape[0]} (us)",
                     interleaved({"ctypes": lambda: switch.ctypes.small_linear(x, weight, bias, isa),
                                  "torch op": lambda: switch.ops.small_linear(x, weight, bias, isa)}, rounds, calls)))
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
    os.environ["CHUNK_LLAMA_FUSED_LAYERS"] = "0"  # (the torch op has no fused layer: both run op by op)
    spec = cpu_build()
    ctypes_binding = native.load(spec, CpuLibrary)
    if ctypes_binding is None:
        sys.exit(f"the CPU library is not available: {native.failure(spec.name)}")
    switch = native._loaded[spec.name] = Switch(ctypes_binding, load_torch_op(args.torch_op_csrc, args.build_dir))
    bindings = {"ctypes": ctypes_binding, "torch op": switch.ops}  # (what Switch.target names)

    model, _ = chunk_llama.load_default_model(dtype=torch.float32, device="cpu")
    chunk_llama.patch_model(model)
    print(f"| measurement | ctypes binding | torch op | ctypes - torch op |  (torch {torch.__version__}, 1 thread, "
          f"medians of {args.rounds} interleaved rounds)\n|---|---|---|---|", flush=True)
    for batch in args.batch:
        switch.record(batch)
        step_us = decode_steps(model, switch, bindings, batch, args.rounds)
        rows = [(f"decode step, default model, batch {batch} (ms)", {k: v / 1e3 for k, v in step_us.items()})]
        for label, values in rows + replay(switch, args.rounds, batch, args.calls):
            print(f"| {label} | {values['ctypes']:.3f} | {values['torch op']:.3f} | "
                  f"{values['ctypes'] - values['torch op']:+.3f} |", flush=True)

if __name__ == "__main__":
    main()
