"""`run_eval`: a prompt set through the engine, app by app, written as it goes.

Output folder: `results.jsonl` (one record per request, appended as requests
finish, so an interrupted run resumes where it stopped), `runs.jsonl` (timing and
memory of each application run), `summary.json` and `summary.md`. With several
processes (accelerate), each writes its own part files and rank 0 merges.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

import datasets
from transformers import GenerationConfig

from chunk_llama.engine import ChunkLlamaEngine
from chunk_llama.eval.ordering import shard_by_app, simulate_prefill_tokens
from chunk_llama.eval.parity import stock_generate_tokens
from chunk_llama.eval.scoring import extract_tool_call, is_correct
from chunk_llama.eval.summary import write_summary


@dataclass
class EvalConfig:
    """output_dir: where results go; check_parity: how many requests to also run
    with stock transformers `generate` and compare token for token."""

    output_dir: str
    max_new_tokens: int = 64
    check_parity: int = 0
    max_batch_size: int = 32
    kv_cache_bytes: int | None = None
    chunk_size: int = 64
    progress: bool = True


def run_eval(model, tokenizer, dataset: datasets.Dataset, config: EvalConfig, *, rank: int = 0,
             num_processes: int = 1, barrier=lambda: None) -> dict | None:
    """Evaluate `dataset` (columns app, system_prompt, question, answer, id); returns
    the summary on rank 0 (None on other ranks)."""
    os.makedirs(config.output_dir, exist_ok=True)
    rows = dataset.to_list()
    prompts = {r["id"]: prompt_ids(tokenizer, r) for r in rows}
    shared = _shared_prefix_lengths(rows, prompts)
    shards = shard_by_app([(r["id"], r["app"], len(prompts[r["id"]])) for r in rows], num_processes)
    mine = set(shards[rank])
    suffix = "" if num_processes == 1 else f".rank{rank}-of-{num_processes}"
    results_path = os.path.join(config.output_dir, f"results{suffix}.jsonl")
    runs_path = os.path.join(config.output_dir, f"runs{suffix}.jsonl")
    done = _done_ids(config.output_dir)
    todo = [r for r in rows if r["id"] in mine and r["id"] not in done]
    engine = ChunkLlamaEngine(model, tokenizer, max_batch_size=config.max_batch_size, chunk_size=config.chunk_size,
                              kv_cache_bytes=config.kv_cache_bytes)
    gen_config = GenerationConfig(max_new_tokens=config.max_new_tokens, do_sample=False)
    parity_ids = set(_spread([r["id"] for r in rows], config.check_parity)) & mine
    bar = None
    if config.progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc=f"eval[{rank}]" if num_processes > 1 else "eval", unit="req")
    with open(results_path, "a", encoding="utf-8") as results, open(runs_path, "a", encoding="utf-8") as runs:
        for app in dict.fromkeys(r["app"] for r in todo):  # grouped: an app's prefix stays resident
            app_rows = [r for r in todo if r["app"] == app]
            run = _run_app(engine, app_rows, prompts, shared, gen_config, results, bar)
            run["parity"] = _check_parity(model, [r for r in app_rows if r["id"] in parity_ids], prompts, gen_config,
                                          run.pop("outputs"))
            runs.write(json.dumps(dict(app=app, rank=rank, **run)) + "\n")
            runs.flush()
    if bar is not None:
        bar.close()
    capacity = engine.cache.pool.capacity
    engine.close()
    barrier()
    if rank != 0:
        return None
    def prefill_tokens(order: list[list[int]]) -> int:
        return sum(simulate_prefill_tokens([prompts[i] for i in ids], capacity, config.chunk_size,
                                           config.max_batch_size, config.max_new_tokens) for ids in order)

    ordering = dict(input_order=prefill_tokens(shards),  # each shard lists its ids in input order
                    grouped_order=prefill_tokens([_grouped(rows, s) for s in shards]))
    return write_summary(config.output_dir, ordering, num_processes)


def _run_app(engine, app_rows, prompts, shared, gen_config, results, bar) -> dict:
    engine.reset_peaks()
    before = engine.stats
    start = time.perf_counter()
    row_of = {engine.add_request(prompts[r["id"]], gen_config): r for r in app_rows}
    outputs = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if not delta.finished:
                continue
            row, out = row_of[delta.request_id], delta.output
            outputs[row["id"]] = out.token_ids
            record = dict(id=row["id"], app=row["app"], question=row["question"], answer=row["answer"],
                          output=out.text, tool_call=extract_tool_call(out.text), correct=is_correct(out.text, row["answer"]),
                          prompt_tokens=len(prompts[row["id"]]), shared_tokens=shared[row["app"]],
                          generated_tokens=len(out.token_ids))
            results.write(json.dumps(record) + "\n")
            results.flush()
            if bar is not None:
                bar.update(1)
    stats = engine.stats
    return dict(
        requests=len(app_rows),
        seconds=time.perf_counter() - start,
        generated_tokens=sum(len(t) for t in outputs.values()),
        peak_kv_bytes=stats["peak_kv_bytes"],
        peak_unshared_kv_bytes=stats["peak_unshared_kv_bytes"],
        prefill_tokens_reused=stats["prefill_tokens_reused"] - before["prefill_tokens_reused"],
        prefill_tokens_computed=stats["prefill_tokens_computed"] - before["prefill_tokens_computed"],
        outputs=outputs,
    )


def _check_parity(model, rows, prompts, gen_config, outputs) -> dict:
    eos = model.generation_config.eos_token_id
    equal = sum(stock_generate_tokens(model, prompts[r["id"]], gen_config, eos) == outputs[r["id"]] for r in rows)
    return dict(checked=len(rows), equal=equal)


def prompt_ids(tokenizer, row) -> list[int]:
    """The chat-templated token ids of a row: its system prompt, then its question."""
    chat = [{"role": "system", "content": row["system_prompt"]}, {"role": "user", "content": row["question"]}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _shared_prefix_lengths(rows, prompts) -> dict[str, int]:
    """Per app: the tokens all its prompts start with (what the tree shares)."""
    shared: dict[str, list[int]] = {}
    for r in rows:
        ids = prompts[r["id"]]
        prefix = shared.setdefault(r["app"], ids)
        n = next((i for i, (a, b) in enumerate(zip(prefix, ids)) if a != b), min(len(prefix), len(ids)))
        shared[r["app"]] = prefix[:n]
    return {app: len(p) for app, p in shared.items()}


def _done_ids(output_dir: str) -> set[int]:
    done = set()
    for name in os.listdir(output_dir):
        if name.startswith("results") and name.endswith(".jsonl"):
            with open(os.path.join(output_dir, name), encoding="utf-8") as f:
                done.update(json.loads(line)["id"] for line in f if line.strip())
    return done


def _spread(ids: list[int], count: int) -> list[int]:
    if count <= 0 or not ids:
        return []
    step = max(1, len(ids) // count)
    return ids[::step][:count]


def _grouped(rows, ids) -> list[int]:
    app_of = {r["id"]: r["app"] for r in rows}
    order = list(dict.fromkeys(app_of[i] for i in ids))
    return sorted(ids, key=lambda i: (order.index(app_of[i]), i))
