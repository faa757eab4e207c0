#!/usr/bin/env python3
# (In a folder of their own: bench/token.py would shadow the standard library's
# `token` module, which matplotlib and asyncio import, for scripts beside it.)
"""Draws bench/scale.sh's CSV of one dimension as one PNG (matplotlib).

The CSV has a row per figure: `dimension,step,target,metric,value` (a step is the
dimension's size: connections, bytes, ...). The plot has a panel per metric, a line
per target, the step on a logarithmic x axis (every dimension here grows by factors).

    python3 bench/scale/plot.py target/scale/connections.csv target/scale/connections.png
"""

import csv
import sys
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")  # no display: files only
import matplotlib.pyplot as plt  # noqa: E402

# What each dimension's steps are, for the x axis.
STEP_LABEL = {
    "connections": "idle keep-alive connections held at the ingress",
    "bodies": "request body (bytes)",
}


def main():
    source, target = sys.argv[1], sys.argv[2]
    series = defaultdict(lambda: defaultdict(list))  # metric -> target -> [(step, value)]
    dimension = None
    with open(source, newline="") as f:
        for row in csv.DictReader(f):
            dimension = row["dimension"]
            if row["value"] in ("", "-"):
                continue
            series[row["metric"]][row["target"]].append((float(row["step"]), float(row["value"])))
    if not series:
        sys.exit(f"{source}: no figures to plot")
    metrics = list(series)
    cols = min(3, len(metrics))
    rows = -(-len(metrics) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    for ax in axes.flat[len(metrics):]:
        ax.set_visible(False)
    for ax, metric in zip(axes.flat, metrics):
        for name, points in sorted(series[metric].items()):
            points.sort()
            xs = [max(x, 1) for x, _ in points]  # a 0-byte step sits at 1 on a log axis
            ax.plot(xs, [y for _, y in points], marker="o", label=name)
        ax.set_xscale("log")
        ax.set_title(metric)
        ax.set_xlabel(STEP_LABEL.get(dimension, dimension))
        ax.grid(True, which="both", alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize="small")
    fig.suptitle(f"bench/scale.sh: {dimension}")
    fig.tight_layout()
    fig.savefig(target, dpi=100)


if __name__ == "__main__":
    main()
