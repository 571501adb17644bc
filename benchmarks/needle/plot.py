"""Heatmaps of the needle grid: depth (rows) x length (columns), one panel per measure."""

from __future__ import annotations

from pathlib import Path


def heatmap(cells: list[dict], names: list[str], out: Path, title: str) -> None:
    """Write a PNG: retrieval rate per endpoint and, with two endpoints, the rate of identical outputs (skipped,
    with a one-line note, without matplotlib: the bench extra)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing (the bench extra: pip install -e '.[bench]'): no PNG written")
        return
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


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.needle.plot RUN.json [RUN.json ...] --out X.png`: one heatmap over the cells of several
    runs of the harness (e.g. many seeds at 8k, a few at 128k) against the same endpoints."""
    import argparse
    import json
    ap = argparse.ArgumentParser(prog="python -m benchmarks.needle.plot", description=main.__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="needle.json files written by python -m benchmarks.needle")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default=None)
    args = ap.parse_args(argv)
    runs = [json.loads(Path(p).read_text()) for p in args.runs]
    names = list(runs[0]["endpoints"])
    if any(list(r["endpoints"]) != names for r in runs):
        raise SystemExit("runs: every run must have the same endpoint names")
    cells = [c for r in runs for c in r["cells"]]
    n = sorted({c["retrieval"][names[0]]["n"] for c in cells})
    title = args.title or (f"needle in a haystack: {runs[0]['endpoints'][names[0]]['model']}, "
                           f"{'/'.join(map(str, n))} sample(s) per cell")
    heatmap(cells, names, Path(args.out), title)


if __name__ == "__main__":
    main()
