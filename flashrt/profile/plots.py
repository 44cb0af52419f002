"""Latency plots (matplotlib, Agg backend; no display needed): histograms and CDFs per stage, plus a
timeline of the run with the stages of each call stacked and the deadline drawn.

`plot_latency(path, stages, per_call, ...)` writes one PNG; `stages` is {series: [ms, ...]} and
`per_call` a list of {stage: ms} in call order. Extra series (e.g. the B side of a comparison) go in
`compare` and are drawn in the CDF and the timeline.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

_MAX_HISTS = 8


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _grid(n: int) -> tuple[int, int]:
    cols = min(4, max(1, n))
    return math.ceil(n / cols), cols


def plot_latency(path: str | Path, stages: Mapping[str, Sequence[float]],
                 per_call: Sequence[Mapping[str, float]] = (), title: str = "",
                 deadline_ms: float | None = None,
                 compare: Mapping[str, Sequence[float]] | None = None) -> Path:
    """Write the latency figure to `path` (PNG) and return the path."""
    plt = _pyplot()
    names = [n for n, v in stages.items() if len(v)][:_MAX_HISTS]
    hist_rows, cols = _grid(len(names) or 1)
    fig = plt.figure(figsize=(4.2 * cols, 3.0 * (hist_rows + 2)), constrained_layout=True)
    grid = fig.add_gridspec(hist_rows + 2, cols)
    for i, name in enumerate(names):
        _histogram(fig.add_subplot(grid[i // cols, i % cols]), name, stages[name], deadline_ms)
    _cdf(fig.add_subplot(grid[hist_rows, :]), {**{n: stages[n] for n in names}, **(compare or {})},
         deadline_ms)
    _timeline(fig.add_subplot(grid[hist_rows + 1, :]), per_call, deadline_ms, compare)
    fig.suptitle(title or "latency")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _percentile_lines(ax: Any, values: Sequence[float]) -> None:
    import numpy as np

    for q, style in ((50, "-"), (99, "--")):
        ax.axvline(float(np.percentile(values, q)), color="k", linestyle=style, linewidth=0.8,
                   label=f"p{q}")


def _histogram(ax: Any, name: str, values: Sequence[float], deadline_ms: float | None) -> None:
    ax.hist(values, bins=min(60, max(10, len(values) // 5)), color="tab:blue", alpha=0.8)
    _percentile_lines(ax, values)
    if deadline_ms is not None and deadline_ms <= max(values) * 1.5:
        ax.axvline(deadline_ms, color="tab:red", linewidth=1.0, label="deadline")
    ax.set_title(name, fontsize=9)
    ax.set_xlabel("ms", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.legend(fontsize=7)


def _cdf(ax: Any, series: Mapping[str, Sequence[float]], deadline_ms: float | None) -> None:
    for name, values in series.items():
        if not len(values):
            continue
        xs = sorted(values)
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        ax.step(xs, ys, where="post", label=name)
    if deadline_ms is not None:
        ax.axvline(deadline_ms, color="tab:red", linewidth=1.0, label="deadline")
    ax.set_xscale("log")
    ax.set_xlabel("ms (log)")
    ax.set_ylabel("fraction of calls")
    ax.set_title("CDF per stage", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=4)


def _timeline(ax: Any, per_call: Sequence[Mapping[str, float]], deadline_ms: float | None,
              compare: Mapping[str, Sequence[float]] | None) -> None:
    stage_names = list(dict.fromkeys(k for row in per_call for k in row))
    xs = list(range(len(per_call)))
    if stage_names:
        layers = [[row.get(name, 0.0) for row in per_call] for name in stage_names]
        ax.stackplot(xs, layers, labels=stage_names, alpha=0.8)
    for name, values in (compare or {}).items():
        ax.plot(range(len(values)), values, linewidth=0.7, label=name)
    if deadline_ms is not None:
        ax.axhline(deadline_ms, color="tab:red", linewidth=1.0, label="deadline")
    ax.set_xlabel("call")
    ax.set_ylabel("ms")
    ax.set_title("timeline (stages stacked per call)", fontsize=10)
    ax.legend(fontsize=7, ncol=6, loc="upper right")


Series = Mapping[str, tuple[Sequence[float], Sequence[float]] | tuple[Sequence[float], Sequence[float], str]]
"""label -> (xs, ys) drawn as a line, or (xs, ys, marker) drawn as markers only."""


def plot_panels(path: str | Path, panels: Sequence[tuple[str, str, str, Series, Mapping[str, float]]],
                title: str = "") -> Path:
    """Stacked panels: each (title, xlabel, ylabel, {label: (xs, ys[, marker])}, {label: horizontal line});
    a series with a marker ("o", "x", ...) is drawn as markers only (e.g. the ticks that missed)."""
    plt = _pyplot()
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 3.2 * len(panels)), constrained_layout=True,
                             squeeze=False)
    for ax, (name, xlabel, ylabel, series, lines) in zip(axes[:, 0], panels):
        for label, (xs, ys, *marker) in series.items():
            if marker:
                ax.plot(xs, ys, linestyle="none", marker=marker[0], markersize=6, fillstyle="none",
                        label=label)
            else:
                ax.plot(xs, ys, linewidth=0.8, label=label)
        for label, y in lines.items():
            ax.axhline(y, color="tab:red", linewidth=1.0, linestyle="--", label=label)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    fig.suptitle(title)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
