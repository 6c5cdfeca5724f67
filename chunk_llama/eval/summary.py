"""Merging the per-process outputs of an eval and writing `summary.json` / `summary.md`."""

from __future__ import annotations

import glob
import json
import os


def _read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def merge_parts(output_dir: str, stem: str) -> list[dict]:
    """Fold `{stem}.rank*.jsonl` into `{stem}.jsonl`; results are rewritten sorted by id
    (they are appended as requests finish), so any number of processes gives one file."""
    path = os.path.join(output_dir, f"{stem}.jsonl")
    records = _read_jsonl(path) if os.path.exists(path) else []
    parts = sorted(glob.glob(os.path.join(output_dir, f"{stem}.rank*.jsonl")))
    for part in parts:
        records += _read_jsonl(part)
    if stem == "results":
        records.sort(key=lambda r: r["id"])
    if parts or stem == "results":
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        os.replace(path + ".tmp", path)
        for part in parts:
            os.remove(part)
    return records


def write_summary(output_dir: str, ordering: dict, num_processes: int) -> dict:
    """Per app and overall figures from all results and runs so far (resumed runs included)."""
    results = merge_parts(output_dir, "results")
    runs = merge_parts(output_dir, "runs")
    apps = list(dict.fromkeys(r["app"] for r in results))
    summary = dict(apps={}, ordering=ordering, num_processes=num_processes)
    for app in apps + ["overall"]:
        rs = [r for r in results if app == "overall" or r["app"] == app]
        ru = [r for r in runs if app == "overall" or r["app"] == app]
        prompt_tokens = sum(r["prompt_tokens"] for r in rs)
        shared_tokens = sum(r["shared_tokens"] for r in rs)
        seconds = sum(r["seconds"] for r in ru)
        generated = sum(r["generated_tokens"] for r in ru)
        summary["apps"][app] = dict(
            requests=len(rs),
            prompt_tokens=prompt_tokens,
            shared_tokens=shared_tokens,
            sharing_ratio=shared_tokens / prompt_tokens if prompt_tokens else 0.0,
            peak_kv_bytes=max((r["peak_kv_bytes"] for r in ru), default=0),
            peak_unshared_kv_bytes=max((r["peak_unshared_kv_bytes"] for r in ru), default=0),
            prefill_tokens_reused=sum(r["prefill_tokens_reused"] for r in ru),
            prefill_tokens_computed=sum(r["prefill_tokens_computed"] for r in ru),
            throughput_tokens_per_s=generated / seconds if seconds else 0.0,
            accuracy=sum(r["correct"] for r in rs) / len(rs) if rs else 0.0,
            parity_checked=sum(r["parity"]["checked"] for r in ru),
            parity_equal=sum(r["parity"]["equal"] for r in ru),
        )
    with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(output_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(summary) + "\n")
    return summary


def render_markdown(summary: dict) -> str:
    lines = ["| app | requests | prompt tokens | shared | sharing | peak KV MiB (unshared) | prefill reused | "
             "tokens/s | accuracy | = stock |", "|" + "---|" * 10]
    for app, s in summary["apps"].items():
        parity = f"{s['parity_equal']}/{s['parity_checked']}" if s["parity_checked"] else "-"
        lines.append(
            f"| {app} | {s['requests']} | {s['prompt_tokens']} | {s['shared_tokens']} | {s['sharing_ratio']:.1%} | "
            f"{s['peak_kv_bytes'] / 2**20:.1f} ({s['peak_unshared_kv_bytes'] / 2**20:.1f}) | "
            f"{s['prefill_tokens_reused']} | {s['throughput_tokens_per_s']:.1f} | {s['accuracy']:.1%} | {parity} |"
        )
    o = summary["ordering"]
    saved = 1 - o["grouped_order"] / o["input_order"] if o["input_order"] else 0.0
    lines += ["", f"Prefill tokens by order (replayed on the prefix tree with this KV budget): input order "
              f"{o['input_order']}, grouped by app {o['grouped_order']} ({saved:.1%} saved). "
              f"Processes: {summary['num_processes']}."]
    return "\n".join(lines)
