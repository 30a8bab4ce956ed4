"""Healthy against broken runs, read and drawn from their step records (notebook 10).

A failure rarely shows in `reward` alone: its signature is in the other columns of a run's
records (docs/metrics.md). `plot_failures` draws several runs side by side, one panel per
metric (by default the four signs of a dead run: reward, entropy, clipped completions,
zero-signal groups); `late` and `first_step_over` read one number from a run; `plot_adam_drift`
shows why a run whose gradient vanished keeps moving: Adam's momentum decays slowly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from grpo_lab.watch.metrics import series

SIGNS = ("reward", "entropy", "completions/clipped_ratio", "frac_reward_zero_std")
"""The metrics that tell a healthy run from a dead one: a dead run's completions all hit the cap
(`clipped_ratio` 1), its groups all score alike (`frac_reward_zero_std` near 1), its entropy
moves far from the healthy run's (either way)."""


def step_records(records: Sequence[dict]) -> list[dict]:
    """The training steps of a run's records (those that carry a `reward`): evaluations and
    summaries left out."""
    return [r for r in records if "reward" in r]


def late(records: Sequence[dict], key: str, n: int = 5) -> float:
    """The mean of `key` over a run's last `n` training steps."""
    values = [r[key] for r in step_records(records) if key in r][-n:]
    if not values:
        raise KeyError(f"no step records with {key!r}")
    return sum(values) / len(values)


def run_mean(records: Sequence[dict], key: str) -> float:
    """The mean of `key` over all of a run's training steps."""
    return late(records, key, n=len(records))


def first_step_over(records: Sequence[dict], key: str, threshold: float) -> int | None:
    """The first training step whose `key` exceeds `threshold`; None if none does."""
    return next((r["step"] for r in step_records(records) if r.get(key, -math.inf) > threshold),
                None)


def run_line(label: str, records: Sequence[dict], keys: Sequence[str] = SIGNS) -> str:
    """One line per run: held-out accuracy first -> last (when evaluated), then the late mean
    of each of `keys`."""
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]
    shown = " ".join(f"{k.split('/')[-1]}={late(records, k):.2f}" for k in keys)
    held_out = f"held-out accuracy {accuracy[0]:.2f} -> {accuracy[-1]:.2f}; " if accuracy else ""
    return f"{label:>9}: {held_out}last 5 steps: {shown}"


def dynamic_sampling_cost(records: Sequence[dict], prompts_per_step: int) -> dict:
    """What a dynamic-sampling run paid and got (DAPO): `cost`, the groups generated per group
    trained; `zero_std_generated`, the share of the generated groups with no signal;
    `zero_std_trained`, the mean share left in the trained batch."""
    steps = [r for r in step_records(records) if "dynamic_sampling/generated_groups" in r]
    generated = sum(r["dynamic_sampling/generated_groups"] for r in steps)
    zero = sum(r["dynamic_sampling/zero_std_groups"] for r in steps)
    return {"cost": generated / (len(steps) * prompts_per_step),
            "zero_std_generated": zero / generated,
            "zero_std_trained": run_mean(steps, "frac_reward_zero_std")}


def draw_runs(ax, runs: dict[str, Sequence[dict]], key: str, title: str | None = None) -> None:
    """One metric of several runs against the step, one line per run."""
    for label, records in runs.items():
        xs, ys = series(step_records(records), key)
        ax.plot(xs, ys, label=label, marker="." if len(xs) < 4 else None)
    ax.set(xlabel="step", title=title or key)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def plot_failures(runs: dict[str, Sequence[dict]], keys: Sequence[str] = SIGNS,
                  references: dict[str, tuple[float, str]] | None = None):
    """Runs side by side (label -> step records), one panel per metric of `keys`.
    `references`: metric -> (value, label) of a dashed horizontal line (a cap, a target).
    Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        draw_runs(ax, runs, key)
        if references and key in references:
            value, label = references[key]
            ax.axhline(value, color="gray", ls="--", label=label)
            ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_lengths(lengths: Sequence[int], cap: int, cut_at: int):
    """A histogram of completion lengths (tokens) sampled at `cap`, with a line where a
    smaller cap `cut_at` would cut them. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.4))
    ax.hist(lengths, bins=range(0, cap + 2), rwidth=0.85)
    ax.axvline(cut_at + 0.5, color="tab:red", label=f"max_completion_length={cut_at}")
    ax.set(xlabel=f"completion length (tokens) at max_completion_length={cap}",
           ylabel="completions",
           title="the baseline's completion lengths")
    ax.legend()
    fig.tight_layout()
    return fig


