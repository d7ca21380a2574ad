"""Draw compare.py's results: steady-state steps/s and cold start per tool, and 1-2-4 worker scaling.

    python benchmarks/plot.py [benchmarks/results/compare-latest.json] [--out benchmarks/compare.png]

Needs matplotlib (`pip install matplotlib`, or `pip install -e '.[bench]'`). Panels whose
section is missing from the results (not run, or failed) are left out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASELINE, OURS, OTHER = "#444444", "#e8743b", "#6c8ebf"  # torchrun, %%distribute tools, the rest


def _bar_panel(ax, labels: list[str], colors: list[str], values: list[float], ratios: list[float | None],
               title: str, ylabel: str) -> None:
    bars = ax.bar(range(len(values)), values, color=colors)
    for bar, r in zip(bars, ratios):
        if r is not None:
            ax.annotate(f"{r:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
    ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel)
    ax.margins(y=0.12)


def _color(tool: str) -> str:
    return BASELINE if tool == "torchrun" else OURS if tool in ("auto", "manual", "dask") else OTHER


def plot(results_path: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(Path(results_path).read_text())
    tools = results.get("tools") if "error" not in results.get("tools", {"error": 1}) else None
    scaling = results.get("scaling") if "error" not in results.get("scaling", {"error": 1}) else None
    panels = (2 if tools else 0) + (1 if scaling else 0)
    if not panels:
        raise SystemExit(f"{results_path}: no tools or scaling results to plot")
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.6), squeeze=False)
    axes = list(axes[0])
    meta = results.get("meta", {})
    if tools:
        names = list(tools["median"])
        labels = [tools["labels"][t].replace("`", "") for t in names]
        colors = [_color(t) for t in names]
        ratios = tools["ratio_to_torchrun"]
        _bar_panel(axes.pop(0), labels, colors, [tools["median"][t]["rate"] for t in names],
                   [ratios[t]["rate"] for t in names], "steady-state steps/s, rank 0 (x torchrun)", "steps/s")
        _bar_panel(axes.pop(0), labels, colors, [tools["median"][t]["cold"] for t in names],
                   [ratios[t]["cold"] for t in names], "cold start to first step (x torchrun)", "seconds")
    if scaling:
        ax = axes.pop(0)
        workers = list(scaling["median"])
        width = 0.38
        for offset, tool, color, label in ((-width / 2, "torchrun", BASELINE, "torchrun"),
                                           (width / 2, "auto", OURS, "%%distribute (automatic)")):
            values = [scaling["median"][k][tool]["rate"] for k in workers]
            bars = ax.bar([i + offset for i in range(len(workers))], values, width, color=color, label=label)
            if tool == "auto":  # x torchrun at the same size
                for bar, k in zip(bars, workers):
                    base = scaling["median"][k]["torchrun"]["rate"]
                    ax.annotate(f"{bar.get_height() / base:.2f}x", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                                ha="center", va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(workers)), [f"{k} worker{'s' if k != '1' else ''}" for k in workers])
        ax.set_title("steps/s, batch 64 per rank (x torchrun)", fontsize=10)
        ax.margins(y=0.12)
        ax.set_ylabel("steps/s")
        ax.legend(fontsize=8)
    from matplotlib.patches import Patch

    fig.legend(handles=[Patch(color=BASELINE, label="torchrun (the baseline)"),
                        Patch(color=OURS, label="%%distribute"), Patch(color=OTHER, label="other tools")],
               loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.suptitle(f"jupyter_scale benchmarks/compare.py: {meta.get('date', '')}, {meta.get('cores', '?')} cores, "
                 f"torch {meta.get('torch', '?')}", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 1))  # room for the legend below the panels
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    print(f"plot: {out}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", type=Path, default=HERE / "results" / "compare-latest.json")
    parser.add_argument("--out", type=Path, default=HERE / "compare.png")
    args = parser.parse_args()
    plot(args.results, args.out)


if __name__ == "__main__":
    main()
