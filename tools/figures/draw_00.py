"""Draw notebook 00's design figures into notebooks/figures/ (reruns give identical files).

    python tools/figures/draw_00.py

00_grpo_loop.svg: the GRPO loop with one worked group of G = 4 completions of "07+45=":
sample, score, group-relative advantages, clipped update, and back to the policy.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

plt.rcParams["svg.hashsalt"] = "grpo_lab"
plt.rcParams["font.size"] = 12
FIGURES = Path(__file__).resolve().parents[2] / "notebooks" / "figures"

# Okabe-Ito: safe for every common colour-vision deficiency
BLUE, ORANGE, GREEN, GREY = "#0072B2", "#E69F00", "#009E73", "#555555"
LIGHT = {"blue": "#D6E9F5", "orange": "#FBEBC8", "green": "#D2EFE6", "grey": "#EEEEEE"}


def box(ax, x, y, w, h, text, face, edge=GREY, size=12, weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.12",
                                facecolor=face, edgecolor=edge, lw=1.4))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", size=size, weight=weight)


def arrow(ax, start, end, text="", style="-|>", curve=0.0, dy=0.18):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=18, lw=1.6,
                                 color=GREY, connectionstyle=f"arc3,rad={curve}"))
    if text:
        ax.text((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + dy, text, ha="center",
                va="bottom", size=10.5, color=GREY)


def draw_grpo_loop(path: Path) -> None:
    completions = ["052", "52", "053", "052"]  # G = 4 samples of the prompt "07+45=" (answer 052)
    rewards = [1, 0, 0, 1]
    mean = sum(rewards) / len(rewards)
    std = (sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) ** 0.5  # unbiased, as TRL
    advantages = [(r - mean) / std for r in rewards]

    fig, ax = plt.subplots(figsize=(12, 6.2))
    ax.set_xlim(0, 12)
    ax.set_ylim(-1.0, 5.4)
    ax.axis("off")

    # stage headers, the four stages of a GRPO step
    for x, text in ((2.55, "1. sample G = 4"), (5.05, "2. score"), (6.75, "3. advantages"),
                    (9.9, "4. clipped update")):
        ax.text(x, 5.05, text, ha="center", size=12.5, weight="bold", color=GREY)

    # the prompt goes into the policy, which samples the group's G completions
    box(ax, 0.2, 3.95, 1.3, 0.75, "prompt\n'07+45='", LIGHT["grey"], size=11)
    arrow(ax, (0.85, 3.92), (0.85, 3.6))
    box(ax, 0.1, 2.45, 1.5, 1.1, "policy $\\pi_\\theta$\n(the tiny\nmodel)", LIGHT["grey"],
        weight="bold")

    # the group: one row per completion, with its reward and advantage
    row_h, top = 0.78, 3.55
    ax.text(2.6, top + 0.12, "completion $o_i$", ha="center", size=10.5, color=GREY)
    ax.text(5.05, top + 0.12, "reward $r_i$", ha="center", size=10.5, color=GREY)
    ax.text(6.75, top + 0.12, "advantage $A_i$", ha="center", size=10.5, color=GREY)
    for i, (text, r, a) in enumerate(zip(completions, rewards, advantages)):
        y = top - (i + 1) * row_h
        right = r == 1
        face = LIGHT["blue"] if right else LIGHT["orange"]
        box(ax, 2.0, y, 1.2, 0.6, f"'{text}'", face, size=12)
        box(ax, 4.55, y, 1.0, 0.6, f"{r}", face, size=12)
        box(ax, 6.1, y, 1.3, 0.6, f"{a:+.2f}", face, size=12, weight="bold")
        arrow(ax, (3.25, y + 0.3), (4.5, y + 0.3), "right" if right else "wrong", dy=0.02)
        arrow(ax, (5.6, y + 0.3), (6.05, y + 0.3))
        arrow(ax, (7.45, y + 0.3), (8.4, 2.2 + 0.25 * (3 - i)), curve=0.0)
        arrow(ax, (1.62, 3.3 - 0.22 * i), (1.97, y + 0.3))  # the policy samples each one
    ax.text(6.75, 0.33, f"$A_i = (r_i - \\mathrm{{mean}})/\\mathrm{{std}}$ over the group:\n"
            f"mean {mean:.2f}, std {std:.2f}", ha="center", va="top", size=10.5)

    box(ax, 8.45, 1.55, 3.45, 2.1,
        "per token $t$ of $o_i$:\n"
        "$\\ell = -\\min(\\rho A_i,\\ \\mathrm{clip}(\\rho, 0.8, 1.2)\\, A_i)$\n"
        "$\\rho = \\pi_\\theta / \\pi_{old}$ (1 on the first update)\n\n"
        "'052' made likelier ($A > 0$),\n'52' and '053' less likely ($A < 0$)",
        LIGHT["green"], size=10.5)
    # the loop: the updated policy samples the next step's prompts
    ax.plot([10.2, 10.2, 0.85], [1.5, -0.55, -0.55], color=GREY, lw=1.6)
    arrow(ax, (0.85, -0.55), (0.85, 2.4))
    ax.text(5.5, -0.62, "the updated policy samples the next step's prompts", ha="center",
            va="top", size=11, color=GREY)
    fig.savefig(path, metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    FIGURES.mkdir(parents=True, exist_ok=True)
    draw_grpo_loop(FIGURES / "00_grpo_loop.svg")
    print("wrote", FIGURES / "00_grpo_loop.svg")
