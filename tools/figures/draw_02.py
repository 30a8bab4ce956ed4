"""Draw notebook 02's design figure into notebooks/figures/ (reruns give identical files).

    python tools/figures/draw_02.py

02_lora.svg: a LoRA adapter on one linear layer, W + (alpha / r) B A: the frozen weight W
(d x k), the trained B (d x r, zero at the start) and A (r x k), the scale alpha / r; and the
adapter's size against the tiny model's (the counts of notebook 02's model).
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import Rectangle

plt.rcParams["svg.hashsalt"] = "grpo_lab"
plt.rcParams["font.size"] = 12
FIGURES = Path(__file__).resolve().parents[2] / "notebooks" / "figures"

# Okabe-Ito: safe for every common colour-vision deficiency
BLUE, ORANGE, GREEN, GREY = "#0072B2", "#E69F00", "#009E73", "#555555"
LIGHT = {"blue": "#D6E9F5", "orange": "#FBEBC8", "green": "#D2EFE6", "grey": "#E4E4E4"}

# The tiny model of notebooks 00-03 (hidden 128, MLP 512, 4 layers: 28 adapted linear layers)
MODEL_PARAMETERS = 1_052_544
ADAPTER_PARAMETERS = {1: 11_776, 8: 94_208}  # r * (in + out), summed over the 28 layers


def matrix(ax, x, y, w, h, name, shape, face, edge, note):
    ax.add_patch(Rectangle((x, y), w, h, facecolor=face, edgecolor=edge, lw=1.8))
    ax.text(x + w / 2, y + h / 2, name, ha="center", va="center", size=20, weight="bold",
            color=edge)
    ax.text(x + w / 2, y - 0.18, shape, ha="center", va="top", size=11.5, color=GREY)
    ax.text(x + w / 2, y - 0.55, note, ha="center", va="top", size=10.5, color=edge)


def draw_lora(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(12, 6.6))
    ax.set_xlim(0, 12)
    ax.set_ylim(-2.9, 4.6)
    ax.axis("off")
    ax.text(6, 4.25, "one adapted linear layer:  $h = W x + \\frac{\\alpha}{r}\\, B A\\, x$",
            ha="center", size=15)

    # W: d x k (out x in), frozen; drawn as up_proj's 512 x 128 would be, scaled down
    matrix(ax, 0.4, 0.3, 2.6, 3.3, "W", "d x k  (e.g. 512 x 128)", LIGHT["grey"], GREY,
           "frozen: d k = 65,536\nno gradient, no optimizer state")
    ax.text(3.55, 1.95, "+", ha="center", va="center", size=30, color=GREY)
    ax.text(4.55, 1.95, "$\\frac{\\alpha}{r}$", ha="center", va="center", size=26, color=ORANGE)
    ax.text(4.55, 1.0, "scale\n(alpha = 2 r here:\nalways 2)", ha="center", va="top", size=10.5,
            color=ORANGE)
    ax.text(5.25, 1.95, "x", ha="center", va="center", size=18, color=GREY)
    # B: d x r, starts at zero; A: r x k, starts random
    matrix(ax, 5.75, 0.3, 0.45, 3.3, "B", "d x r", LIGHT["green"], GREEN,
           "trained\nstarts at 0")
    ax.text(6.65, 1.95, "x", ha="center", va="center", size=18, color=GREY)
    matrix(ax, 7.1, 1.65, 2.6, 0.6, "A", "r x k", LIGHT["green"], GREEN,
           "trained, starts random")
    ax.text(10.95, 2.7, "trained:\nr (d + k)\n= 640 at r = 1", ha="center", va="center",
            size=12, color=GREEN, weight="bold")
    ax.text(10.95, 1.25, "B = 0 at the start:\nthe adapted model\nstarts as the base",
            ha="center", va="center", size=10.5, color=GREY)

    # sizes: the whole model against the adapters, on one scale
    left, full = 3.2, 8.4
    ax.text(left - 0.15, -1.45, "the tiny model", ha="right", va="center", size=11.5)
    ax.add_patch(Rectangle((left, -1.65), full, 0.4, facecolor=LIGHT["grey"], edgecolor=GREY))
    ax.text(left + full / 2, -1.45, f"{MODEL_PARAMETERS:,} parameters", ha="center",
            va="center", size=11)
    for row, (rank, count) in enumerate(ADAPTER_PARAMETERS.items()):
        y = -2.15 - 0.5 * row
        share = count / MODEL_PARAMETERS
        ax.text(left - 0.15, y + 0.2, f"rank-{rank} adapter", ha="right", va="center", size=11.5)
        ax.add_patch(Rectangle((left, y), full * share, 0.4, facecolor=GREEN, edgecolor=GREEN))
        ax.text(left + full * share + 0.12, y + 0.2,
                f"{count:,} ({share:.1%}), on all 28 linear layers but lm_head",
                ha="left", va="center", size=11, color=GREEN)
    fig.savefig(path, bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    FIGURES.mkdir(parents=True, exist_ok=True)
    draw_lora(FIGURES / "02_lora.svg")
