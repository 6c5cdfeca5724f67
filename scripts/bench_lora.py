"""Per-request LoRA on the CPU: issue 47's targets, with the baseline in the same run.

    flock /tmp/cpu.lock .venv/bin/python scripts/bench_lora.py
    flock /tmp/cpu.lock .venv/bin/python scripts/bench_lora.py --new-tokens 32 --rounds 5

The default model with its GGUF blocks kept. 16 requests: 4 groups of 4, each group sharing
a 2,000-token system prompt of its own (a ToolQA app's prompt, then the flights manual, cut
at 2,000 tokens) and asking its own questions (ToolQA's, of that app). Rounds of two runs,
each on a fresh engine (nothing cached before it), all requests submitted at once:
  base   the 16 requests with no adapter
  lora   the same 16 requests, group g under adapter g (4 adapters: rank 16, lora_alpha 32,
         every linear target: q, k, v, o, gate, up, down; random weights, PEFT's file format)
The two runs of a round follow each other (which goes first alternates by round), so the
machine's drift (up to 20% on a shared VM) moves both alike: the figure is the median over
rounds of each round's lora / base throughput (target: >= 0.8). Printed: each run's wall time
and throughput (generated tokens / s), the prompt tokens each computed (target: 4 x 2,000
plus the questions, not 16 x 2,000); then 8 such adapters loaded into one engine: the bytes
resident against their files' (target: at most 1.1x), and the process's resident memory
before and after loading them.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time

import psutil
import torch

import chunk_llama
from chunk_llama import ChunkLlamaEngine
from chunk_llama.cli import DEFAULT_SYSTEM
from chunk_llama.hf.lora.layers import lora_linears

DATA = os.path.join(os.path.dirname(chunk_llama.__file__), "data", "toolqa")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown CPU"


def write_adapter(folder: str, model, seed: int, rank: int) -> int:
    """A random LoRA of `rank` on every linear target, as PEFT's save_pretrained writes it; its
    file's size in bytes."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, (in_features, out_features, _) in lora_linears(model).items():
        if name.rpartition(".")[2] in TARGETS:
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) / in_features ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) / rank ** 0.5 * 0.05
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS),
                   "bias": "none", "base_model_name_or_path": "SmolLM2-135M-Instruct"}, f)
    return os.path.getsize(os.path.join(folder, "adapter_model.safetensors"))


def workload(tokenizer, system_tokens: int, per_group: int) -> list[tuple[list[int], int]]:
    """(prompt ids, group) of every request: 4 groups of `per_group`."""
    systems = [json.loads(line) for line in open(os.path.join(DATA, "systems.jsonl"), encoding="utf-8")][:4]
    questions = [json.loads(line) for line in open(os.path.join(DATA, "questions.jsonl"), encoding="utf-8")]
    with open(DEFAULT_SYSTEM, encoding="utf-8") as f:
        manual = f.read()
    requests = []
    for group, system in enumerate(systems):
        ids = tokenizer(system["system_prompt"] + "\n\n" + manual + "\n\n" + manual)["input_ids"][:system_tokens]
        assert len(ids) == system_tokens, "the system text is too short"
        asked = [q["question"] for q in questions if q["app"] == system["app"]][:per_group]
        for question in asked:
            requests.append((ids + tokenizer("\n\nQuestion: " + question + "\nThought:")["input_ids"], group))
    return requests


def distinct_prefixes(prompts: list[list[int]]) -> int:
    return len({tuple(p[:n]) for p in prompts for n in range(1, len(p) + 1)})


def run(model, tokenizer, requests, new_tokens: int, adapters: dict[str, str] | None) -> dict:
    from transformers import GenerationConfig

    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=len(requests), chunk_size=64,
                              lora_modules=adapters)
    names = [f"g{group}" if adapters else None for _, group in requests]
    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    start = time.perf_counter()
    outputs = engine.generate([p for p, _ in requests], config, adapter=names)
    seconds = time.perf_counter() - start
    stats = engine.stats
    engine.close()
    generated = sum(len(o.token_ids) for o in outputs)
    return dict(seconds=seconds, tokens_per_s=generated / seconds, computed=stats["prefill_tokens_computed"],
                tokens=[o.token_ids for o in outputs])


