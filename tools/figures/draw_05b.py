"""Draw notebook 05b's design figures into notebooks/figures/ (reruns give identical files).

    python tools/figures/draw_05b.py

05b_three_policies.svg: one asynchronous step's three policies on a timeline of versions (the
behaviour that sampled at version v, the proximal policy: the trainer's weights when the batch
arrives at v + k, the current policy being updated), and where each objective's clip band sits:
around the behaviour (the clip alone) or around the proximal policy (TIS, MIS, decoupled).
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

plt.rcParams["svg.hashsalt"] = "grpo_lab"
plt.rcParams["font.size"] = 12
FIGURES = Path(__file__).resolve().parents[2] / "notebooks" / "figures"

# Okabe-Ito: safe for every common colour-vision deficiency
BLUE, ORANGE, GREEN, PINK, GREY = "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#555555"
LIGHT = {"blue": "#D6E9F5", "orange": "#FBEBC8", "green": "#D2EFE6", "pink": "#F3DDEA",
         "grey": "#EEEEEE"}


def box(ax, x, y, w, h, text, face, edge=GREY, size=11.5, weight="normal"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.1",
                                facecolor=face, edgecolor=edge, lw=1.4))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", size=size, weight=weight)


def arrow(ax, start, end, colour=GREY, curve=0.0, style="-|>"):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle=style, mutation_scale=16, lw=1.6,
                                 color=colour, connectionstyle=f"arc3,rad={curve}"))


def draw_three_policies(path: Path) -> None:
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7.6),
                                      gridspec_kw={"height_ratios": [1.2, 1]})
    # ---- the timeline: trainer versions v .. v + k + 1
    top.set_xlim(0, 12)
    top.set_ylim(0, 4.3)
    top.axis("off")
    top.text(0.1, 4.05, "One asynchronous step: which weights each log-probability comes from",
             size=13, weight="bold", color=GREY)
    xs = {"v": 1.6, "v+1": 3.6, "...": 5.3, "v+k": 7.6, "v+k+1": 10.6}
    top.annotate("", (11.8, 0.55), (0.3, 0.55),
                 arrowprops=dict(arrowstyle="-|>", color=GREY, lw=1.4))
    top.text(11.8, 0.8, "trainer version", ha="right", size=10.5, color=GREY)
    for label, x in xs.items():
        top.plot([x, x], [0.45, 0.65], color=GREY, lw=1.4)
        top.text(x, 0.15, label, ha="center", size=12, color=GREY)
    box(top, 0.35, 2.6, 2.6, 1.1, "behaviour $\\mu$\nweights of version v\nsample the tokens",
        LIGHT["orange"], edge=ORANGE)
    box(top, 6.2, 2.6, 2.8, 1.1, "proximal $\\pi_{prox}$\nthe trainer at v + k,\n"
        "no-grad forward", LIGHT["blue"], edge=BLUE)
    box(top, 9.25, 2.6, 2.6, 1.1, "current $\\pi_\\theta$\nv + k, with gradients\n"
        "-> becomes v + k + 1", LIGHT["green"], edge=GREEN)
    arrow(top, (2.95, 3.15), (6.15, 3.15), ORANGE)
    top.text(4.55, 3.3, "tokens + log $\\mu$ (batch.old_logps)", ha="center", size=10.5,
             color=GREY)
    top.text(4.55, 2.8, "staleness k versions", ha="center", size=10.5, color=GREY,
             style="italic")
    arrow(top, (9.0, 3.15), (9.2, 3.15), BLUE)
    for x, colour in ((1.6, ORANGE), (7.6, BLUE), (10.6, GREEN)):
        top.plot([x, x], [0.7, 2.55], color=colour, lw=1.2, ls=":")
    top.text(7.6, 1.9, "equal in value at the first update\n(num_iterations = 1);\n"
             "only $\\pi_\\theta$ carries the gradient", ha="center", size=10, color=GREY,
             bbox=dict(facecolor="white", edgecolor="none"))
    # ---- the clip bands, on the probability of one sampled token
    bottom.set_xlim(0, 12)
    bottom.set_ylim(-0.2, 3.2)
    bottom.axis("off")
    bottom.text(0.1, 2.95, "Where the clip band [1 - eps, 1 + eps] sits (eps = 0.2), for one "
                "sampled token", size=13, weight="bold", color=GREY)
    mu, prox = 6.0, 8.6  # the token's probability under the behaviour and the proximal policy
    rows = ((1.85, "clip alone", "(TRL's async default)", "$r = \\pi_\\theta / \\mu$",
             ORANGE, LIGHT["orange"], mu, "band around $\\mu$: $\\pi_{prox}$ may already be "
             "outside it"),
            (0.55, "TIS, MIS, decoupled", "clip around $\\pi_{prox}$, times a weight",
             "$r' = \\pi_\\theta / \\pi_{prox}$,  $w = \\pi_{prox} / \\mu$", BLUE, LIGHT["blue"],
             prox, "band around $\\pi_{prox}$; $w$ truncated or masked"))
    for y, name, sub, ratio, colour, face, centre, note in rows:
        bottom.text(0.1, y + 0.3, name, size=11.5, weight="bold", color=colour)
        bottom.text(0.1, y - 0.05, sub, size=10, color=GREY)
        bottom.text(0.1, y - 0.4, ratio, size=11)
        bottom.annotate("", (11.9, y), (4.0, y),
                        arrowprops=dict(arrowstyle="-|>", color=GREY, lw=1.0))
        half = 0.2 * centre / 2  # +-20 % of the centre's probability, on a linear scale
        bottom.add_patch(Rectangle((centre - half, y - 0.18), 2 * half, 0.36, facecolor=face,
                                   edgecolor=colour, lw=1.4))
        for x, text, c in ((mu, "$\\mu$", ORANGE), (prox, "$\\pi_{prox}$", BLUE)):
            bottom.plot([x, x], [y - 0.25, y + 0.25], color=c, lw=2.2)
            bottom.text(x, y - 0.55, text, ha="center", size=11.5, color=c)
        bottom.text(7.9, y + 0.4, note, ha="center", size=10, color=GREY)
    bottom.annotate("", (prox - 0.1, 0.3), (mu + 0.1, 0.3),
                    arrowprops=dict(arrowstyle="-|>", color=PINK, lw=1.6))
    bottom.text((mu + prox) / 2, 0.05, "$w$", ha="center", size=11.5, color=PINK)
    bottom.text(11.9, -0.2, "token probability", ha="right", size=10, color=GREY)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    FIGURES.mkdir(parents=True, exist_ok=True)
    draw_three_policies(FIGURES / "05b_three_policies.svg")
    print("wrote", FIGURES / "05b_three_policies.svg")
