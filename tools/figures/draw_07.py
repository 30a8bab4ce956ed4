"""Draw notebook 07's design figures into notebooks/figures/ (reruns give identical files).

    python tools/figures/draw_07.py

07_jobs_local_and_hf.svg: the recipe's jobs (N inference replicas, the proxy in front of them,
the trainer, the bucket carrying each adapter version), on the left as this notebook runs them
(processes on 127.0.0.1, a plain folder as the bucket) and on the right as the blog runs them on
Hugging Face Jobs (a job per replica with an exposed port behind a bearer token, the proxy inside
the trainer job, a Storage Bucket mounted at /lora in every job).
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

plt.rcParams["svg.hashsalt"] = "grpo_lab"
plt.rcParams["font.size"] = 11
FIGURES = Path(__file__).resolve().parents[2] / "notebooks" / "figures"

# Okabe-Ito: safe for every common colour-vision deficiency
BLUE, ORANGE, GREEN, PURPLE, GREY = "#0072B2", "#E69F00", "#009E73", "#CC79A7", "#444444"
LIGHT = {"replica": "#D6E9F5", "proxy": "#FBEBC8", "trainer": "#D2EFE6", "bucket": "#F5E1EC",
         "frame": "#F7F7F7"}


def box(ax, x, y, w, h, text, face, edge=GREY, size=11, weight="normal", dashed=False):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.15",
                                facecolor=face, edgecolor=edge, lw=1.4,
                                linestyle="--" if dashed else "-"))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", size=size, weight=weight,
                linespacing=1.25)


def arrow(ax, start, end, color=GREY, both=False, curve=0.0):
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="<|-|>" if both else "-|>",
                                 mutation_scale=15, lw=1.5, color=color,
                                 connectionstyle=f"arc3,rad={curve}"))


def label(ax, x, y, text, color=GREY, size=9.5, ha="center"):
    ax.text(x, y, text, ha=ha, va="center", size=size, color=color, linespacing=1.2,
            bbox=dict(facecolor="white", edgecolor="none", pad=1.0))


def panel(ax, title, subtitle, replica, proxy_in_trainer, trainer, bucket, links):
    """One side: replicas on the left, proxy and trainer on the right, the bucket below."""
    ax.set_xlim(0, 10)
    ax.set_ylim(0, 10.6)
    ax.axis("off")
    ax.text(5, 10.25, title, ha="center", va="center", size=13, weight="bold")
    ax.text(5, 9.65, subtitle, ha="center", va="center", size=10, color=GREY)
    # replicas: two drawn, the N-th implied
    for i, y in enumerate((7.1, 4.6)):
        box(ax, 0.1, y, 3.55, 1.85, replica.format(i=i), LIGHT["replica"], edge=BLUE, size=10)
    ax.text(1.85, 4.2, "...  N replicas", ha="center", va="center", size=10, color=BLUE)
    # proxy and trainer (on HF Jobs the proxy runs inside the trainer job)
    if proxy_in_trainer:
        box(ax, 5.0, 4.35, 4.85, 4.85, "", LIGHT["frame"], edge=GREEN, dashed=True)
        ax.text(7.42, 8.9, "trainer job (H200)", ha="center", va="center", size=10,
                color=GREEN, weight="bold")
    box(ax, 5.4, 6.6, 4.1, 1.9, "proxy\ngrpo-lab proxy\nroutes by prompt prefix",
        LIGHT["proxy"], edge=ORANGE, size=10)
    box(ax, 5.4, 4.6, 4.1, 1.55, trainer, LIGHT["trainer"], edge=GREEN, size=10)
    # the bucket
    box(ax, 0.9, 0.35, 8.2, 1.9, bucket, LIGHT["bucket"], edge=PURPLE, size=10)
    # requests: trainer -> proxy -> replicas
    arrow(ax, (7.45, 6.15), (7.45, 6.6), color=ORANGE)
    arrow(ax, (5.4, 7.9), (3.7, 8.0), color=ORANGE)
    arrow(ax, (5.4, 7.0), (3.7, 5.6), color=ORANGE)
    label(ax, 4.55, 6.45, links["route"], color=ORANGE, size=9)
    # adapters: trainer writes, replicas read
    arrow(ax, (7.45, 4.6), (7.45, 2.25), color=PURPLE)
    label(ax, 7.45, 3.35, "writes policy-vN,\ncheckpoints", color=PURPLE)
    arrow(ax, (2.4, 2.25), (2.4, 4.6), color=PURPLE)
    label(ax, 2.4, 3.35, links["mount"], color=PURPLE)


def draw_jobs(path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 6.6))
    fig.subplots_adjust(left=0.01, right=0.99, top=0.99, bottom=0.01, wspace=0.06)
    panel(left, "Locally (this notebook)", "one machine: a process per job, on 127.0.0.1",
          replica="replica-{i}\ngrpo-lab serve (or vLLM)\n127.0.0.1:<port>",
          proxy_in_trainer=False,
          trainer="trainer\ngrpo-lab train-async\n--resume",
          bucket="bucket: a plain folder, <run>/bucket/train/\nadapters/policy-vN, "
                 "checkpoints/step-S",
          links={"route": "requests,\nload\npolicy-vN", "mount": "reads the\nfolder"})
    panel(right, "On Hugging Face Jobs (the blog)", "a job per box, each on its own GPU",
          replica="replica-{i} job (H200)\nvllm serve\nexposed port, Bearer token",
          proxy_in_trainer=True,
          trainer="trainer\ngrpo-lab train-async\nrestarted with --resume",
          bucket="Storage Bucket hf://buckets/me/grpo-lora\nmounted at /lora in every job "
                 "(read-only on replicas)",
          links={"route": "HTTPS,\nBearer\nHF_TOKEN", "mount": "mount\n/lora"})
    fig.savefig(path, format="svg", metadata={"Date": None})
    plt.close(fig)


if __name__ == "__main__":
    FIGURES.mkdir(parents=True, exist_ok=True)
    draw_jobs(FIGURES / "07_jobs_local_and_hf.svg")
