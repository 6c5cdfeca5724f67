"""Report a `bench_kernel.py --grid paper` CSV: PNG plots (Table 3 as bars, Figures 3
and 4 as lines) beside it, and its table in docs/BENCHMARKS.md (between markers,
replaced on every run; appended the first time). `bench_kernel.py --grid` calls this.

    python scripts/plot_bench.py docs/bench/kernel_cuda.csv
"""

from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

BENCHMARKS = Path(__file__).resolve().parents[1] / "docs" / "BENCHMARKS.md"


def markdown_table(rows: list[dict], caption: str) -> str:
    """One line per grid point: every implementation's ms, then the native kernel's
    bandwidth, its speed-up over dense SDPA and the two floors."""
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    native = next((i for i in impls if i.startswith("tpp_") and i != "tpp_reference"), impls[-1])
    points: dict[tuple, dict] = {}
    for r in rows:
        key = (r["experiment"], r["batch"], r["n_prompt"], r["n_shared"])
        points.setdefault(key, {})[r["impl"]] = r
    lines = [caption, "",
             "| experiment | b | n_p | n_s | " + " | ".join(impls) + f" | {native} GB/s | {native} vs sdpa_dense | "
             "floors BW / FLOP ms |",
             "|---" * (len(impls) + 7) + "|"]
    for (experiment, b, n_p, n_s), by_impl in points.items():
        top = by_impl.get(native, next(iter(by_impl.values())))
        cells = [f"{float(by_impl[i]['ms']):.2f}" if i in by_impl else "" for i in impls]
        lines.append(f"| {experiment} | {b} | {n_p} | {n_s} | " + " | ".join(cells) +
                     f" | {float(top['gbps']):.1f} | {float(top['speedup_vs_sdpa_dense']):.2f}x | "
                     f"{float(top['floor_bandwidth_ms']):.2f} / {float(top['floor_flops_ms']):.2f} |")
    return "\n".join(lines)


def write_table(stem: Path, rows: list[dict], benchmarks: Path = BENCHMARKS) -> None:
    """Replace (or append) the grid's table in BENCHMARKS.md; the caption is the first
    line of the run's `<stem>.md`."""
    md = stem.with_suffix(".md")
    caption = md.read_text().splitlines()[0] if md.exists() else f"From `{stem}.csv`."
    begin, end = f"<!-- {stem.name} table: written by scripts/plot_bench.py -->", f"<!-- end {stem.name} table -->"
    block = f"{begin}\n{markdown_table(rows, caption)}\n{end}"
    text = benchmarks.read_text() if benchmarks.exists() else ""
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + f"\n\n## Kernel grid ({stem.name})\n\n{block}\n"
    benchmarks.write_text(text)
    print(f"wrote the {stem.name} table into {benchmarks}")


def main(path: str) -> None:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    stem = Path(path).with_suffix("")
    write_table(stem, rows)
    impls = sorted({r["impl"] for r in rows}, key=lambda s: (s != "sdpa_dense", s))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))

    table = [r for r in rows if r["experiment"] == "table3"]
    points = sorted({(int(r["n_prompt"]), int(r["n_shared"])) for r in table})
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        ms = {(int(r["n_prompt"]), int(r["n_shared"])): float(r["ms"]) for r in table if r["impl"] == impl}
        axes[0].bar([j + i * width for j in range(len(points))], [ms.get(p, 0) for p in points], width, label=impl)
    axes[0].set_xticks([j + 0.4 for j in range(len(points))], [f"{p}/{s}" for p, s in points], rotation=60, fontsize=7)
    axes[0].set_yscale("log")
    axes[0].set_title("Table 3: latency (ms), n_p / n_s, b=32")

    for ax, experiment, key, label in ((axes[1], "figure3", "n_prompt", "context tokens (n_s = 2048)"),
                                       (axes[2], "figure4", "batch", "batch size (n_s = 2048)")):
        series = defaultdict(list)
        for r in rows:
            if r["experiment"] == experiment:
                tokens_per_s = int(r["batch"]) / (float(r["ms"]) / 1e3)
                series[r["impl"]].append((int(r[key]), tokens_per_s))
        for impl in impls:
            if series[impl]:
                xs, ys = zip(*sorted(series[impl]))
                ax.plot(xs, ys, marker="o", label=impl)
        ax.set_xlabel(label)
        ax.set_ylabel("decode tokens/s (attention only)")
        ax.set_yscale("log")
        ax.set_title({"figure3": "Figure 3: as decoding proceeds", "figure4": "Figure 4: batch size"}[experiment])
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{stem}.png", dpi=110)
    print(f"wrote {stem}.png")


if __name__ == "__main__":
    main(sys.argv[1])
