"""Draw notebook 03's design figure into notebooks/figures/ (reruns give identical files).

    python tools/figures/draw_03.py

03_two_trainers.svg: one GRPO step, stage by stage, and the setting that controls each stage in
grpo_lab's GRPOConfig (left) and in TRL's GRPOConfig (right), as notebook 03 sets them to run
the same loop.
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

# (stage, grpo_lab's setting, TRL's setting), in the order a step runs them
STAGES = [
    ("prompts", "task.sample_batch(Random(seed))\n16 per step",
     "train_dataset (the same draws)\nshuffle_dataset=False"),
    ("sample G completions", "num_generations=8\nmax_completion_length\n(answer + 2)",
     "num_generations=8\nmax_completion_length=5"),
    ("reward", "exact_match_reward", "reward_funcs=exact_match_reward\n(the same function)"),
    ("advantages", "scale_rewards=True", "scale_rewards=\"group\""),
    ("clipped loss", "loss_type=\"grpo\"\nepsilon_low, epsilon_high",
     "loss_type=\"grpo\"\nepsilon, epsilon_high"),
    ("AdamW update of\nthe LoRA adapter", "learning_rate=1e-3\n(constant)\nlora_rank=1",
     "learning_rate=1e-3\nlr_scheduler_type=\"constant\"\npeft_config=LoraConfig(r=1)"),
]


def box(ax, x, y, w, h, text, face, edge=GREY, size=11, weight="normal", family=None):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.1",
                                facecolor=face, edgecolor=edge, lw=1.3))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", size=size, weight=weight,
            family=family)


def draw_two_trainers(path: Path) -> None:
    rows = len(STAGES)
    fig, ax = plt.subplots(figsize=(12, 1.05 * rows + 1.3))
    ax.set_xlim(0, 12)
    ax.set_ylim(-0.2, 1.05 * rows + 0.9)
    ax.axis("off")
    top = 1.05 * rows
    ax.text(2.0, top + 0.45, "grpo_lab GRPOConfig", ha="center", size=13, weight="bold",
            color=BLUE)
    ax.text(6.0, top + 0.45, "one GRPO step", ha="center", size=13, weight="bold", color=GREY)
    ax.text(10.0, top + 0.45, "TRL GRPOConfig", ha="center", size=13, weight="bold",
            color=ORANGE)
    for k, (stage, ours, theirs) in enumerate(STAGES):
        y = top - 1.05 * (k + 1) + 0.1
        box(ax, 4.75, y, 2.5, 0.8, stage, LIGHT["grey"], weight="bold")
        box(ax, 0.1, y, 3.8, 0.8, ours, LIGHT["blue"], BLUE, size=10, family="monospace")
        box(ax, 8.1, y, 3.8, 0.8, theirs, LIGHT["orange"], ORANGE, size=10, family="monospace")
        for start, end in (((3.95, y + 0.4), (4.7, y + 0.4)), ((8.05, y + 0.4), (7.3, y + 0.4))):
            ax.add_patch(FancyArrowPatch(start, end, arrowstyle="-|>", mutation_scale=14,
                                         lw=1.3, color=GREY))
        if k:
            ax.add_patch(FancyArrowPatch((6.0, y + 1.03), (6.0, y + 0.82), arrowstyle="-|>",
                                         mutation_scale=14, lw=1.3, color=GREY))
    fig.savefig(path, bbox_inches="tight", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    FIGURES.mkdir(parents=True, exist_ok=True)
    draw_two_trainers(FIGURES / "03_two_trainers.svg")
