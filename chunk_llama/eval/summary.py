"""Statistics of an eval: per-app and overall figures from the merged results and runs,
written as `summary.json` and `summary.md`.

Throughput is generated tokens over wall time, and the wall time of a group of
runs is the length of the union of their intervals `[started_at, started_at +
seconds]`: the time during which at least one process was generating. Runs of
several processes at once overlap and count once (summing their seconds would
divide by the parallelism); runs of a resumed eval, hours apart, add up without
the gap between them. Per app this is the same rule over that app's runs (an app
split over processes runs in parallel too). KV peaks are per process (each holds
its own pool): the largest any single run reached.

Accuracy comes with its 95% Wilson score interval (`accuracy_ci`): with 60
questions per app an accuracy of 10% is [4.7%, 20.2%], so two runs differ
meaningfully only where their intervals barely overlap, if at all.
"""

from __future__ import annotations

import json
import math
import os

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile


def wilson_interval(successes: int, trials: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default); (0, 1) for no trials."""
    if not 0 <= successes <= trials:
        raise ValueError(f"need 0 <= successes <= trials, got {successes} of {trials}")
    if trials == 0:
        return 0.0, 1.0
    p = successes / trials
    denom = 1 + z * z / trials
    center = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def wall_seconds(runs: list[dict]) -> float:
    """Length of the union of the runs' intervals (see the module docstring)."""
    intervals = sorted((r["started_at"], r["started_at"] + r["seconds"]) for r in runs)
    total = 0.0
    covered_until = float("-inf")
    for start, end in intervals:
        if end > covered_until:
            total += end - max(start, covered_until)
            covered_until = end
    return total


def summarize(results: list[dict], runs: list[dict], ordering: dict, num_processes: int) -> dict:
    """Per app (in order of first result) and `overall` figures from all results and runs so far."""
    apps = list(dict.fromkeys(r["app"] for r in results))
    summary = dict(apps={}, ordering=ordering, num_processes=num_processes,
                   constrained=any(r.get("constrained", False) for r in runs))
    for app in apps + ["overall"]:
        rs = [r for r in results if app == "overall" or r["app"] == app]
        ru = [r for r in runs if app == "overall" or r["app"] == app]
        prompt_tokens = sum(r["prompt_tokens"] for r in rs)
        shared_tokens = sum(r["shared_tokens"] for r in rs)
        generated = sum(r["generated_tokens"] for r in ru)
        wall = wall_seconds(ru)
        correct = sum(bool(r["correct"]) for r in rs)
        summary["apps"][app] = dict(
            requests=len(rs),
            prompt_tokens=prompt_tokens,
            shared_tokens=shared_tokens,
            sharing_ratio=shared_tokens / prompt_tokens if prompt_tokens else 0.0,
            peak_kv_bytes=max((r["peak_kv_bytes"] for r in ru), default=0),
            peak_unshared_kv_bytes=max((r["peak_unshared_kv_bytes"] for r in ru), default=0),
            prefill_tokens_reused=sum(r["prefill_tokens_reused"] for r in ru),
            prefill_tokens_computed=sum(r["prefill_tokens_computed"] for r in ru),
            generated_tokens=generated,
            wall_seconds=wall,
            throughput_tokens_per_s=generated / wall if wall else 0.0,
            correct=correct,
            accuracy=correct / len(rs) if rs else 0.0,
            accuracy_ci=list(wilson_interval(correct, len(rs))),
            parity_checked=sum(r["parity"]["checked"] for r in ru),
            parity_equal=sum(r["parity"]["equal"] for r in ru),
        )
    return summary


def write_summary(output_dir: str, summary: dict) -> None:
    with open(os.path.join(output_dir, "summary.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    with open(os.path.join(output_dir, "summary.md"), "w", encoding="utf-8") as f:
        f.write(render_markdown(summary) + "\n")


def render_markdown(summary: dict) -> str:
    lines = ["| app | requests | prompt tokens | shared | sharing | peak KV MiB (unshared) | prefill reused | "
             "tokens/s | accuracy [95% CI] | = stock |", "|" + "---|" * 10]
    for app, s in summary["apps"].items():
        parity = f"{s['parity_equal']}/{s['parity_checked']}" if s["parity_checked"] else "-"
        lines.append(
            f"| {app} | {s['requests']} | {s['prompt_tokens']} | {s['shared_tokens']} | {s['sharing_ratio']:.1%} | "
            f"{s['peak_kv_bytes'] / 2**20:.1f} ({s['peak_unshared_kv_bytes'] / 2**20:.1f}) | "
            f"{s['prefill_tokens_reused']} | {s['throughput_tokens_per_s']:.1f} | {_accuracy(s)} | {parity} |"
        )
    o = summary["ordering"]
    saved = 1 - o["grouped_order"] / o["input_order"] if o["input_order"] else 0.0
    wall = summary["apps"]["overall"]["wall_seconds"]
    lines += ["", f"Prefill tokens by order (replayed on the prefix tree with this KV budget): input order "
              f"{o['input_order']}, grouped by app {o['grouped_order']} ({saved:.1%} saved). "
              f"Processes: {summary['num_processes']}, generating for {wall:.1f} s of wall time."]
    if summary.get("constrained"):
        lines.append("Decoded under a grammar of each app's tools (--constrained).")
    return "\n".join(lines)


def _accuracy(s: dict) -> str:
    """`12/60 = 20.0% [11.8, 31.8]`; summaries written before the interval existed show the accuracy only."""
    if "accuracy_ci" not in s:
        return f"{s['accuracy']:.1%}"
    low, high = s["accuracy_ci"]
    return f"{s['correct']}/{s['requests']} = {s['accuracy']:.1%} [{low:.1%}, {high:.1%}]"
