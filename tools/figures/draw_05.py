"""Draw notebook 05's design figure: one weight sync, the bucket's publish lifecycle as a
sequence of messages between the trainer, the bucket and a replica.

    python tools/figures/draw_05.py   # writes notebooks/figures/05_*.svg (identical on reruns)
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

plt.rcParams["svg.hashsalt"] = "grpo_lab"
FIGURES = Path(__file__).resolve().parents[2] / "notebooks" / "figures"
# Okabe-Ito colours (colour-blind safe)
STAGE, FILES, HTTP, DATA, GREY = "#E8E8E8", "#009E73", "#E69F00", "#0072B2", "#555555"
LANES = {"trainer": 1.6, "bucket (shared folder)": 6.5, "replica": 11.4}
SUBTITLES = {"trainer": "grpo_lab trainer", "bucket (shared folder)": "HF bucket / temp folder",
             "replica": "vLLM / grpo-lab serve"}


def message(ax, y, src, dst, text, color, note=""):
    """One message from lane `src` to lane `dst` at height y (a self-message when equal)."""
    x0, x1 = LANES[src], LANES[dst]
    if x0 == x1:
        ax.add_patch(FancyArrowPatch((x0 + 0.05, y + 0.12), (x0 + 0.05, y - 0.12),
                                     arrowstyle="-|>", mutation_scale=12, color=color,
                                     linewidth=1.6, connectionstyle="arc3,rad=-1.6"))
        ax.text(x0 + 0.45, y, text, ha="left", va="center", fontsize=9.5, color=color)
    else:
        ax.add_patch(FancyArrowPatch((x0, y), (x1, y), arrowstyle="-|>", mutation_scale=14,
                                     color=color, linewidth=1.6))
        ax.text((x0 + x1) / 2, y + 0.06, text, ha="center", va="bottom", fontsize=9.5,
                color=color, family="monospace" if text[:1] in "/.pP" else None,
                bbox=dict(facecolor="white", edgecolor="none", pad=0.5))
    if note:
        ax.text((x0 + x1) / 2 if x0 != x1 else x0 + 0.45, y - 0.08, note, ha="center"
                if x0 != x1 else "left", va="top", fontsize=8.5, color=GREY,
                bbox=dict(facecolor="white", edgecolor="none", pad=0.5))


def draw_weight_sync(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(13, 8.2))
    ax.set(xlim=(0, 13), ylim=(0, 8.2))
    ax.axis("off")
    for name, x in LANES.items():
        ax.add_patch(FancyBboxPatch((x - 1.45, 7.35), 2.9, 0.75, facecolor=STAGE,
                                    boxstyle="round,pad=0.02,rounding_size=0.1",
                                    edgecolor="#333333"))
        ax.text(x, 7.85, name, ha="center", va="center", fontsize=11.5, fontweight="bold")
        ax.text(x, 7.55, SUBTITLES[name], ha="center", va="center", fontsize=9, color=GREY)
        ax.plot([x, x], [0.3, 7.35], color="#999999", linewidth=1, linestyle="--", zorder=0)
    steps = [
        ("trainer", "trainer", "1. optimizer step -> version 7", DATA, ""),
        ("trainer", "bucket (shared folder)", ".policy-v7.tmp-3f2a/", FILES,
         "2. save the adapter under a hidden temp name"),
        ("trainer", "bucket (shared folder)", "chmod a+r", FILES,
         "3. readable by a server running as another user"),
        ("trainer", "bucket (shared folder)", "rename -> policy-v7/", FILES,
         "4. publish: one atomic rename (all or nothing)"),
        ("trainer", "replica", "/pause (keep in-flight)", HTTP, ""),
        ("trainer", "replica", "/v1/load_lora_adapter policy-v7", HTTP,
         "5. load by path under a NEW name"),
        ("replica", "bucket (shared folder)", "read policy-v7/", FILES,
         "on a mount: retry 'No adapter found' until it appears"),
        ("trainer", "replica", "/resume", HTTP, ""),
        ("trainer", "replica", "unload policy-v5", HTTP,
         "6. drop versions older than max_staleness + 1; prune the bucket"),
        ("trainer", "replica", "/v1/completions model=policy-v7", DATA,
         "7. serve under the new name: samples tagged version 7"),
    ]
    y = 6.95
    for src, dst, text, color, note in steps:
        message(ax, y, src, dst, text, color, note)
        y -= 0.68
    fig.savefig(path, metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    FIGURES.mkdir(parents=True, exist_ok=True)
    draw_weight_sync(FIGURES / "05_weight_sync.svg")
