"""PNG plots from a `bench_kernel.py --grid paper` CSV (Table 3 as bars, Figures 3 and 4 as lines).

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


def main(path: str) -> None:
    rows = list(csv.DictReader(open(path)))
    stem = Path(path).with_suffix("")
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
