"""The pipeline's metrics as pictures: step time, waits, the queue, staleness, syncs, speed.

`plot_pipeline(run)` draws a run folder's metrics.jsonl (or a list of records) with the
diagnosis (grpo_lab.watch.doctor) as its title; `draw_pipeline` draws the same panels into
a figure of one's own. A panel is drawn only when the run logged one of its metrics: a
synchronous run has a step time but no queue, staleness or weight sync, and gets no empty axes
for them. The live dashboard (grpo_lab.watch.dashboard) lays out its panels the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from .doctor import (
    BACKPRESSURE,
    FWD_BWD,
    QUEUE,
    QUEUE_MAX,
    STALE_MAX,
    STALE_MEAN,
    STEP,
    SYNC,
    VERSION_WAIT,
    WAIT,
    diagnose,
)
from .metrics import read_metrics, series


class Panel(NamedTuple):
    """One plot: the metrics it draws against the step, one line each."""

    title: str
    keys: tuple[str, ...]
    styles: tuple[str, ...] = ("-", "-", "--")


PIPELINE_PANELS = (
    Panel("step time (s)", (STEP, FWD_BWD)),
    # Generation is held back by a full buffer or by the version gate (admission within
    # max_staleness); diagnose counts both as backpressure, so the plot shows both.
    Panel("rollout wait vs backpressure (s)", (WAIT, BACKPRESSURE, VERSION_WAIT), ("-", "-", ":")),
    Panel("rollout queue size vs max", (QUEUE, QUEUE_MAX), ("-", "--")),
    Panel("staleness (versions)", (STALE_MEAN, STALE_MAX)),
    Panel("weight sync (s)", (SYNC,)),
    Panel("generated tokens / s", ("rollout/generated_tok_s_busy",)),
)


def has_data(records: list[dict], panel: Panel) -> bool:
    """Whether any record carries one of the panel's metrics."""
    return any(key in r for r in records for key in panel.keys)


def grid_shape(n: int) -> tuple[int, int]:
    """(rows, columns) for n panels: one row up to 4, else 3 or 4 columns, whichever leaves
    fewer empty cells in the last row (3 on a tie)."""
    if n <= 4:
        return 1, max(n, 1)
    columns = min((3, 4), key=lambda c: -n % c)
    return -(-n // columns), columns


def panel_axes(fig, n: int) -> list:
    """n axes in a `grid_shape(n)` grid of `fig`; "step" labels the x axis of each column's
    last axes, and the cells left over in the last row get no axes."""
    from matplotlib.ticker import MaxNLocator  # matplotlib: the notebooks extra, loaded to draw

    rows, columns = grid_shape(n)
    axes = list(fig.subplots(rows, columns, squeeze=False).ravel())
    for ax in axes[n:]:
        ax.remove()
    for i, ax in enumerate(axes[:n]):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
        if i + columns >= n:  # nothing below it
            ax.set_xlabel("step", fontsize=8)
    return axes[:n]


def draw_panel(ax, records: list[dict], panel: Panel) -> None:
    for key, style in zip(panel.keys, panel.styles):
        xs, ys = series(records, key)
        if xs:
            ax.plot(xs, ys, style, label=key.split("/")[-1])
    ax.set_title(panel.title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)


RATIO_SPAN = 0.005
"""The ratio axis spans at least 1 +- this: a ratio of 1 within float error (on-policy steps)
reads as a flat line at 1.0000, not as noise on an axis labelled `1e-7+1`."""


def ratio_axis(ax, ratios: list[float]) -> None:
    """Plain tick labels with 4 decimals (no offset, no scientific notation) over a span of at
    least 1 +- RATIO_SPAN."""
    from matplotlib.ticker import StrMethodFormatter

    low, high = min([1.0, *ratios]), max([1.0, *ratios])
    ax.set_ylim(min(low, 1 - RATIO_SPAN), max(high, 1 + RATIO_SPAN))
    ax.yaxis.set_major_formatter(StrMethodFormatter("{x:.4f}"))


def draw_pipeline(fig, records: list[dict]) -> list[str]:
    """The pipeline panels that have data into `fig`; returns their titles."""
    panels = [p for p in PIPELINE_PANELS if has_data(records, p)]
    for ax, panel in zip(panel_axes(fig, len(panels)), panels):
        draw_panel(ax, records, panel)
    return [p.title for p in panels]


def plot_pipeline(run: str | Path | list[dict], title: str | None = None):
    """The recipe's pipeline metrics from a run folder (its metrics.jsonl) or a list of
    records; the diagnosis is the title. Returns the figure."""
    import matplotlib.pyplot as plt

    records = run if isinstance(run, list) else read_metrics(run)
    panels = [p for p in PIPELINE_PANELS if has_data(records, p)]
    rows, _ = grid_shape(len(panels))
    fig = plt.figure(figsize=(13, 0.8 + 2.6 * rows), layout="constrained")
    if draw_pipeline(fig, records) == []:
        fig.text(0.5, 0.5, "no pipeline metrics in these records", ha="center")
    fig.suptitle(title or diagnose(records).verdict, fontsize=9, wrap=True)
    return fig
