"""End-to-end: the engine vs stock padded-batch `generate` on a shared-system-prompt workload.

    python scripts/bench_e2e.py --num-requests 16 --n-shared 2000 --max-new-tokens 32

Both systems run in this process on the same model, prompts and greedy settings.
Reports wall time, throughput, KV bytes held (the engine's peak vs the stock
DynamicCache after generation) and how many requests got identical tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
from transformers import GenerationConfig

import chunk_llama
from chunk_llama import ChunkLlamaEngine
from chunk_llama.cli import DEFAULT_PROMPTS, DEFAULT_SYSTEM, read_prompts


def build_chats(tokenizer, n_shared: int, num_requests: int) -> list[list[dict]]:
    with open(DEFAULT_SYSTEM, encoding="utf-8") as f:
        text = f.read()
    ids = tokenizer(text)["input_ids"]
    while len(ids) < n_shared:  # long enough: repeat the tool manual
        ids = ids + ids
    system = tokenizer.decode(ids[:n_shared])
    questions = read_prompts(DEFAULT_PROMPTS)
    questions = [questions[i % len(questions)] + ("" if i < len(questions) else f" (case {i})") for i in range(num_requests)]
    return [[{"role": "system", "content": system}, {"role": "user", "content": q}] for q in questions]


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--n-shared", type=int, default=2000)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--skip-stock", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()

    model, tokenizer = chunk_llama.load_default_model(getattr(torch, args.dtype))
    chats = build_chats(tokenizer, args.n_shared, args.num_requests)
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False)
    results = {}

    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=args.max_batch_size)
    start = time.perf_counter()
    outputs = engine.generate(chats, config)
    elapsed = time.perf_counter() - start
    stats = engine.stats
    results["chunk_llama"] = dict(
        seconds=elapsed,
        tokens=sum(len(o.token_ids) for o in outputs),
        kv_bytes=stats["peak_kv_bytes"],
        plan_rebuilds=stats["plan_rebuilds"],
        decode_steps=stats["decode_steps"],
    )
    prompt_lens = [len(o.prompt_token_ids) for o in outputs]

    if not args.skip_stock:
        # Stock: one left-padded batch with the DynamicCache, attention masks and SDPA.
        model.set_attn_implementation("sdpa")
        tokenizer.padding_side = "left"
        texts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**batch, generation_config=config, return_dict_in_generate=True)
        stock_elapsed = time.perf_counter() - start
        width = batch["input_ids"].shape[1]
        stock_tokens = out.sequences[:, width:].tolist()
        eos = set([model.generation_config.eos_token_id] if isinstance(model.generation_config.eos_token_id, int)
                  else model.generation_config.eos_token_id or [])
        trimmed = []
        for row in stock_tokens:
            cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
            trimmed.append(row[:cut])
        results["stock_generate"] = dict(
            seconds=stock_elapsed,
            tokens=sum(len(t) for t in trimmed),
            kv_bytes=cache_bytes(out.past_key_values),
        )
        results["greedy_equal"] = sum(o.token_ids == t for o, t in zip(outputs, trimmed))

    print(f"\n{args.num_requests} requests, {args.n_shared} shared system-prompt tokens "
          f"(prompts {min(prompt_lens)}-{max(prompt_lens)} tokens), {args.max_new_tokens} new tokens, "
          f"{args.dtype}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print("| system | wall s | tokens/s | KV bytes held | vs stock |")
    print("|---|---|---|---|---|")
    base = results.get("stock_generate")
    for name in ("stock_generate", "chunk_llama"):
        if name not in results:
            continue
        r = results[name]
        ratio = f"{base['seconds'] / r['seconds']:.2f}x faster, KV {r['kv_bytes'] / base['kv_bytes']:.1%}" if base else ""
        print(f"| {name} | {r['seconds']:.1f} | {r['tokens'] / r['seconds']:.1f} | {r['kv_bytes'] / 2**20:.1f} MiB | {ratio} |")
    if "greedy_equal" in results:
        print(f"greedy tokens identical to stock padded batch: {results['greedy_equal']}/{len(outputs)}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
