"""Draw notebook 08's design figure: where each of the five runs' knobs acts in the pipeline.

    python tools/figures/draw_08.py   # writes notebooks/figures/08_*.svg (identical on reruns)
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

plt.rcParams["svg.hashsalt"] = "grpo_lab"
FIGURES = Path(__file__).resolve().parents[2] / "notebooks" / "figures"
# Okabe-Ito colours (colour-blind safe)
STAGE, KNOB, METRIC, DATA, WEIGHTS = "#E8E8E8", "#E69F00", "#555555", "#0072B2", "#009E73"


def box(ax, x, y, w, h, title, lines=(), face=STAGE):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                facecolor=face, edgecolor="#333333", linewidth=1.2))
    ax.text(x + w / 2, y + h - 0.22, title, ha="center", va="top", fontsize=12,
            fontweight="bold")
    for i, line in enumerate(lines):
        ax.text(x + w / 2, y + h - 0.62 - 0.3 * i, line, ha="center", va="top", fontsize=9,
                color=METRIC, family="monospace")


def knob(ax, x, y, text):
    ax.text(x, y, text, ha="center", va="center", fontsize=10, color="black",
            bbox=dict(boxstyle="round,pad=0.35", facecolor=KNOB, edgecolor="none", alpha=0.9))


def arrow(ax, start, end, color, text="", offset=(0, 0.18), style="-|>", rad=0.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=16, color=color,
                                 linewidth=1.8, connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1], text,
                ha="center", va="bottom", fontsize=9, color=color)


def draw_pipeline_knobs(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(13, 6.2))
    ax.set(xlim=(0, 13), ylim=(0, 6.2))
    ax.axis("off")
    # the stages, data flowing right to left (replicas -> trainer)
    box(ax, 0.2, 2.6, 2.6, 1.9, "trainer", ("perf/step_s", "perf/fwd_bwd_s", "rollout_wait_s"))
    box(ax, 3.6, 2.6, 2.4, 1.9, "rollout buffer", ("queue_size / _maxsize", "staleness_mean"))
    box(ax, 6.7, 2.6, 2.8, 1.9, "rollout worker", ("HTTP client", "backpressure_total_s",
                                                   "version_wait_s"))
    box(ax, 10.1, 3.0, 1.0, 1.1, "proxy")
    box(ax, 11.6, 4.0, 1.3, 0.9, "replica-0")
    box(ax, 11.6, 2.2, 1.3, 0.9, "replica-1")
    box(ax, 4.9, 0.2, 3.2, 1.0, "adapter bucket", ("one folder per version",))
    # samples flow to the trainer; requests flow to the replicas
    arrow(ax, (3.6, 3.55), (2.85, 3.55), DATA, "samples")
    arrow(ax, (6.7, 3.55), (6.05, 3.55), DATA, "groups")
    arrow(ax, (9.55, 3.55), (10.05, 3.55), DATA, "HTTP", style="<|-|>")
    arrow(ax, (11.15, 3.75), (11.55, 4.35), DATA, style="<|-|>")
    arrow(ax, (11.15, 3.35), (11.55, 2.75), DATA, style="<|-|>")
    # weights: the trainer publishes a version, the replicas load it
    arrow(ax, (1.5, 2.55), (4.85, 0.7), WEIGHTS, rad=0.2)
    ax.text(3.75, 1.75, "publish a version", ha="center", fontsize=9, color=WEIGHTS)
    arrow(ax, (8.15, 0.7), (12.25, 2.15), WEIGHTS, rad=0.2)
    ax.text(11.6, 0.75, "each replica loads it", ha="center", fontsize=9, color=WEIGHTS)
    # where each run's knob acts
    knob(ax, 1.5, 5.1, "runs 1-2: token_budget\n(micro-batches per step)")
    knob(ax, 8.1, 5.1, "run 4: max_inflight\n(requests in flight)")
    knob(ax, 11.3, 5.75, "run 3: replicas (1 or 2)")
    knob(ax, 1.3, 0.75, "run 5: weight_sync_steps\n(publish every k steps)")
    knob(ax, 4.8, 5.1, "max_staleness\n(admission rule)")
    for x0, y0, x1, y1 in ((1.5, 4.75, 1.5, 4.5), (8.1, 4.75, 8.1, 4.5), (1.3, 1.1, 1.85, 2.05),
                           (11.3, 5.55, 11.3, 4.15), (4.8, 4.75, 4.8, 4.5)):
        ax.plot([x0, x1], [y0, y1], color=KNOB, linewidth=2)
    ax.text(6.5, 6.05, "data: right to left (blue); weights: trainer to replicas (green); "
            "knobs: orange", ha="center", fontsize=10, color=METRIC)
    FIGURES.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="svg", bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    draw_pipeline_knobs(FIGURES / "08_pipeline_knobs.svg")
