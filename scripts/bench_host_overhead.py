"""Host overhead of a decode step: a tiny model whose arithmetic costs next to nothing, so a
step's time is the Python and dispatch work around the kernels (what a GPU's eager
forward is bound by), chunk-llama's step against stock's forward on the same batch.

    python scripts/bench_host_overhead.py --batch 1 32 --layers 16 --repeat 50
    python scripts/bench_host_overhead.py --family phi3      # fused qkv and gate/up projections

Tiny random Llama or Phi-3 (hidden 128, 2/1 heads of 64 dims, `--layers`), a 36-token prompt per
sequence; stock: one forward of one token per sequence on a DynamicCache (SDPA); chunk-llama:
`begin_decode`, the same forward on a ChunkCache, `end_step`. One thread; medians.
"""

from __future__ import annotations

import argparse

import torch
import transformers
from bench_decode_step import median_ms
from transformers import AutoModelForCausalLM, DynamicCache

import chunk_llama
from chunk_llama import ChunkCache


@torch.no_grad()
def run(batch: int, layers: int, repeat: int, family: str = "llama") -> tuple[float, float]:
    torch.manual_seed(0)
    config = FAMILIES[family](hidden_size=128, intermediate_size=256, num_hidden_layers=layers, num_attention_heads=2,
                              num_key_value_heads=1, vocab_size=1000, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompt = list(range(5, 41))
    model.set_attn_implementation("sdpa")
    cache = DynamicCache(config=config)
    model(input_ids=torch.tensor([prompt]), past_key_values=cache)
    cache.batch_repeat_interleave(batch)
    stock_len = [len(prompt)]

    def stock_step():
        position = torch.full((batch, 1), stock_len[0])
        stock_len[0] += 1
        model(input_ids=torch.full((batch, 1), 42), position_ids=position, past_key_values=cache, logits_to_keep=1)

    stock_ms = median_ms(stock_step, repeat)
    chunk_llama.patch_model(model)
    chunk = ChunkCache(model, kv_cache_bytes=1 << 28)
    starts = [chunk.add_sequence(i, prompt + [50 + i]) for i in range(batch)]
    input_ids, position_ids, last = chunk.begin_prefill(list(range(batch)), starts)
    model(input_ids=input_ids, position_ids=position_ids, past_key_values=chunk, logits_to_keep=last)
    chunk.end_step(completed=True)
    lengths = [len(prompt) + 1] * batch

    def chunk_step():
        order = chunk.begin_decode({i: 42 for i in range(batch)})
        position = torch.tensor([[lengths[i]] for i in order])
        for i in order:
            lengths[i] += 1
        model(input_ids=torch.full((batch, 1), 42), position_ids=position, past_key_values=chunk, logits_to_keep=1)
        chunk.end_step(completed=True)

    return stock_ms, median_ms(chunk_step, repeat)


FAMILIES = {"llama": transformers.LlamaConfig, "phi3": transformers.Phi3Config}  # head_dim 128 / 2 = 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"| batch | stock ms per step | chunk-llama ms | chunk-llama / stock |  ({args.family}, {args.layers} layers, "
          f"torch {torch.__version__}, 1 thread)\n|---|---|---|---|")
    for batch in args.batch:
        stock_ms, chunk_ms = run(batch, args.layers, args.repeat, args.family)
        print(f"| {batch} | {stock_ms:.2f} | {chunk_ms:.2f} | {chunk_ms / stock_ms:.2f}x |")


if __name__ == "__main__":
    main()
