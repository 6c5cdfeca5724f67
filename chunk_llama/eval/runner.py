"""`run_eval`: a prompt set through the engine, app by app, written as it goes and resumable.

Each process takes its shard (`shard_by_app`), skips the ids that a results file
in the output folder already holds, and runs the rest app by app (an app's
prefix stays resident), appending each finished request to its results journal
at once and each application run to its runs journal (see `records.py`). A crash
loses at most the line being written; running the same command again resumes.

Several processes (accelerate): each appends to its own journals during the run,
because that is what survives a crash. At the end each rank reads its journals
back (this run's records and those of an earlier stopped run with the same number
of processes) and `accelerate.utils.gather_object` brings them to rank 0, which
adds the files no rank of this run owns (the merged files of earlier runs, the
journals of a stopped run with another number of processes), writes the merged
`results.jsonl` (sorted by id: any number of processes gives the same file),
`runs.jsonl` and the summary. Only then (after a barrier) are the journals
deleted, so a crash at any moment leaves every record in some file, and the merge
drops the copies that a crash between the two steps leaves. No rank reads another
live rank's journal except to learn which ids are done. One process needs no
torch.distributed: its journals are the merged files.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import datasets
from accelerate.utils import gather_object
from transformers import GenerationConfig

from chunk_llama.eval.constrained import action_grammar
from chunk_llama.eval.data import prompt_ids, shared_prefix_lengths
from chunk_llama.eval.ordering import compare_orders, shard_by_app
from chunk_llama.eval.parity import count_equal, parity_sample
from chunk_llama.eval.records import (
    REQUIRED_FIELDS,
    STEMS,
    append_record,
    existing_files,
    journal_path,
    merge_results,
    merge_runs,
    read_jsonl,
    repair,
    write_jsonl,
)
from chunk_llama.eval.scoring import extract_tool_call, is_correct
from chunk_llama.eval.summary import summarize, write_summary
from chunk_llama.settings import EngineArgs

__all__ = ["EvalConfig", "run_eval", "prompt_ids"]


@dataclass
class EvalConfig:
    """output_dir: where results go; check_parity: how many requests to also run
    with stock transformers `generate` and compare token for token; engine: the
    engine's options (its model, device and dtype fields are the caller's business)."""

    output_dir: str
    max_new_tokens: int = 64
    check_parity: int = 0
    engine: EngineArgs = field(default_factory=EngineArgs)
    progress: bool = True
    constrained: bool = False

    def __post_init__(self):
        if self.constrained and self.check_parity:
            raise ValueError("--check-parity compares with stock generate, which decodes without a grammar: "
                             "run it without --constrained")


def run_eval(model, tokenizer, dataset: datasets.Dataset, config: EvalConfig, *, rank: int = 0,
             num_processes: int = 1, barrier: Callable[[], None] = lambda: None,
             gather: Callable[[list], list] = gather_object) -> dict | None:
    """Evaluate `dataset` (columns app, system_prompt, question, answer, id); returns
    the summary on rank 0 (None on other ranks).

    barrier: waits for every process (accelerate's `PartialState.wait_for_everyone`).
    gather: given this rank's one-item list, returns every rank's items in rank
    order (accelerate's `gather_object`); not called with one process.
    """
    if not 0 <= rank < num_processes:
        raise ValueError(f"rank must be in [0, {num_processes}), got {rank}")
    output_dir = config.output_dir
    os.makedirs(output_dir, exist_ok=True)
    rows = dataset.to_list()
    prompts = {r["id"]: prompt_ids(tokenizer, r) for r in rows}
    shared = shared_prefix_lengths(rows, prompts)
    shards = shard_by_app([(r["id"], r["app"], len(prompts[r["id"]])) for r in rows], num_processes)
    journals = {stem: journal_path(output_dir, stem, rank, num_processes) for stem in STEMS}
    owned = {journal_path(output_dir, stem, r, num_processes) for stem in STEMS for r in range(num_processes)}
    for path in journals.values():
        repair(path)
    if rank == 0:  # files of earlier runs that no rank of this one appends to
        for path in [p for stem in STEMS for p in existing_files(output_dir, stem) if p not in owned]:
            repair(path)
    done = _done_ids(output_dir, config.constrained)
    mine = set(shards[rank])
    todo = [r for r in rows if r["id"] in mine and r["id"] not in done]
    engine = config.engine.build_engine(model, tokenizer)
    gen_config = GenerationConfig(max_new_tokens=config.max_new_tokens, do_sample=False)
    parity_ids = set(parity_sample([r["id"] for r in rows], config.check_parity))
    bar = None
    if config.progress and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(todo), desc=f"eval[{rank}]" if num_processes > 1 else "eval", unit="req")
    with open(journals["results"], "a", encoding="utf-8") as results, \
            open(journals["runs"], "a", encoding="utf-8") as runs:
        for app in dict.fromkeys(r["app"] for r in todo):  # grouped: an app's prefix stays resident
            app_rows = [r for r in todo if r["app"] == app]
            grammar = action_grammar(app_rows[0]["system_prompt"], app) if config.constrained else None
            run, outputs = _run_app(engine, app_rows, prompts, shared, gen_config, results, bar, grammar)
            sample = [r["id"] for r in app_rows if r["id"] in parity_ids]
            run["parity"] = count_equal(model, [prompts[i] for i in sample], [outputs[i] for i in sample],
                                        gen_config)
            append_record(runs, dict(app=app, rank=rank, num_processes=num_processes,
                                     constrained=config.constrained, **run))
    if bar is not None:
        bar.close()
    capacity = engine.cache.pool.capacity
    engine.close()
    part = {stem: read_jsonl(path, required=REQUIRED_FIELDS[stem]) for stem, path in journals.items()}
    parts = [part] if num_processes == 1 else gather([part])
    summary = None
    if rank == 0:
        merged = _merge(output_dir, parts, owned)
        ordering = compare_orders(shards, {r["id"]: r["app"] for r in rows}, prompts, capacity=capacity,
                                  chunk_size=config.engine.chunk_size, max_batch_size=config.engine.max_batch_size,
                                  max_new_tokens=config.max_new_tokens)
        summary = summarize(merged["results"], merged["runs"], ordering, num_processes)
        write_summary(output_dir, summary)
    barrier()  # the merged files are written: the journals are no longer the only copy
    if num_processes > 1:
        for path in journals.values():
            os.remove(path)
    return summary


def _run_app(engine, app_rows, prompts, shared, gen_config, results, bar, grammar=None) -> tuple[dict, dict]:
    """One app's requests through the engine (each under `grammar`, if given); the run's record
    and each request's tokens."""
    engine.reset_peaks()
    before = engine.stats
    started_at = time.time()  # wall clock: comparable across processes, for the summary's wall time
    start = time.perf_counter()
    row_of = {engine.add_request(prompts[r["id"]], gen_config, grammar=grammar): r for r in app_rows}
    outputs = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if not delta.finished:
                continue
            row, out = row_of[delta.request_id], delta.output
            outputs[row["id"]] = out.token_ids
            append_record(results, dict(
                id=row["id"], app=row["app"], question=row["question"], answer=row["answer"], output=out.text,
                tool_call=extract_tool_call(out.text), correct=is_correct(out.text, row["answer"]),
                prompt_tokens=len(prompts[row["id"]]), shared_tokens=shared[row["app"]],
                generated_tokens=len(out.token_ids), constrained=grammar is not None))
            if bar is not None:
                bar.update(1)
    stats = engine.stats
    run = dict(
        requests=len(app_rows),
        started_at=started_at,
        seconds=time.perf_counter() - start,
        generated_tokens=sum(len(t) for t in outputs.values()),
        peak_kv_bytes=stats["peak_kv_bytes"],
        peak_unshared_kv_bytes=stats["peak_unshared_kv_bytes"],
        prefill_tokens_reused=stats["prefill_tokens_reused"] - before["prefill_tokens_reused"],
        prefill_tokens_computed=stats["prefill_tokens_computed"] - before["prefill_tokens_computed"],
    )
    return run, outputs


def _done_ids(output_dir: str, constrained: bool) -> set[int]:
    """Ids any results file holds. Another rank may be appending to its journal right
    now, so a torn last line is skipped here (its id is that rank's, not ours). Results
    decoded the other way (with or without --constrained) are a ValueError: a folder holds one."""
    records = [r for path in existing_files(output_dir, "results")
               for r in read_jsonl(path, required=REQUIRED_FIELDS["results"], allow_torn_tail=True)]
    mixed = [r["id"] for r in records if bool(r.get("constrained", False)) != constrained]
    if mixed:
        raise ValueError(f"{output_dir} holds results decoded {'without' if constrained else 'with'} "
                         f"--constrained (ids {mixed[:5]}...): use another output folder")
    return {r["id"] for r in records}


def _merge(output_dir: str, parts: list[dict], owned: set[str]) -> dict[str, list[dict]]:
    """Rank 0: the gathered journals plus the files no rank of this run owns, written
    as the merged files; those other files are then deleted (their records are in)."""
    merged = {}
    for stem in STEMS:
        merged_path = os.path.join(output_dir, f"{stem}.jsonl")
        earlier = [p for p in existing_files(output_dir, stem) if p not in owned]
        records = [r for p in earlier for r in read_jsonl(p, required=REQUIRED_FIELDS[stem])]
        records += [r for part in parts for r in part[stem]]
        merged[stem] = merge_results(records) if stem == "results" else merge_runs(records)
        write_jsonl(merged_path, merged[stem])
        for path in earlier:
            if path != merged_path:
                os.remove(path)
    return merged
