"""Draw notebook 06's design figures into notebooks/figures/ (reruns give identical files).

    python tools/figures/draw_06.py

06_block_hashes.svg: the KV block hash chain of two prompts that share their first block: each
full block's hash is H(parent hash, its tokens, extra keys with the adapter's `lora_name`), as
vLLM computes it; the tail (no full block) is never cached.
06_routing_decision.svg: how the proxy's router picks a replica for one request: affinity (the
longest specific cached prefix), spill (that replica is too loaded), unmatched (least loaded,
ties round robin).
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
BLUE, ORANGE, GREEN, PINK, GREY = "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#555555"
LIGHT = {"blue": "#D6E9F5", "orange": "#FBEBC8", "green": "#D2EFE6", "pink": "#F3DDEA",
         "grey": "#EEEEEE"}


def box(ax, x, y, w, h, text, face, edge=GREY, size=11.5, weight="normal", ls="-"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.08",
                                facecolor=face, edgecolor=edge, lw=1.4, ls=ls))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", size=size, weight=weight)


def arrow(ax, start, end, text="", colour=GREY, curve=0.0, size=10.5, offset=(0, 0.12)):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=16, lw=1.5,
                                 color=colour, connectionstyle=f"arc3,rad={curve}"))
    if text:
        ax.text((start[0] + end[0]) / 2 + offset[0], (start[1] + end[1]) / 2 + offset[1], text,
                ha="center", va="bottom", size=size, color=colour)


def draw_block_hashes(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(12, 6.0))
    ax.set_xlim(0, 12)
    ax.set_ylim(-0.7, 5.6)
    ax.axis("off")
    ax.text(0.1, 5.3, "Blocks of 2 tokens (vLLM: 16), each named by a chained hash", size=13,
            weight="bold", color=GREY)
    blocks1, blocks2 = ["<bos> 5", "3 +", "0 5"], ["<bos> 5", "7 +", "0 5"]
    xs = [1.9, 4.9, 7.9]
    for row, (y, name, blocks, tail) in enumerate(((3.6, "prompt 1\n'53+05='", blocks1, "="),
                                                   (0.9, "prompt 2\n'57+05='", blocks2, "="))):
        ax.text(0.1, y + 0.3, name, va="center", size=11.5, weight="bold")
        for i, (x, tokens) in enumerate(zip(xs, blocks)):
            shared = i == 0
            face = LIGHT["green"] if shared else (LIGHT["blue"] if row == 0 else LIGHT["orange"])
            box(ax, x, y, 1.6, 0.6, tokens, face, size=12)
            parent = "seed" if i == 0 else f"h{i}" + ("" if row == 0 or i == 1 else "'")
            label = f"h{i + 1}" + ("" if shared or row == 0 else "'")
            ax.text(x + 0.8, y + (0.85 if row == 0 else -0.45),
                    f"{label} = H({parent}, tokens, lora)", ha="center", size=10, color=GREY)
            if i:
                arrow(ax, (xs[i - 1] + 1.62, y + 0.3), (x - 0.02, y + 0.3))
        box(ax, 10.9, y, 0.8, 0.6, tail, LIGHT["grey"], ls="--", size=12)
        ax.text(11.3, y + (0.85 if row == 0 else -0.45), "tail: never\ncached", ha="center",
                va="center", size=9.5, color=GREY)
    ax.text(2.7, 2.55, "shared: h1 is the same\nfor both prompts", ha="center", va="center",
            size=10.5, color=GREEN, weight="bold")
    ax.text(8.7, 2.55, "same tokens '0 5', different hash:\nh3 names the whole prefix",
            ha="center", va="center", size=10.5, color=GREY)
    ax.text(6.0, -0.55, "lora = the adapter's lora_name, in every block's extra hash keys: under "
            "policy-v2 no hash equals policy-v1's", ha="center", size=10.5, color=PINK)
    fig.savefig(path, metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


def draw_routing_decision(path: Path) -> None:
    fig, ax = plt.subplots(figsize=(12, 5.4))
    ax.set_xlim(0, 12)
    ax.set_ylim(0, 5.4)
    ax.axis("off")
    box(ax, 0.1, 3.9, 2.6, 1.1, "a request:\nprompt tokens\n+ adapter name", LIGHT["grey"])
    box(ax, 3.4, 3.9, 3.2, 1.1, "block hashes;\nspecific match per replica\n"
        "(blocks beyond the common)", LIGHT["grey"])
    box(ax, 3.4, 1.9, 3.2, 1.1, "any replica with a\nspecific match?", LIGHT["grey"],
        weight="bold")
    box(ax, 7.5, 3.9, 4.3, 1.1, "best match's replica more than\n`imbalance` requests busier "
        "than\nthe least loaded one?", LIGHT["grey"], weight="bold")
    box(ax, 7.5, 1.9, 2.0, 1.1, "affinity\nthe best match", LIGHT["green"], edge=GREEN,
        weight="bold")
    box(ax, 9.8, 1.9, 2.0, 1.1, "spill\nleast loaded", LIGHT["orange"], edge=ORANGE,
        weight="bold")
    box(ax, 3.4, 0.1, 3.2, 1.1, "unmatched\nleast loaded\n(ties: round robin)", LIGHT["blue"],
        edge=BLUE, weight="bold")
    arrow(ax, (2.75, 4.45), (3.35, 4.45))
    arrow(ax, (5.0, 3.85), (5.0, 3.05))
    arrow(ax, (5.0, 1.85), (5.0, 1.25), "no", offset=(0.3, -0.15))
    arrow(ax, (6.65, 2.6), (7.6, 3.85), "yes", offset=(-0.25, 0.0))
    arrow(ax, (8.5, 3.85), (8.5, 3.05), "no", offset=(-0.3, -0.15))
    arrow(ax, (10.8, 3.85), (10.8, 3.05), "yes", offset=(0.35, -0.15))
    ax.text(7.5, 0.75, "affinity: the prompt's KV is reused there\n"
            "spill: one prompt's prefill again, no queue\n"
            "unmatched: nobody holds it (1 in G of a group)", size=10.5, color=GREY,
            va="center")
    fig.savefig(path, metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    FIGURES.mkdir(parents=True, exist_ok=True)
    for name, draw in (("06_block_hashes.svg", draw_block_hashes),
                       ("06_routing_decision.svg", draw_routing_decision)):
        draw(FIGURES / name)
        print("wrote", FIGURES / name)
