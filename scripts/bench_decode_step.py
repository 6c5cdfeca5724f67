"""One decode step of the default model: 32 sequences sharing a long prompt vs an empty context.

    python scripts/bench_decode_step.py --batch 32 --n-shared 2000 --repeat 5
    python scripts/bench_decode_step.py --device cuda --dtype bfloat16 --geometry llama-3.2-1b --repeat 20
    python scripts/bench_decode_step.py --n-shared 0 --n-private 2000 --kv-dtype bfloat16   # + a bf16 pool

Times a whole model forward of one token per sequence (all layers, attention
included) for: stock transformers with a DynamicCache holding every sequence's
copy of the context, and with a StaticCache (on CUDA also under
`torch.compile(mode="reduce-overhead", fullgraph=True)`: CUDA graphs, what an HF user
would pick; its compile time printed); chunk-llama through the PyTorch reference;
chunk-llama through the native kernel (and with `--kv-dtype bfloat16`, the same with a
bfloat16 pool; on CUDA also replayed from the engine's CUDA graphs, `engine/graphs.py`);
and chunk-llama with an (almost) empty context, the floor that attention cannot go
below. A chunk-llama step is the engine's: its inputs from the step's buffers, committed
after the forward. All in one process, medians of --repeat.
`--geometry` runs random weights of a real model's shapes (scripts/e2e_systems.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from e2e_systems import GEOMETRIES, random_weight_model
from transformers import DynamicCache, StaticCache

import chunk_llama
from chunk_llama import ChunkCache
from chunk_llama.engine.graphs import DecodeGraphs
from chunk_llama.gguf.weights import gguf_blocks
from chunk_llama.hf.compat import cache_argument
from chunk_llama.ops import prepare_backend


def median_ms(fn, repeat):
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


@torch.no_grad()
def chunk_step_ms(model, prompts, repeat, force_reference, kv_dtype=None, graphs=False):
    """A decode step as the engine runs it (inputs from the step's buffers, the step committed);
    `graphs`: replayed from CUDA graphs captured for this batch (`DecodeGraphs`)."""
    cache = ChunkCache(model, kv_cache_bytes=4 << 30, kv_dtype=kv_dtype)
    starts = [cache.add_sequence(i, p) for i, p in enumerate(prompts)]
    input_ids, position_ids, last = cache.begin_prefill(list(range(len(prompts))), starts)
    model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, logits_to_keep=last)
    cache.end_step(True)
    lengths = [len(p) for p in prompts]
    if force_reference:
        os.environ["CHUNK_LLAMA_FORCE_REFERENCE"] = "1"
    replay = None
    if graphs:
        replay = DecodeGraphs(model, len(prompts), sizes=[len(prompts)])
        figures = replay.warm_up()
        print(f"CUDA graphs captured in {figures['seconds']:.1f} s, {figures['memory_bytes'] / 2**20:.0f} MiB")

    def step():
        cache.begin_decode({i: 42 for i in range(len(prompts))}, {i: lengths[i] for i in range(len(prompts))})
        step = cache.step
        if replay is None or replay.run(step) is None:
            model(input_ids=step.input_ids, position_ids=step.position_ids, past_key_values=cache, logits_to_keep=1)
        cache.end_step(True)
        for i in range(len(lengths)):
            lengths[i] += 1

    try:
        return median_ms(step, repeat)
    finally:
        os.environ.pop("CHUNK_LLAMA_FORCE_REFERENCE", None)


@torch.no_grad()
def stock_step_ms(model, prompt, batch, repeat):
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([prompt], device=model.device), past_key_values=cache)
    cache.batch_repeat_interleave(batch)  # every sequence holds its own copy, as stock does
    length = [len(prompt)]

    def step():
        ids = torch.full((batch, 1), 42, device=model.device)
        pos = torch.full((batch, 1), length[0], device=model.device)
        length[0] += 1
        model(input_ids=ids, position_ids=pos, past_key_values=cache, logits_to_keep=1)

    ms = median_ms(step, repeat)
    chunk_llama.patch_model(model)
    return ms


@torch.no_grad()
def stock_static_step_ms(model, prompt, batch, repeat, compiled):
    """Stock transformers on a StaticCache (every sequence its own copy of the context); `compiled`:
    under torch.compile(mode="reduce-overhead", fullgraph=True), CUDA graphs (compile time printed)."""
    model.set_attn_implementation("sdpa")
    length, device = len(prompt), model.device
    cache = StaticCache(config=model.config, max_cache_len=length + repeat + 8)  # (it counts its own positions)
    cache_kwarg = {cache_argument(model): cache}
    model(input_ids=torch.tensor([prompt] * batch, device=device), logits_to_keep=1, **cache_kwarg)
    forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True) if compiled else model.forward
    position = [length]

    def step():
        p = position[0]
        position[0] += 1
        if compiled:
            torch.compiler.cudagraph_mark_step_begin()
        forward(input_ids=torch.full((batch, 1), 42, device=device),
                position_ids=torch.full((batch, 1), p, device=device), logits_to_keep=1, **cache_kwarg)

    if compiled:
        start = time.perf_counter()
        for _ in range(3):  # (compiles, warms up, records)
            step()
        torch.cuda.synchronize()
        print(f"stock StaticCache compiled (reduce-overhead, fullgraph) in {time.perf_counter() - start:.1f} s")
    ms = median_ms(step, repeat)
    chunk_llama.patch_model(model)
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--n-shared", type=int, default=2000)
    parser.add_argument("--n-private", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES), help="random weights of this model's shapes")
    parser.add_argument("--kv-dtype", help="also the native kernel with the pool in this dtype (bfloat16)")
    parser.add_argument("--graphs", action=argparse.BooleanOptionalAction, default=None,
                        help="the CUDA-graph rows: stock StaticCache under torch.compile(mode='reduce-overhead') "
                             "and chunk-llama's captured step (default: on CUDA)")
    args = parser.parse_args()
    graphs = args.graphs if args.graphs is not None else args.device.startswith("cuda")
    if graphs and not args.device.startswith("cuda"):
        parser.error("--graphs needs --device cuda")
    dtype = getattr(torch, args.dtype)
    if args.geometry:
        model = random_weight_model(args.geometry, dtype, args.device, seed=0)
    else:
        model = chunk_llama.load_default_model(dtype)[0].to(args.device)
    chunk_llama.patch_model(model)
    torch.manual_seed(0)
    shared = torch.randint(100, 40000, (args.n_shared,)).tolist()
    prompts = [shared + torch.randint(100, 40000, (args.n_private,)).tolist() for _ in range(args.batch)]
    empty = [torch.randint(100, 40000, (args.n_private,)).tolist() for _ in range(args.batch)]
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    info = prepare_backend(model.device, dtype, head_dim, 64)  # builds before any timing
    backend = f"{info['backend']} ({info['isa']})" if info["isa"] else info["backend"]
    rows = {
        "stock DynamicCache, shared context": stock_step_ms(model, prompts[0], args.batch, args.repeat),
        "stock StaticCache, shared context": stock_static_step_ms(model, prompts[0], args.batch, args.repeat, False),
    }
    if graphs:
        rows["stock StaticCache + CUDA graphs (torch.compile reduce-overhead), shared context"] = \
            stock_static_step_ms(model, prompts[0], args.batch, args.repeat, True)
    rows.update({
        "chunk-llama reference, shared context": chunk_step_ms(model, prompts, args.repeat, True),
        f"chunk-llama {backend}, shared context": chunk_step_ms(model, prompts, args.repeat, False),
        f"chunk-llama {backend}, empty context": chunk_step_ms(model, empty, args.repeat, False),
    })
    if graphs:
        rows[f"chunk-llama {backend} + CUDA graphs, shared context"] = chunk_step_ms(model, prompts, args.repeat,
                                                                                     False, graphs=True)
        rows[f"chunk-llama {backend} + CUDA graphs, empty context"] = chunk_step_ms(model, empty, args.repeat, False,
                                                                                    graphs=True)
    if args.kv_dtype:
        rows[f"chunk-llama {backend}, {args.kv_dtype} K/V, shared context"] = chunk_step_ms(
            model, prompts, args.repeat, False, args.kv_dtype)
    floor = rows[f"chunk-llama {backend}, empty context"]
    machine = torch.cuda.get_device_name() if model.device.type == "cuda" else f"{torch.get_num_threads()} threads"
    # every system runs the same weights: the default model's GGUF blocks where they run (not stock's float32)
    blocks = ", ".join(f"{n} {t}" for t, n in sorted(gguf_blocks(model).items())) or "none"
    print(f"\ndecode step, {args.geometry or 'default model'}, b={args.batch}, {args.n_shared} shared + "
          f"{args.n_private} own tokens, {args.dtype}, GGUF blocks: {blocks}, torch {torch.__version__}, {machine}")
    print("| system | ms per step | vs empty context |\n|---|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.1f} | {ms / floor:.2f}x |")


if __name__ == "__main__":
    main()
