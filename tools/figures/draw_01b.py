"""Draw notebook 01b's design figures into notebooks/figures/ (reruns give identical files).

    python tools/figures/draw_01b.py

01b_kl_directions.svg: the two directions of the KL on an 8-token toy vocabulary. The reference
has two bumps; the policy may have only one (a discretised bell, its centre and width free).
The bell closest to the reference under KL(pi || pi_ref) sits on one bump (mode-seeking); under
KL(pi_ref || pi) it spreads over both (mass-covering). k3 used as a loss descends the second;
weighted by the ratio (TRL's bias correction) it descends the first.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

plt.rcParams["svg.hashsalt"] = "grpo_lab"
plt.rcParams["font.size"] = 12
FIGURES = Path(__file__).resolve().parents[2] / "notebooks" / "figures"
BLUE, VERMILLION, GREY = "#0072B2", "#D55E00", "#999999"

TOKENS = np.arange(8)
REFERENCE = np.array([0.02, 0.27, 0.34, 0.02, 0.005, 0.025, 0.30, 0.02])  # two bumps, sums to 1


def bell(centre: float, width: float) -> np.ndarray:
    """A one-bump distribution over the 8 tokens: softmax of -(k - centre)^2 / (2 width^2)."""
    logits = -((TOKENS - centre) ** 2) / (2 * width**2)
    p = np.exp(logits - logits.max())
    return p / p.sum()


def kl(p: np.ndarray, q: np.ndarray) -> float:
    return float((p * np.log(p / q)).sum())


def closest_bell(direction: str) -> tuple[np.ndarray, float]:
    """The bell minimising KL(bell || ref) ("reverse") or KL(ref || bell) ("forward"), by a grid
    search over centre and width; returns it and its KL."""
    best = None
    for centre in np.arange(0.0, 7.01, 0.05):
        for width in np.arange(0.3, 6.01, 0.05):
            p = bell(centre, width)
            value = kl(p, REFERENCE) if direction == "reverse" else kl(REFERENCE, p)
            if best is None or value < best[1]:
                best = (p, value)
    return best


def draw_kl_directions(path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    panels = (("reverse", VERMILLION, r"min KL($\pi_\theta\,\|\,\pi_{ref}$): mode-seeking",
               "the objective's KL; ratio x k3 (TRL) descends it"),
              ("forward", BLUE, r"min KL($\pi_{ref}\,\|\,\pi_\theta$): mass-covering",
               "what k3 alone descends (grpo_lab's default)"))
    for ax, (direction, color, title, note) in zip(axes, panels):
        policy, value = closest_bell(direction)
        ax.bar(TOKENS - 0.2, REFERENCE, 0.4, color=GREY, label=r"reference $\pi_{ref}$ (two bumps)")
        ax.bar(TOKENS + 0.2, policy, 0.4, color=color, label=r"closest one-bump $\pi_\theta$")
        ax.set_title(f"{title}\n{note}", size=12)
        ax.set_xticks(TOKENS, [f"token {k}" for k in TOKENS], size=9)
        ax.text(0.02, 0.97, f"KL at the optimum: {value:.2f}", transform=ax.transAxes,
                va="top", size=10.5)
        ax.legend(loc="upper right", fontsize=9.5)
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("probability")
    axes[0].set_ylim(0, 0.62)
    fig.tight_layout()
    fig.savefig(path, metadata={"Date": None}, bbox_inches="tight")
    plt.close(fig)


if __name__ == "__main__":
    FIGURES.mkdir(parents=True, exist_ok=True)
    draw_kl_directions(FIGURES / "01b_kl_directions.svg")
    print("wrote", FIGURES / "01b_kl_directions.svg")
