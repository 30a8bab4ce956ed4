"""A GRPO group as pictures: one prompt's G completions, their rewards and advantages; the same
prompts' completions before and after training; the weight each aggregation gives a token.

`plot_group(prompt, texts, rewards)` draws the group-relative advantages of one group as a bar
chart, each bar labelled with its completion and coloured by its reward (notebook 01 starts from
one). `plot_before_after(prompts, before, after)` draws the completions of the same prompts
sampled before and after training as two grids of rewards, the completions written in their
cells. `plot_token_weights` draws how hard each token of a group is pushed under `grpo`, `dapo`
and `dr_grpo` (notebook 01b). Each returns its matplotlib figure; the notebook shows it.
`print_groups` lists sampled groups as text; `compare_clip_runs` trains twice with 4 updates per
batch, with the clipped surrogate and with an unclipped one (notebook 01's exercise 01.3).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import nullcontext
from typing import NamedTuple

import matplotlib.pyplot as plt
import torch

from grpo_lab.algo.grpo_loss import clipped_surrogate, group_advantages

# Okabe-Ito colours: told apart with every common colour-vision deficiency
RIGHT, WRONG, NEUTRAL = "#0072B2", "#E69F00", "#999999"
AGGREGATION_COLORS = {"grpo": "#D55E00", "dapo": "#0072B2", "dr_grpo": "#009E73"}


class SampledGroups(NamedTuple):
    """Completions of some prompts, G per prompt (prompt-major), and their rewards."""

    prompts: list[str]
    answers: list[str]
    texts: list[list[str]]  # (prompts, G) completions
    rewards: list[list[float]]  # (prompts, G) rewards


def split_groups(values: Sequence, G: int) -> list[list]:
    """A prompt-major flat list (G values per prompt) as one list per prompt."""
    values = list(values)
    if len(values) % G:
        raise ValueError(f"{len(values)} values do not split into groups of {G}")
    return [values[i:i + G] for i in range(0, len(values), G)]


def sample_groups(model, tokenizer, problems, G: int, max_new_tokens: int, reward=None,
                  seed: int | None = None) -> SampledGroups:
    """G completions of each problem's prompt at temperature 1, scored by `reward(texts,
    answer=...)` (exact match by default): what a GRPO step samples, as a `SampledGroups`.
    With a `seed`, sampled from it without touching torch's global random stream (a trainer's
    run stays the same with or without this look at its groups)."""
    from grpo_lab.data.rewards import exact_match_reward
    from grpo_lab.model.generation import generate_completions

    reward = reward or exact_match_reward
    forked = torch.random.fork_rng(devices=[]) if seed is not None else nullcontext()
    with forked:
        if seed is not None:
            torch.manual_seed(seed)
        out = generate_completions(model, tokenizer, [p.prompt for p in problems],
                                   max_new_tokens=max_new_tokens, num_generations=G)
    rewards = reward(out.texts, answer=[p.answer for p in problems for _ in range(G)])
    return SampledGroups([p.prompt for p in problems], [p.answer for p in problems],
                         split_groups(out.texts, G), split_groups([float(r) for r in rewards], G))


def draw_group(ax, prompt: str, texts: Sequence[str], rewards: Sequence[float],
               advantages: Sequence[float], answer: str | None = None) -> None:
    """One group on `ax`: a bar per completion, its height the advantage, its colour the reward
    (right: blue, wrong: orange, in between: grey), its label the completion and its reward."""
    colors = [RIGHT if r >= 1 else WRONG if r <= 0 else NEUTRAL for r in rewards]
    ax.bar(range(len(texts)), [float(a) for a in advantages], color=colors)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(texts)), [f"{t!r}\nr = {float(r):g}" for t, r in zip(texts, rewards)],
                  fontsize=8)
    ax.set_ylabel("advantage $A_i$")
    right = sum(float(r) >= 1 for r in rewards)
    shown = f"{prompt!r}" + (f" (answer {answer!r})" if answer is not None else "")
    ax.set_title(f"prompt {shown}: {right} of {len(texts)} right")
    ax.grid(axis="y", alpha=0.3)


def plot_group(prompt: str, texts: Sequence[str], rewards: Sequence[float],
               advantages: Sequence[float] | None = None, answer: str | None = None):
    """A figure of one group (see `draw_group`); the advantages default to GRPO's
    (`group_advantages`: reward minus the group mean, over the group's std)."""
    if advantages is None:
        advantages = group_advantages(torch.tensor([float(r) for r in rewards]), len(rewards))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.0 * len(texts)), 3.4))
    draw_group(ax, prompt, texts, rewards, [float(a) for a in advantages], answer)
    fig.tight_layout()
    return fig


def draw_reward_grid(ax, groups: SampledGroups, title: str) -> None:
    """The rewards of `groups` as a grid, a row per prompt and a column per completion, each cell
    showing its completion; the title counts the right ones."""
    ax.imshow(torch.tensor(groups.rewards, dtype=torch.float32).numpy(), cmap="cividis",
              vmin=0, vmax=1, aspect="auto")
    for row, texts in enumerate(groups.texts):
        for col, text in enumerate(texts):
            light = groups.rewards[row][col] >= 0.5  # cividis is light at 1, dark at 0
            ax.text(col, row, text, ha="center", va="center", fontsize=8,
                    color="black" if light else "white")
    ax.set_yticks(range(len(groups.prompts)),
                  [f"{p}{a}" for p, a in zip(groups.prompts, groups.answers)], fontsize=8)
    ax.set_xticks(range(len(groups.texts[0])), [str(i + 1) for i in range(len(groups.texts[0]))])
    ax.set_xlabel("completion (its cell: light = right, dark = wrong)")
    right = sum(r >= 1 for rewards in groups.rewards for r in rewards)
    total = sum(len(rewards) for rewards in groups.rewards)
    ax.set_title(f"{title}: {right} of {total} right")


def plot_before_after(before: SampledGroups, after: SampledGroups):
    """Two reward grids side by side (`draw_reward_grid`): the same prompts' completions sampled
    before and after training."""
    if before.prompts != after.prompts:
        raise ValueError("before and after must sample the same prompts")
    rows, G = len(before.prompts), len(before.texts[0])
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.2 * G + 3), 0.45 * rows + 1.6),
                             sharey=True)
    draw_reward_grid(axes[0], before, "before training")
    draw_reward_grid(axes[1], after, "after training")
    fig.tight_layout()
    return fig


def plot_token_weights(lengths: Sequence[int], advantages: Sequence[float],
                       weights: dict[str, Sequence[float]], labels: Sequence[str],
                       max_len: int):
    """Left: the weight of each token against its completion's length, per aggregation (lines:
    the formulas, dots: the group). Right: the push $A_i w_i$ each token of each completion gets."""
    lengths = torch.as_tensor(lengths).float()
    G = len(lengths)
    span = torch.arange(1, max_len + 1).float()
    curves = {"grpo": 1 / (G * span), "dapo": torch.full_like(span, 1 / lengths.sum().item()),
              "dr_grpo": torch.full_like(span, 1 / (G * max_len))}
    formulas = {"grpo": r"grpo: $1/(G\,|o_i|)$", "dapo": r"dapo: $1/\sum_j |o_j|$",
                "dr_grpo": r"dr_grpo: $1/(G\,L_{max})$"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    width = 0.8 / len(weights)
    for j, (name, w) in enumerate(weights.items()):
        color = AGGREGATION_COLORS.get(name, NEUTRAL)
        if name in curves:
            left.plot(span, curves[name], color=color, label=formulas[name])
        left.plot(lengths, [float(x) for x in w], "o", color=color)
        push = [float(a) * float(x) for a, x in zip(advantages, w)]
        right.bar([i + (j - (len(weights) - 1) / 2) * width for i in range(G)], push, width,
                  color=color, label=name)
    left.set(xlabel="completion length (tokens)", ylabel="weight of each of its tokens",
             title="Per-token weight vs length (dots: the group)")
    left.grid(alpha=0.3)
    left.legend()
    right.axhline(0, color="grey", lw=0.8)
    right.set_xticks(range(G), labels, fontsize=8)
    right.set(ylabel=r"push per token $A_i w_i$",
              title="How hard each token is pushed up (+) or down (-)")
    right.legend()
    fig.tight_layout()
    return fig


def print_groups(groups: SampledGroups) -> None:
    """One line per prompt: the prompt and its answer, the G completions and their rewards."""
    for prompt, answer, texts, rewards in zip(*groups):
        print(f"{prompt}{answer}  samples={texts}  rewards={rewards}")


def compare_clip_runs(make_trainer, unclipped, example: tuple) -> dict:
    """Check `unclipped(logps, old_logps, advantages)` against `clipped_surrogate` with a clip
    that never binds on `example` (logps, old_logps, advantages), then train
    `make_trainer(surrogate)` with the clipped surrogate and with `unclipped`. Returns
    {"clipped"|"unclipped": {"kl": mean logged kl per batch, "accuracy": final accuracy}}."""
    never_binds = clipped_surrogate(*example, epsilon_low=1.0,
                                    epsilon_high=float("inf")).per_token_loss
    assert torch.allclose(unclipped(*example), never_binds, atol=1e-6), (
        "expected -exp(logps - old_logps) * advantages[:, None]: clipped_surrogate's loss when "
        "the clip never binds")
    runs = {}
    for name, surrogate in (("clipped", lambda *a: clipped_surrogate(*a).per_token_loss),
                            ("unclipped", unclipped)):
        run = make_trainer(surrogate)
        kls = [r["kl"] for r in run.train() if r["step"] > 0]
        runs[name] = dict(kl=sum(kls) / len(kls), accuracy=run.accuracy_history[-1][1])
        print(f"{name:9s} kl per batch {runs[name]['kl']:.2e}; greedy accuracy "
              f"{run.accuracy_history[0][1]:.3f} -> {runs[name]['accuracy']:.3f}")
    return runs
