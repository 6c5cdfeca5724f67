"""Prompt sets as `datasets.Dataset`s with columns app, system_prompt, question, answer,
and their rows as chat-templated token ids.

The shipped set (`toolqa`) is four ToolQA-style applications written for this
project (`scripts/make_prompt_sets.py`): each a long system prompt of tool
definitions, rules and few-shot examples, and 60 questions whose gold answer is
the first tool call. A user's set can be a JSONL, JSON, CSV or Parquet file or a
folder saved with `Dataset.save_to_disk`.
"""

from __future__ import annotations

import json
import os

import datasets

REQUIRED_COLUMNS = ("app", "system_prompt", "question", "answer")
BUILTIN_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "toolqa")
_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def load_prompt_set(source: str | None = None, *, apps: list[str] | None = None, limit: int | None = None) -> datasets.Dataset:
    """Load a prompt set, adding an `id` column (the row's position in the source).

    source: None or "toolqa" for the shipped set, else a file or a saved-dataset folder.
    apps: keep only these applications (an unknown name is an error).
    limit: keep at most this many questions per application, in source order.
    """
    if source in (None, "toolqa"):
        dataset = _builtin()
    elif os.path.isdir(source):
        dataset = datasets.load_from_disk(source)
    elif os.path.isfile(source):
        ext = os.path.splitext(source)[1].lower()
        if ext not in _FORMATS:
            raise ValueError(f"{source}: unsupported format {ext!r}; use one of {sorted(_FORMATS)} or a dataset folder")
        dataset = datasets.load_dataset(_FORMATS[ext], data_files=source, split="train")
    else:
        raise ValueError(f"prompt set {source!r} is neither 'toolqa' nor an existing file or folder")
    missing = [c for c in REQUIRED_COLUMNS if c not in dataset.column_names]
    if missing:
        raise ValueError(f"prompt set {source or 'toolqa'} lacks column(s) {missing}; it needs {list(REQUIRED_COLUMNS)}")
    dataset = dataset.add_column("id", list(range(len(dataset)))) if "id" not in dataset.column_names else dataset
    if apps:
        known = set(dataset["app"])
        unknown = sorted(set(apps) - known)
        if unknown:
            raise ValueError(f"unknown app(s) {unknown}; this set has {sorted(known)}")
        dataset = dataset.filter(lambda row: row["app"] in set(apps))
    if limit is not None:
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit}")
        seen: dict[str, int] = {}
        keep = []
        for i, app in enumerate(dataset["app"]):
            seen[app] = seen.get(app, 0) + 1
            if seen[app] <= limit:
                keep.append(i)
        dataset = dataset.select(keep)
    return dataset


def _builtin() -> datasets.Dataset:
    with open(os.path.join(BUILTIN_DIR, "systems.jsonl"), encoding="utf-8") as f:
        systems = {r["app"]: r["system_prompt"] for r in map(json.loads, f)}
    with open(os.path.join(BUILTIN_DIR, "questions.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return datasets.Dataset.from_dict({
        "app": [r["app"] for r in rows],
        "system_prompt": [systems[r["app"]] for r in rows],
        "question": [r["question"] for r in rows],
        "answer": [r["answer"] for r in rows],
    })


def prompt_ids(tokenizer, row: dict) -> list[int]:
    """The chat-templated token ids of a row: its system prompt, then its question."""
    chat = [{"role": "system", "content": row["system_prompt"]}, {"role": "user", "content": row["question"]}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def shared_prefix_lengths(rows: list[dict], prompts: dict[int, list[int]]) -> dict[str, int]:
    """Per app: how many tokens all its prompts start with (what the prefix tree shares)."""
    shared: dict[str, list[int]] = {}
    for r in rows:
        ids = prompts[r["id"]]
        prefix = shared.setdefault(r["app"], ids)
        n = next((i for i, (a, b) in enumerate(zip(prefix, ids)) if a != b), min(len(prefix), len(ids)))
        shared[r["app"]] = prefix[:n]
    return {app: len(p) for app, p in shared.items()}
