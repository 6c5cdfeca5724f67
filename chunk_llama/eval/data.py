"""Prompt sets as `datasets.Dataset`s with columns app, system_prompt, question, answer
(and optionally few_shot), and their rows as chat-templated token ids.

The shipped set (`toolqa`) is four ToolQA-style applications written for this
project (`scripts/make_prompt_sets.py`): each a long system prompt of tool
definitions and rules, few-shot examples as chat turns, and 60 questions whose
gold answer is the first tool call. A user's set can be a JSONL, JSON, CSV or
Parquet file or a folder saved with `Dataset.save_to_disk`.

`few_shot` (optional): chat messages placed between the system prompt and the
question, e.g. worked examples as a user question then the assistant's answer:
a list of `{"role", "content"}` dicts, or that list as a JSON string (CSV); empty
or null for none. Roles are "user" and "assistant", alternating from "user".
Loading validates it and stores it as a JSON string (one type for every format).
"""

from __future__ import annotations

import json
import os

import datasets

REQUIRED_COLUMNS = ("app", "system_prompt", "question", "answer")
OPTIONAL_COLUMNS = ("few_shot",)
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
    if "few_shot" in dataset.column_names:
        normalized = [json.dumps(parse_few_shot(v, where=f"row {i}"))
                      for i, v in enumerate(dataset["few_shot"])]
        dataset = dataset.remove_columns("few_shot").add_column("few_shot", normalized)
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
        systems = {r["app"]: r for r in map(json.loads, f)}
    with open(os.path.join(BUILTIN_DIR, "questions.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return datasets.Dataset.from_dict({
        "app": [r["app"] for r in rows],
        "system_prompt": [systems[r["app"]]["system_prompt"] for r in rows],
        "question": [r["question"] for r in rows],
        "answer": [r["answer"] for r in rows],
        "few_shot": [systems[r["app"]].get("few_shot", []) for r in rows],
    })


def parse_few_shot(value, *, where: str = "few_shot") -> list[dict]:
    """Validate a `few_shot` value (see the module docstring); returns its messages.

    Raises ValueError (bad JSON, roles, order) or TypeError (wrong types), naming `where`."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: few_shot is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{where}: few_shot must be a list of {{role, content}} messages, "
                        f"got {type(value).__name__}")
    messages = []
    for n, m in enumerate(value):
        if not isinstance(m, dict):
            raise TypeError(f"{where}: few_shot message {n} must be a dict with role and content, "
                            f"got {type(m).__name__}")
        role, content = m.get("role"), m.get("content")
        expected = "user" if n % 2 == 0 else "assistant"
        if role != expected:
            raise ValueError(f"{where}: few_shot message {n} has role {role!r}; messages alternate user, "
                             f"assistant, starting with user, so it must be {expected!r}")
        if not isinstance(content, str):
            raise TypeError(f"{where}: few_shot message {n} content must be a string, "
                            f"got {type(content).__name__}")
        messages.append({"role": role, "content": content})
    if len(messages) % 2:
        raise ValueError(f"{where}: few_shot ends with a user message; "
                         "each example needs the assistant's answer")
    return messages


def chat_messages(row: dict) -> list[dict]:
    """A row as chat messages: its system prompt, its few-shot turns (if any), then its
    question. All but the question are the same for every question of an app (its prefix)."""
    return [{"role": "system", "content": row["system_prompt"]}, *parse_few_shot(row.get("few_shot")),
            {"role": "user", "content": row["question"]}]


def prompt_ids(tokenizer, row: dict) -> list[int]:
    """The chat-templated token ids of a row's `chat_messages`."""
    text = tokenizer.apply_chat_template(chat_messages(row), add_generation_prompt=True, tokenize=False)
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
