"""The pipeline's metrics as pictures: step time, waits, the queue, staleness, syncs, speed.

`plot_pipeline(run)` draws a run folder's metrics.jsonl (or a list of records) with the
diagnosis (grpo_lab.observe.diagnose) as its title; `draw_pipeline` draws the same panels into
a figure of one's own (the live dashboard's lower half).
"""

from __future__ import annotations

from pathlib import Path

from ..train.metrics import read_metrics, series
from .diagnose import (
    BACKPRESSURE,
    FWD_BWD,
    QUEUE,
    QUEUE_MAX,
    STALE_MAX,
    STALE_MEAN,
    STEP,
    SYNC,
    WAIT,
    diagnose,
)


def _plot(ax, records, keys, title, styles=("-", "-", "--")):
    for key, style in zip(keys, styles):
        xs, ys = series(records, key)
        if xs:
            ax.plot(xs, ys, style, label=key.split("/")[-1])
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7)


def draw_pipeline(fig, records: list[dict]) -> None:
    """The pipeline panels of `plot_pipeline` into `fig` (2 x 3 axes)."""
    axes = fig.subplots(2, 3).ravel()
    _plot(axes[0], records, (STEP, FWD_BWD), "step time (s)")
    _plot(axes[1], records, (WAIT, BACKPRESSURE), "rollout wait vs backpressure (s)")
    _plot(axes[2], records, (QUEUE, QUEUE_MAX), "rollout queue size vs max", ("-", "--"))
    _plot(axes[3], records, (STALE_MEAN, STALE_MAX), "staleness (versions)")
    _plot(axes[4], records, (SYNC,), "weight sync (s)")
    _plot(axes[5], records, ("rollout/generated_tok_s",), "generated tokens / s")
    for ax in axes[3:]:
        ax.set_xlabel("step", fontsize=8)


def plot_pipeline(run: str | Path | list[dict], title: str | None = None):
    """The recipe's pipeline metrics from a run folder (its metrics.jsonl) or a list of
    records; the diagnosis is the title. Returns the figure."""
    import matplotlib.pyplot as plt

    records = run if isinstance(run, list) else read_metrics(run)
    fig = plt.figure(figsize=(13, 6))
    draw_pipeline(fig, records)
    fig.suptitle(title or diagnose(records).verdict, fontsize=9, wrap=True)
    fig.tight_layout()
    return fig