def adam_drift(beta2: float, beta1: float = 0.9, lr: float = 1.0, pushed: int = 20,
               after: int = 60) -> list[float]:
    """The size of each of torch's AdamW updates to one weight given a gradient of 1 for `pushed`
    steps, then a gradient of 0 for `after` steps, relative to the last pushed update.
    With no gradient the update still shrinks only by about beta1 / sqrt(beta2) a step."""
    import torch

    weight = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.AdamW([weight], lr=lr, betas=(beta1, beta2), weight_decay=0.0)
    sizes = []
    for step in range(pushed + after):
        before = weight.detach().clone()
        weight.grad = torch.ones(1) if step < pushed else torch.zeros(1)
        optimizer.step()
        sizes.append(abs((weight.detach() - before).item()))
    return [s / sizes[pushed - 1] for s in sizes[pushed:]]


def half_life(beta2: float, beta1: float = 0.9) -> float:
    """Steps for Adam's update to halve once the gradient is 0: ln 2 / ln(sqrt(beta2) / beta1)."""
    return math.log(2) / math.log(math.sqrt(beta2) / beta1)


def plot_adam_drift(beta2s: Sequence[float] = (0.95, 0.999), beta1: float = 0.9,
                    after: int = 60):
    """`adam_drift` for each of `beta2s`: how long the weights keep moving once the gradient is
    0, with each curve's half-life in its label. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.4))
    for beta2 in beta2s:
        sizes = adam_drift(beta2, beta1, after=after)
        tenth = next((i + 1 for i, s in enumerate(sizes) if s <= 0.1), None)
        ax.plot(range(1, after + 1), sizes,
                label=f"beta2 = {beta2}: a tenth after {tenth} steps "
                      f"(halves every ~{half_life(beta2, beta1):.1f})")
    ax.axhline(0.1, color="gray", ls=":", label="a tenth of the last pushed step")
    ax.set(xlabel="steps since the gradient became 0", ylabel="update / last pushed update",
           title=f"AdamW with no gradient (beta1 = {beta1})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def entropy_agrees(mean_entropy: Callable, tolerance: float = 1e-4) -> bool:
    """Whether `mean_entropy(logits, mask, temperature)` equals grpo_lab's logged `entropy`
    (`token_logprobs_and_entropy`, `masked_mean`) on random logits at temperatures 1 and 0.5."""
    import torch

    from grpo_lab.algo.grpo_loss import masked_mean
    from grpo_lab.algo.logprobs import token_logprobs_and_entropy

    logits = 3 * torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0))  # (B, T, V)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    for temperature in (1.0, 0.5):
        _, entropy = token_logprobs_and_entropy(logits, torch.zeros(3, 5, dtype=torch.long),
                                                temperature)
        expected = masked_mean(entropy, mask.float()).item()
        if abs(float(mean_entropy(logits, mask, temperature)) - expected) > tolerance:
            return False
    return True


def token_push(batch, loss_type: str, max_completion_length: int):
    """How hard a loss aggregation pushes each completion's tokens: |d loss / d log p| of each
    completion's first token per unit of its advantage (B,), by autograd through grpo_lab's
    `grpo_loss` at ratio 1 (as in a first update). `batch`: a trainer's RolloutBatch."""
    import torch

    from grpo_lab.algo.grpo_loss import grpo_loss

    logps = batch.old_logps.clone().requires_grad_()  # (B, T)
    loss, _ = grpo_loss(logps, batch.old_logps, batch.advantages, batch.completion_mask,
                        loss_type=loss_type, max_completion_length=max_completion_length)
    (grad,) = torch.autograd.grad(loss, logps)
    return grad[:, 0].abs() / batch.advantages.abs().clamp(min=1e-12)
