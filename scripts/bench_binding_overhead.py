"""Per-call cost of the CPU kernels' binding: what a decode step of the default model spends
around its kernels, call by call, with the step's plan made once in the C library
(`ops/cpu/planned.py`) and each layer's call passing that, its pool's struct and its tensors.

    python scripts/bench_binding_overhead.py                  # batch 1 and 32
    python scripts/bench_binding_overhead.py --batch 1 --rounds 21

Measures, on the default model (SmolLM2-135M, float32, 30 layers; 36-token prompts, then one
token per sequence per step), medians of `--rounds` rounds:
- a whole decode step (ms) with the fused decoder layers (the shipped path: the stack in one
  call) and with them off (`CHUNK_LLAMA_FUSED_LAYERS=0`: 30 attention calls through the
  binding, the rest op by op), as `bench_host_overhead.py` times a step;
- the step's calls replayed alone on its made plan (us per call): layer 0's attention
  (`CpuPlanned.run`), layer 0 fused (`CpuPlanned.decoder_layer`); and the making of the
  step's plan (`CpuDecode.plan`: checks, copies and schedules it in C, once per step);
- `small_linear` on a 576 -> 576 weight (a q_proj of the model).

Run it on two checkouts (each with its own build; the previous API's calls, `decode_call` and
`AttentionCall`, measured the same way) for a before/after of the binding. One thread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import chunk_llama
from chunk_llama import ChunkCache
from chunk_llama.hf.fused import describe
from chunk_llama.ops.cpu import isa
from chunk_llama.ops.cpu.attention import CpuDecode, build
from chunk_llama.step import StaticBuffers


def median_us(fn, rounds: int, calls: int) -> float:
    """Median over `rounds` of the mean time of `calls` calls, in microseconds."""
    fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


class DecodeSteps:
    """A cache with `batch` sequences prefilled, stepping them one token at a time."""

    def __init__(self, model, batch: int):
        self.model, self.batch = model, batch
        self.cache = ChunkCache(model, kv_cache_bytes=1 << 28)
        prompt = list(range(5, 41))
        starts = [self.cache.add_sequence(i, prompt + [50 + i]) for i in range(batch)]
        with torch.no_grad():
            ids, positions, last = self.cache.begin_prefill(list(range(batch)), starts)
            model(input_ids=ids, position_ids=positions, past_key_values=self.cache, logits_to_keep=last)
        self.cache.end_step(completed=True)
        self.lengths = [len(prompt) + 1] * batch

    @torch.no_grad()
    def step(self, keep_open: bool = False):
        """One decode step; `keep_open`: return its context with the step still prepared."""
        order = self.cache.begin_decode({i: 42 for i in range(self.batch)})
        position = torch.tensor([[self.lengths[i]] for i in order])
        for i in order:
            self.lengths[i] += 1
        if keep_open:
            return self.cache.step
        self.model(input_ids=torch.full((self.batch, 1), 42), position_ids=position, past_key_values=self.cache,
                   logits_to_keep=1)
        self.cache.end_step(completed=True)


def step_ms(model, batch: int, fused: bool, rounds: int) -> float:
    os.environ["CHUNK_LLAMA_FUSED_LAYERS"] = "1" if fused else "0"
    try:
        steps = DecodeSteps(model, batch)
        return median_us(steps.step, rounds, 4) / 1e3
    finally:
        os.environ.pop("CHUNK_LLAMA_FUSED_LAYERS")


def replayed(model, batch: int, rounds: int, calls: int) -> dict[str, float]:
    """A decode step's calls replayed alone on its made plan (us per call)."""
    steps = DecodeSteps(model, batch)
    step = steps.step(keep_open=True)
    layer = model.model.layers[0]
    described = describe.current(layer)
    pool, planned = step.pool, step.attention
    k, v = pool.k[0], pool.v[0]
    q = torch.randn(batch, model.config.num_attention_heads, described.head_dim)
    hidden = torch.randn(batch, described.hidden_size)
    cos, sin = torch.ones(batch, described.head_dim), torch.zeros(batch, described.head_dim)
    rows = {
        "attention call, per layer": median_us(lambda: planned.run(q, k, v, described.scale), rounds, calls),
        "fused layer call, per layer": median_us(
            lambda: planned.decoder_layer(described.struct, hidden, cos, sin, k, v, described.scale,
                                          described.window), rounds, calls),
    }
    # (another backend's handle: planning it again and again leaves this step's calls valid)
    decode = CpuDecode(StaticBuffers("cpu"), model.config.num_attention_heads, pool.num_kv_heads, pool.head_dim,
                       pool.chunk_size)
    writes, order = step.writes.slots, step.row_order
    rows["making the step's plan, per step"] = median_us(
        lambda: decode.plan(step.decode, pool.capacity, writes, order), rounds, calls)
    steps.cache.end_step(completed=False)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--calls", type=int, default=500, help="calls per round when a call is replayed alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if build() is None:
        raise SystemExit("the CPU library is not available")
    model, _ = chunk_llama.load_default_model(dtype=torch.float32, device="cpu")
    chunk_llama.patch_model(model)
    print(f"| measurement | value |  (torch {torch.__version__}, 1 thread, medians of {args.rounds} rounds)\n"
          "|---|---|", flush=True)
    for batch in args.batch:
        rows = {"decode step, fused layers (ms)": step_ms(model, batch, True, args.rounds),
                "decode step, op by op (ms)": step_ms(model, batch, False, args.rounds)}
        rows.update({f"{name} (us)": us for name, us in replayed(model, batch, args.rounds, args.calls).items()})
        small = (torch.randn(batch, 576), torch.randn(576, 576))
        linear = build().small_linear_call(isa.selected_variant())
        rows["small_linear 576 -> 576 (us)"] = median_us(lambda: linear(*small, None), args.rounds, args.calls)
        for name, value in rows.items():
            print(f"| batch {batch}: {name} | {value:.3f} |", flush=True)


if __name__ == "__main__":
    main()
