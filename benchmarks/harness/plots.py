"""The PNG beside every benchmark's JSON: panels of latency per case, log scale, floors dashed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Panel", "plot_panels"]


@dataclass
class Panel:
    """One subplot: ``series[name][i]`` is the value at ``x[i]`` (``None``: not measured)."""

    title: str
    x: list[str]
    series: dict[str, list[float | None]]
    ylabel: str = "ms per step (median)"
    xlabel: str = ""
    bars: bool = False
    reference: dict[str, list[float | None]] = field(default_factory=dict)  # dashed lines (floors)


def plot_panels(path: Path, panels: Sequence[Panel], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(n for p in panels for n in p.series))
    cmap = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    colors = {n: cmap(i % cmap.N) for i, n in enumerate(names)}
    cols = 2
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7.5 * cols, 4.6 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels, strict=False):
        positions = list(range(len(panel.x)))
        width = 0.8 / max(1, len(panel.series))
        for i, (name, raw) in enumerate(panel.series.items()):
            values = [float("nan") if v is None else v for v in raw]
            dashed = "sdpa" in name  # the break-op attention, drawn apart from the paged one
            if panel.bars:
                offsets = [p + (i - (len(panel.series) - 1) / 2) * width for p in positions]
                ax.bar(offsets, values, width, label=name, color=colors[name], hatch="//" if dashed else None)
            else:
                style = ":" if dashed else "-"
                ax.plot(positions, values, marker="o", linestyle=style, label=name, color=colors[name])
        for name, line in panel.reference.items():
            ax.plot(
                positions,
                [float("nan") if v is None else v for v in line],
                linestyle="--",
                color="black",
                label=name,
            )
        ax.set_xticks(positions, panel.x)
        ax.set_yscale("log")
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel(panel.xlabel)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=2)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
