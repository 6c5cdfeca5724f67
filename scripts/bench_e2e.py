"""End-to-end serving benchmark (the paper's Table 4 and Figure 5 at CPU scale).

    python scripts/bench_e2e.py --num-requests 16 --n-shared 2000 --max-new-tokens 32 --rps inf
    python scripts/bench_e2e.py --rps 0.1 0.25 inf --systems engine stock cb_share --out docs/bench
    python scripts/bench_e2e.py --n-shared 0 --n-prompt 512 --systems engine cb_share cb_noshare
    python scripts/bench_e2e.py --prompt-set toolqa --limit 10 --systems engine cb_share
    python scripts/bench_e2e.py --n-shared 0 --n-prompt 2000 --num-requests 32 --systems engine \
        --kv-dtype auto bfloat16      # float32 and bfloat16 K/V, one after the other
    python scripts/bench_e2e.py --device cuda --dtype bfloat16 --geometry llama-3.2-1b \
        --num-requests 32 --n-shared 2000 --max-new-tokens 64

Workload: `--num-requests` requests whose prompts share `--n-shared` tokens of a
system prompt (the shipped tool manual) and then differ: a short chat question
each by default, or a unique tail up to `--n-prompt` tokens. They arrive by a
Poisson process at each `--rps` (`inf`: all at once). `--geometry` runs a model of a
real model's shape with random weights instead of the default model's file (speed does
not depend on the weights' values; parity is still checked on the same weights), on
random token ids: the shared prefix, then 24 unique tokens per request. Systems, all on the same
model, prompts and greedy settings in this process:
  engine      this library's engine (online API); `engine kv=bfloat16` with `--kv-dtype` (a
              float32 model's K/V stored in bfloat16); on a GPU its decode steps replay CUDA graphs
  engine_eager  the engine with every decode step eager (`enforce_eager`; on a CPU the same as
              engine), only when named
  stock       stock `model.generate` on static left-padded batches
  cb_share    transformers continuous batching (`generate_batch`'s manager), block sharing on
  cb_noshare  the same with block sharing off
Metrics: normalized latency (mean of end-to-end latency / generated tokens, queueing
included), throughput, TTFT p50/p99, peak KV bytes and batch size, and how many
requests' greedy tokens equal stock per-request `generate`. With all requests at once,
the engine's time to every first token is also given against one stock forward over
the longest prompt (what `generate` runs before its first token), timed in this process.
"""

from __future__ import annotations

import argparse
import copy
import csv
import datetime
import json
import math
import os
import platform
import random
import statistics
import time

import torch
from e2e_systems import (
    GEOMETRIES,
    greedy_config,
    per_request_reference,
    random_prompts,
    random_weight_model,
    run_engine,
    run_generate_batch,
    run_stock,
)

import chunk_llama
from chunk_llama.cli import DEFAULT_PROMPTS, DEFAULT_SYSTEM, read_prompts

SYSTEMS = ("engine", "engine_eager", "stock", "cb_share", "cb_noshare")
def build_prompts(tokenizer, n_shared: int, n_prompt: int | None, num_requests: int) -> list[list[int]]:
    with open(DEFAULT_SYSTEM, encoding="utf-8") as f:
        manual = tokenizer(f.read())["input_ids"]
    while len(manual) < max(n_shared, n_prompt or 0) + 64 * num_requests:
        manual = manual + manual
    system = tokenizer.decode(manual[:n_shared])
    questions = read_prompts(DEFAULT_PROMPTS)
    prompts = []
    for i in range(num_requests):
        question = questions[i % len(questions)] + ("" if i < len(questions) else f" (case {i})")
        if n_prompt is None:  # a chat: system prompt, then a short question
            chat = [{"role": "system", "content": system}, {"role": "user", "content": question}]
            text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
        else:  # shared tokens, then a unique tail: the request number, then text from its own offset
            tail = tokenizer(f"Request {i}: ")["input_ids"] + manual[n_shared + 61 * i :]
            prompts.append(manual[:n_shared] + tail[: n_prompt - n_shared])
    return prompts


def poisson_arrivals(rps: float, num: int, seed: int) -> list[float]:
    if math.isinf(rps):
        return [0.0] * num
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(num):
        out.append(t)
        t += rng.expovariate(rps)
    return out


