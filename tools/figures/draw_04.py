"""Draw notebook 04's design figure: the rollout buffer, its version tags, the admission gate and
the drop path.

    python tools/figures/draw_04.py   # writes notebooks/figures/04_*.svg (identical on reruns)
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle  # noqa: E402

plt.rcParams["svg.hashsalt"] = "grpo_lab"
FIGURES = Path(__file__).resolve().parents[2] / "notebooks" / "figures"
# Okabe-Ito colours (colour-blind safe)
STAGE, GATE, DATA, WEIGHTS, DROP, GREY = "#E8E8E8", "#E69F00", "#0072B2", "#009E73", "#D55E00", \
    "#555555"


def box(ax, x, y, w, h, title, lines=(), face=STAGE):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                facecolor=face, edgecolor="#333333", linewidth=1.2))
    ax.text(x + w / 2, y + h - 0.2, title, ha="center", va="top", fontsize=12, fontweight="bold")
    for i, line in enumerate(lines):
        ax.text(x + w / 2, y + h - 0.6 - 0.3 * i, line, ha="center", va="top", fontsize=9,
                color=GREY, family="monospace")


def arrow(ax, start, end, color, text="", offset=(0, 0.12), rad=0.0, ha="center"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=16, color=color,
                                 linewidth=1.8, connectionstyle=f"arc3,rad={rad}"))
    if text:
        ax.text((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1], text,
                ha=ha, va="bottom", fontsize=9.5, color=color)


def draw_rollout_buffer(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(13, 5.6))
    ax.set(xlim=(0, 13), ylim=(0, 5.6))
    ax.axis("off")
    box(ax, 0.2, 2.2, 2.4, 1.6, "rollout worker", ("generate(v)", "score, advantages"))
    # the admission gate: the worker waits here until its batch will be fresh enough
    ax.add_patch(Rectangle((3.25, 2.0), 0.25, 2.0, facecolor=GATE, edgecolor="#333333"))
    ax.text(3.37, 4.15, "version gate\n(admission)", ha="center", va="bottom", fontsize=10,
            fontweight="bold")
    ax.text(3.37, 1.85, "batch j waits until\nversion >= j - max_staleness", ha="center",
            va="top", fontsize=9, color=GREY)
    arrow(ax, (2.65, 3.0), (3.2, 3.0), DATA)
    # the buffer: slots tagged with the version that generated them, oldest on the right
    x0, slot = 4.3, 0.78
    tags = [None, None, "v7", "v7", "v6", "v6", "v6", "v5"]  # newest enter on the left
    for i, tag in enumerate(tags):
        x = x0 + i * slot
        stale = tag == "v5"  # 2 versions behind the trainer's 7: past max_staleness = 1
        ax.add_patch(Rectangle((x, 2.55), slot - 0.08, 0.9, facecolor="white" if tag is None
                               else "#F6D3BF" if stale else "#CFE3F2",
                               edgecolor=DROP if stale else "#333333",
                               linewidth=2 if stale else 1))
        if tag:
            ax.text(x + slot / 2 - 0.04, 3.0, tag, ha="center", va="center", fontsize=11,
                    family="monospace")
    ax.text(x0 + 4 * slot, 3.7, "rollout buffer: 8 groups, each tagged with its version",
            ha="center", va="bottom", fontsize=11, fontweight="bold")
    ax.text(x0 + 4 * slot, 2.4, "newest  ...  oldest\nfull: put() blocks = backpressure",
            ha="center", va="top", fontsize=9, color=GREY)
    arrow(ax, (3.55, 3.0), (x0 - 0.05, 3.0), DATA, "put", offset=(0, 0.15))
    xb = x0 + len(tags) * slot
    box(ax, 11.0, 2.2, 1.8, 1.6, "trainer", ("version 7", "get -> train"))
    arrow(ax, (xb, 3.0), (10.95, 3.0), DATA, "get", offset=(0, 0.15))
    # publish: the trainer's new version opens the gate
    arrow(ax, (11.9, 3.85), (4.0, 4.45), WEIGHTS, rad=0.12)
    ax.text(7.7, 5.05, "publish v+1: the generator loads the new weights and the gate opens",
            ha="center", va="bottom", fontsize=10, color=WEIGHTS)
    # the drop path: too-stale groups leave the buffer at get() and are counted
    arrow(ax, (xb - 0.4, 2.5), (xb - 0.4, 1.05), DROP)
    box(ax, 8.6, 0.15, 3.6, 0.9, "dropped, counted", face="#F6D3BF")
    ax.text(10.4, 0.33, "sample/dropped_stale_total", ha="center", va="bottom", fontsize=9,
            family="monospace", color=GREY)
    ax.text(xb - 0.2, 1.75, "at get(): 7 - v > max_staleness (1)\n-> dropped, never trained on",
            ha="left",
            va="center", fontsize=9.5, color=DROP)
    fig.savefig(path, metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    FIGURES.mkdir(parents=True, exist_ok=True)
    draw_rollout_buffer(FIGURES / "04_rollout_buffer.svg")
