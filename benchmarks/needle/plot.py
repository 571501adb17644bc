"""Heatmaps of the needle grid: depth (rows) x length (columns), one panel per measure."""

from __future__ import annotations

from pathlib import Path


def heatmap(cells: list[dict], names: list[str], out: Path, title: str) -> None:
    """Write a PNG: retrieval rate per endpoint and, with two endpoints, the rate of identical outputs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths = list(dict.fromkeys((c["length"], c["target"]) for c in cells))
    depths = sorted({c["depth"] for c in cells})
    panels = [(f"retrieval ({n})", lambda c, n=n: c["retrieval"][n]) for n in names]
    if len(names) == 2:
        panels.append((f"identical outputs ({names[0]} == {names[1]})", lambda c: c["agreement"]))
    fig, axes = plt.subplots(1, len(panels), squeeze=False, layout="constrained",
                             figsize=(1.0 + len(panels) * (1.4 + 0.8 * len(lengths)), 1.6 + 0.4 * len(depths)))
    for ax, (label, get) in zip(axes[0], panels):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for c in cells:
            r = get(c)
            if r["n"]:
                grid[depths.index(c["depth"]), lengths.index((c["length"], c["target"]))] = r["rate"]
        im = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            if not np.isnan(v):
                ax.text(j, i, f"{100 * v:.0f}%", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{l}\n{t:,}" for l, t in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{100 * d:g}%" for d in depths], fontsize=7)
        ax.set_xlabel("prompt length (tokens)", fontsize=8)
        ax.set_ylabel("needle depth", fontsize=8)
        ax.set_title(label, fontsize=9)
    fig.colorbar(im, ax=axes[0].tolist(), fraction=0.03)
    fig.suptitle(title, fontsize=9)
    fig.savefig(out, dpi=80, bbox_inches="tight")
    plt.close(fig)
