"""The eval's output files: JSONL journals appended as requests finish, and their merge.

`results.jsonl` (one record per request, by id) and `runs.jsonl` (one record per
application run) are the merged output. With one process they are also the
journals the run appends to; with n processes rank r appends to
`results.rank{r}-of-{n}.jsonl` and `runs.rank{r}-of-{n}.jsonl`, so that no two
processes ever write one file and a crash loses at most the line being written.

A process killed mid-write leaves a torn last line (no newline, not JSON).
`repair` truncates it with a one-line warning before the file is appended to
again, and the request it belonged to counts as not done, so it runs again. Any
other malformed line is a `ValueError` naming file and line: a torn line can only
be the last one, so anything else is corruption that must not pass silently.
"""

from __future__ import annotations

import glob
import json
import logging
import os

logger = logging.getLogger(__name__)

STEMS = ("results", "runs")
# Fields the eval reads back from each kind of record (on resume and in the summary).
REQUIRED_FIELDS = {
    "results": ("id", "app", "correct", "prompt_tokens", "shared_tokens", "generated_tokens"),
    "runs": ("app", "rank", "started_at", "seconds", "generated_tokens"),
}


def journal_path(output_dir: str, stem: str, rank: int, num_processes: int) -> str:
    """The file rank `rank` of `num_processes` appends `stem` records to."""
    suffix = "" if num_processes == 1 else f".rank{rank}-of-{num_processes}"
    return os.path.join(output_dir, f"{stem}{suffix}.jsonl")


def existing_files(output_dir: str, stem: str) -> list[str]:
    """The merged `stem` file (when there is one) and every rank journal in the folder,
    whatever number of processes wrote it (a crashed run may have had another)."""
    merged = os.path.join(output_dir, f"{stem}.jsonl")
    journals = sorted(glob.glob(os.path.join(glob.escape(output_dir), f"{stem}.rank*-of-*.jsonl")))
    return ([merged] if os.path.exists(merged) else []) + journals


def read_jsonl(path: str, *, required: tuple[str, ...] = (), allow_torn_tail: bool = False) -> list[dict]:
    """The JSON objects of a JSONL file, one per line, each with the `required` fields.

    allow_torn_tail: drop a torn last line instead of raising (for reading a file
    that another process may be appending to right now).
    """
    records, torn = _parse(path, required)
    if torn is not None and not allow_torn_tail:
        raise ValueError(f"{path}:{torn[0]}: torn last line (a run stopped mid-write); "
                         "resuming the eval repairs it")
    return records


def repair(path: str) -> None:
    """Make `path` safe to append to: truncate a torn last line (warning once, naming
    file and line) and end a complete last line that lacks one with a newline."""
    if not os.path.exists(path):
        return
    _, torn = _parse(path, ())
    if torn is not None:
        line_number, offset = torn
        logger.warning("%s:%d: dropped a torn last line (the run stopped mid-write); its request runs again",
                       path, line_number)
        os.truncate(path, offset)
    size = os.path.getsize(path)
    if size:
        with open(path, "rb+") as f:
            f.seek(size - 1)
            if f.read(1) != b"\n":  # a complete last record without it: the next append would join onto it
                f.write(b"\n")


def append_record(f, record: dict) -> None:
    """One record as one line, flushed: what a crash leaves behind is at most one torn line."""
    f.write(json.dumps(record) + "\n")
    f.flush()


def write_jsonl(path: str, records: list[dict]) -> None:
    """Replace `path` atomically, so a crash leaves the old file or the new one."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    os.replace(path + ".tmp", path)


def merge_results(records: list[dict]) -> list[dict]:
    """One record per id, sorted by id, so any number of processes gives the same file.

    The same id twice happens when a run stopped after the merge was written and
    before the journals were removed; the copies are then equal. Different records
    for one id mean two evals wrote into one folder, which is an error.
    """
    by_id: dict[int, dict] = {}
    for record in records:
        seen = by_id.setdefault(record["id"], record)
        if seen != record:
            raise ValueError(f"two different results for id {record['id']}: {seen} and {record}; "
                             "were two evals writing into the same output folder?")
    return [by_id[i] for i in sorted(by_id)]


def merge_runs(records: list[dict]) -> list[dict]:
    """The runs in order of start, each once (see `merge_results` on why copies occur)."""
    unique = {json.dumps(r, sort_keys=True): r for r in records}
    return sorted(unique.values(), key=lambda r: (r["started_at"], r["rank"]))


def _parse(path: str, required: tuple[str, ...]) -> tuple[list[dict], tuple[int, int] | None]:
    """Records, and (line number, byte offset) of a torn last line or None."""
    with open(path, "rb") as f:
        data = f.read()
    records = []
    offset = 0
    lines = data.split(b"\n")
    for number, line in enumerate(lines, 1):
        is_last = number == len(lines)
        if is_last and not line:  # the file ends with a newline (or is empty)
            break
        try:
            record = json.loads(line)
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError (a cut multi-byte character)
            if is_last:  # every line we write ends with a newline: one without it was cut short
                return records, (number, offset)
            raise ValueError(f"{path}:{number}: not a JSON line ({error}); only a torn last line is "
                             "tolerated, so this file was changed by something else") from None
        if not isinstance(record, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        missing = [k for k in required if k not in record]
        if missing:
            raise ValueError(f"{path}:{number}: record lacks {missing}; it needs {list(required)}")
        records.append(record)
        offset += len(line) + 1
    return records, None
