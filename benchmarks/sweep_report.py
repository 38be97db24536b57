#!/usr/bin/env python3
"""The heatmap of a GPU shape sweep (benchmarks/sweep_gpu.py): tbegen's backward and forward
speedup over FBGEMM_GPU per cell, one row per shape, one column per optimizer and direction.

    python3 benchmarks/sweep_report.py SWEEP_DIR        # reads sweep.json, writes sweep.png (matplotlib)

Cells are coloured by speedup on a log scale centred on 1.0x (red: tbegen slower, blue: faster) and
labelled with the figure; a cell not timed is grey. Also rewrites sweep.md from sweep.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_gpu import OPTIMIZERS, markdown  # noqa: E402


def matrix(summary: dict):
    """(shape labels, column labels, values[row][col] or None) for the heatmap."""
    shapes, by = [], {}
    for c in summary["cells"]:
        if c["shape"] not in by:
            shapes.append(c["shape"])
            by[c["shape"]] = {}
        by[c["shape"]][c["opt"]] = c
    columns = [(kind, opt) for kind in ("bwd", "fwd") for opt in OPTIMIZERS]
    values = [[by[s].get(opt, {}).get(f"{kind}_speedup") for kind, opt in columns] for s in shapes]
    labels = [f"{s}: {next(iter(by[s].values())).get('describe', '')}" for s in shapes]
    return labels, [f"{kind} {opt}" for kind, opt in columns], values


def heatmap(summary: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import TwoSlopeNorm
    except ImportError:
        return False
    rows, cols, values = matrix(summary)
    grid = [[math.log2(v) if v else float("nan") for v in row] for row in values]
    fig, ax = plt.subplots(figsize=(6.0 + 1.1 * len(cols), 1.2 + 0.32 * len(rows)))
    cmap = matplotlib.colormaps["RdBu"].with_extremes(bad="lightgrey")
    image = ax.imshow(grid, cmap=cmap, norm=TwoSlopeNorm(vcenter=0.0, vmin=-1.0, vmax=1.5), aspect="auto")
    for i, row in enumerate(values):
        for j, v in enumerate(row):
            ax.text(j, i, "-" if v is None else f"{v:.2f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(cols)), cols, rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.axvline(len(OPTIMIZERS) - 0.5, color="black", linewidth=1)
    env = summary["env"]
    ax.set_title(f"tbegen speed / FBGEMM_GPU {env.get('fbgemm_gpu')} ({env.get('gpu')}, {env.get('date_utc')} UTC)",
                 fontsize=9)
    fig.colorbar(image, ax=ax, label="log2 speedup", shrink=0.5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir")
    args = ap.parse_args(argv)
    folder = Path(args.sweep_dir)
    summary = json.loads((folder / "sweep.json").read_text())
    (folder / "sweep.md").write_text(markdown(summary))
    made = heatmap(summary, folder / "sweep.png")
    print(f"wrote {folder / 'sweep.md'}" + (f" and {folder / 'sweep.png'}" if made else " (no PNG: matplotlib is not installed)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