def summarize(records, extra, reference) -> dict:
    tokens = [len(r["tokens"]) for r in records]
    latency = [(r["finish"] - r["arrival"]) / max(1, n) for r, n in zip(records, tokens)]
    ttft = sorted(r["first_token"] - r["arrival"] for r in records if r.get("first_token"))
    span = max(r["finish"] for r in records) - min(r["arrival"] for r in records)
    return dict(
        norm_latency_s=statistics.mean(latency),
        throughput_tok_s=sum(tokens) / span,
        wall_s=span,
        ttft_p50_s=ttft[len(ttft) // 2] if ttft else None,
        ttft_p99_s=ttft[min(len(ttft) - 1, math.ceil(0.99 * len(ttft)) - 1)] if ttft else None,
        greedy_equal=sum(r["tokens"] == ref for r, ref in zip(records, reference)) if reference else None,
        num_requests=len(records),
        **extra,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--n-shared", type=int, default=2000)
    parser.add_argument("--n-prompt", type=int, default=None, help="total prompt tokens (default: chat + question)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--prompt-set", help="use a prompt set instead (e.g. toolqa; see chunk-llama eval)")
    parser.add_argument("--limit", type=int, help="with --prompt-set: questions per application")
    parser.add_argument("--rps", type=float, nargs="+", default=[math.inf])
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS,
                        default=[s for s in SYSTEMS if s != "engine_eager"])
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--chunk-size", type=int, default=64, help="the engine's chunk size")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-dtype", nargs="+", default=["auto"],
                        help="the engine's kv_dtype, one engine system per value (auto: `engine`, else "
                             "`engine kv=VALUE`), each run in turn")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--geometry", choices=sorted(GEOMETRIES),
                        help="random weights of this model's shapes instead of the default model's file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-parity", action="store_true", help="skip the per-request stock reference")
    parser.add_argument("--out", help="folder for NAME.md, NAME.csv and NAME.png")
    parser.add_argument("--name", default="e2e")
    parser.add_argument("--json")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    if args.geometry:
        model, tokenizer = random_weight_model(args.geometry, dtype, args.device, args.seed), None
    else:
        # the baselines run transformers' own float32 load of the file; the engine what load_model
        # gives (the GGUF blocks where they run: a CPU in float32)
        model, tokenizer = chunk_llama.load_model(None, device=args.device, dtype=dtype, gguf_weights="dequantized")
    model.set_attn_implementation("sdpa")
    engine_model = (copy.deepcopy(model) if args.geometry else  # patched by the engine; the others run stock
                    chunk_llama.load_model(None, device=args.device, dtype=dtype)[0])
    if args.geometry:
        if args.prompt_set or args.n_prompt:
            parser.error("--geometry runs random token ids: no --prompt-set or --n-prompt")
        prompts = random_prompts(model.config.vocab_size, args.n_shared, args.num_requests, args.seed)
    elif args.prompt_set:
        from chunk_llama.eval import load_prompt_set
        from chunk_llama.eval.runner import prompt_ids

        dataset = load_prompt_set(args.prompt_set, limit=args.limit)
        prompts = [prompt_ids(tokenizer, row) for row in dataset]
        args.n_shared = f"prompt set {args.prompt_set!r},"
    else:
        prompts = build_prompts(tokenizer, args.n_shared, args.n_prompt, args.num_requests)
    config = greedy_config(model, args.max_new_tokens)
    reference = None if args.no_parity else per_request_reference(model, prompts, config)
    engines = {"engine" if kv == "auto" else f"engine kv={kv}": kv for kv in args.kv_dtype}
    runners = dict(
        **{name: lambda arr, kv=kv: run_engine(engine_model, prompts, arr, config, args.max_batch_size,
                                               args.chunk_size, kv) for name, kv in engines.items()},
        engine_eager=lambda arr: run_engine(engine_model, prompts, arr, config, args.max_batch_size, args.chunk_size,
                                            enforce_eager=True),
        stock=lambda arr: run_stock(model, prompts, arr, config, args.max_batch_size),
        cb_share=lambda arr: run_generate_batch(model, prompts, arr, config, block_sharing=True),
        cb_noshare=lambda arr: run_generate_batch(model, prompts, arr, config, block_sharing=False),
    )
    small = greedy_config(model, 2)  # warm-up: first-call costs (allocation, thread start) out of the timings
    warm = dict(**{name: lambda kv=kv: run_engine(engine_model, prompts[:2], [0, 0], small, kv_dtype=kv)
                   for name, kv in engines.items()},
                engine_eager=lambda: run_engine(engine_model, prompts[:2], [0, 0], small, enforce_eager=True),
                stock=lambda: run_stock(model, prompts[:2], [0, 0], small),
                cb_share=lambda: run_generate_batch(model, prompts[:2], [0, 0], small, True),
                cb_noshare=lambda: run_generate_batch(model, prompts[:2], [0, 0], small, False))
    systems = [s for system in args.systems for s in (engines if system == "engine" else [system])]
    for system in systems:
        warm[system]()
    rows = []
    for rps in args.rps:
        arrivals = poisson_arrivals(rps, len(prompts), args.seed)
        for system in systems:
            records, extra = runners[system](arrivals)
            row = dict(system=system, rps=rps, **summarize(records, extra, reference))
            rows.append(row)
            print(json.dumps(row), flush=True)

    lengths = [len(p) for p in prompts]
    shared = args.n_shared if isinstance(args.n_shared, str) else f"{args.n_shared} shared tokens,"
    model_name = f"{args.geometry} geometry, random weights" if args.geometry else "SmolLM2-135M-Instruct"
    machine = (torch.cuda.get_device_name() if args.device.startswith("cuda")
               else f"{os.cpu_count()} CPUs ({platform.machine()})")
    header = (f"{len(prompts)} requests, {shared} prompts {min(lengths)}-{max(lengths)} tokens, "
              f"{args.max_new_tokens} new tokens, {args.dtype}, {model_name}, torch {torch.__version__}, "
              f"{machine}, {datetime.date.today()}")
    table = render_table(rows, header)
    engine_all_at_once = [r for r in rows if r["system"].startswith("engine") and math.isinf(r["rps"])]
    if engine_all_at_once and args.n_shared:  # the shared-prefix workload's yardstick
        forward_s = stock_forward_seconds(model, max(prompts, key=len))
        every_first = max(r["ttft_p99_s"] for r in engine_all_at_once)
        table += (f"\n\nTime to every first token (engine, all at once): {every_first:.2f} s = "
                  f"{every_first / forward_s:.2f}x one stock forward over the longest prompt ({forward_s:.2f} s, "
                  f"best of 3)")
        for row in engine_all_at_once:
            row["stock_forward_s"] = forward_s
    print("\n" + table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        stem = os.path.join(args.out, args.name)
        with open(stem + ".md", "w") as f:
            f.write(table + "\n")
        with open(stem + ".csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        plot(rows, stem + ".png", header)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


def stock_forward_seconds(model, prompt: list[int], repeat: int = 3) -> float:
    """One stock forward over `prompt` with a fresh `DynamicCache`, the last token's logits only."""
    from transformers import DynamicCache

    times = []
    with torch.no_grad():
        for _ in range(repeat):
            start = time.perf_counter()
            model(input_ids=torch.tensor([prompt], device=model.device), past_key_values=DynamicCache(config=model.config),
                  logits_to_keep=1)
            if model.device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    return min(times)


def render_table(rows, header) -> str:
    lines = [header, "", "| RPS | system | norm. latency s/tok | throughput tok/s | TTFT p50 s | TTFT p99 s | "
             "peak KV MiB | peak batch | greedy = stock | vs engine (throughput) |", "|" + "---|" * 10]
    for row in rows:
        engine = next((r for r in rows if r["rps"] == row["rps"] and r["system"] == "engine"), None)
        ratio = f"{engine['throughput_tok_s'] / row['throughput_tok_s']:.2f}x" if engine else ""
        fmt = lambda v, spec: "n/a" if v is None else format(v, spec)  # noqa: E731
        kv = None if row["peak_kv_bytes"] is None else row["peak_kv_bytes"] / 2**20
        equal = "n/a" if row["greedy_equal"] is None else f"{row['greedy_equal']}/{row['num_requests']}"
        lines.append(f"| {row['rps']:g} | {row['system']} | {row['norm_latency_s']:.3f} | {row['throughput_tok_s']:.2f} | "
                     f"{fmt(row['ttft_p50_s'], '.2f')} | {fmt(row['ttft_p99_s'], '.2f')} | {fmt(kv, '.1f')} | "
                     f"{fmt(row['peak_batch_size'], 'd')} | {equal} | {ratio} |")
    return "\n".join(lines)


def plot(rows, path, title) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r for r in rows if not math.isinf(r["rps"])]
    if not finite:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for system in dict.fromkeys(r["system"] for r in finite):
        pts = sorted((r["rps"], r["norm_latency_s"]) for r in finite if r["system"] == system)
        ax.plot(*zip(*pts), marker="o", label=system)
    ax.set_xlabel("request rate (requests/s, Poisson)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_yscale("log")
    ax.set_title(title[:90], fontsize=7)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