def memory(model, tokenizer, folders: list[str], sizes: list[int]) -> dict:
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=4, chunk_size=64, kv_cache_bytes=64 << 20)
    gc.collect()
    before = psutil.Process().memory_info().rss
    for i, folder in enumerate(folders):
        engine.load_adapter(f"m{i}", folder)
    gc.collect()
    after = psutil.Process().memory_info().rss
    resident = engine.adapters.resident_bytes
    engine.close()
    return dict(files=sum(sizes), resident=resident, rss_growth=after - before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = chunk_llama.load_default_model(torch.float32)
    requests = workload(tokenizer, args.system_tokens, args.per_group)
    root = tempfile.mkdtemp(prefix="bench_lora_")
    sizes = [write_adapter(os.path.join(root, f"g{i}"), model, seed=i, rank=args.rank) for i in range(8)]
    folders = [os.path.join(root, f"g{i}") for i in range(8)]
    adapters = {f"g{i}": folders[i] for i in range(4)}
    print(f"{cpu_name()}, {torch.get_num_threads()} threads; default model, GGUF blocks kept; "
          f"{len(requests)} requests, 4 groups x {args.per_group} sharing {args.system_tokens} tokens each, "
          f"{args.new_tokens} new tokens; adapters rank {args.rank} on {', '.join(TARGETS)}")
    rounds: list[dict[str, dict]] = []
    print(f"\n{'round':6} {'base s':>8} {'lora s':>8} {'base tok/s':>11} {'lora tok/s':>11} {'lora / base':>12}")
    for number in range(args.rounds):
        results = {}
        for kind in ("base", "lora") if number % 2 == 0 else ("lora", "base"):
            results[kind] = run(model, tokenizer, requests, args.new_tokens, adapters if kind == "lora" else None)
        rounds.append(results)
        base, lora = results["base"], results["lora"]
        print(f"{number + 1:<6} {base['seconds']:8.2f} {lora['seconds']:8.2f} {base['tokens_per_s']:11.1f} "
              f"{lora['tokens_per_s']:11.1f} {lora['tokens_per_s'] / base['tokens_per_s']:12.3f}", flush=True)
    ratios = [r["lora"]["tokens_per_s"] / r["base"]["tokens_per_s"] for r in rounds]
    median = {kind: statistics.median(r[kind]["tokens_per_s"] for r in rounds) for kind in ("base", "lora")}
    print(f"median over {len(rounds)} rounds: base {median['base']:.1f} tok/s, lora {median['lora']:.1f} tok/s; "
          f"lora / base {statistics.median(ratios):.3f} (target >= 0.8; rounds {min(ratios):.3f} to "
          f"{max(ratios):.3f})")
    last = rounds[-1]
    groups = [[p for p, g in requests if g == group] for group in range(4)]
    expected = sum(distinct_prefixes(group) for group in groups)
    questions = sum(len(p) - args.system_tokens for p, _ in requests)
    print(f"prompt tokens computed: base {last['base']['computed']}, under adapters {last['lora']['computed']} = "
          f"4 x {args.system_tokens} + {last['lora']['computed'] - 4 * args.system_tokens} of the questions' "
          f"{questions} (each group's distinct prefixes: {expected}; one copy per request would be "
          f"{sum(len(p) for p, _ in requests)})")
    changed = sum(a != b for a, b in zip(last["lora"]["tokens"], last["base"]["tokens"]))
    print(f"answers the adapters changed: {changed} of {len(requests)}")
    figures = memory(model, tokenizer, folders, sizes)
    print(f"8 adapters resident: {figures['resident'] / 2**20:.1f} MiB of weights for {figures['files'] / 2**20:.1f} "
          f"MiB of files ({figures['resident'] / figures['files']:.3f}x; target <= 1.1x); the process grew "
          f"{figures['rss_growth'] / 2**20:.1f} MiB ({figures['rss_growth'] / figures['files']:.3f}x)")


if __name__ == "__main__":
    main()
