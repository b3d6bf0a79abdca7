"""The front page's picture: `mixprec bench` float32 against bf16-mixed, from a committed
result (benchmarks/results/bench_default_cpu/results.json by default).

    python benchmarks/readme_plot.py [results.json] [--out docs/assets/bench.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "benchmarks" / "results" / "bench_default_cpu" / "results.json"


def plot(results: Path, out: Path) -> None:
    """Two panels: ms/step (median, min-max) and peak memory against batch size, one line
    per precision, the speedup over float32 written at each mixed point."""
    data = json.loads(results.read_text())
    rows = [r["summary"] for r in data["results"] if r["summary"]["status"] == "ok"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(9, 3.4))
    for label in dict.fromkeys(r["label"] for r in rows):
        ok = [r for r in rows if r["label"] == label]
        xs = [r["batch_size"] for r in ok]
        med = [r["median_ms"] for r in ok]
        low = [r["median_ms"] - r["min_ms"] for r in ok]
        err = [low, [r["max_ms"] - r["median_ms"] for r in ok]]
        ax_t.errorbar(xs, med, yerr=err, marker="o", capsize=3, label=label)
        ax_m.plot(xs, [r["peak_memory"] / 2**20 for r in ok], marker="o", label=label)
        for x, m, r in zip(xs, med, ok, strict=True):
            if r.get("speedup") and label != "32-true":
                ax_t.annotate(
                    f"{r['speedup']:.1f}x",
                    (x, m),
                    textcoords="offset points",
                    xytext=(0, 8),
                    ha="center",
                    fontsize=8,
                )
    batches = sorted({r["batch_size"] for r in rows})
    for ax, ylabel in ((ax_t, "ms/step (lower is better)"), (ax_m, "peak memory, MiB")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    meta = data["metadata"]
    fig.suptitle(
        f"mixprec bench: the blog's CNN ({meta['image_size']}px) on {meta['device']}", fontsize=8
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", type=Path, default=DEFAULT)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "assets" / "bench.png")
    args = parser.parse_args()
    plot(args.results, args.out)
    print(args.out)


if __name__ == "__main__":
    main()
