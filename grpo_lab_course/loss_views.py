"""The plumbing around notebook 01b's derivations of GRPO's loss: set-ups, short runs, reports.

The notebook writes the maths by hand (the clipped objective's gradient, k3's value and gradient,
the aggregations' token weights) and checks it against `grpo_lab.algo.grpo_loss`. What is not
the lesson lives here: `toy_distributions` (two random distributions over a toy vocabulary and
their exact KL), `z_score`, `plot_clip_panels` (Figure 1b.1), `print_kl_gradient_table`,
`kl_to_reference` and `train_and_track_kl` (a short run whose drift from the reference model is
measured every few steps), `report_kl_drift` (Figure 1b.3 and its summary) and `group_logps`
(the tiny model's log-probabilities of random digit completions of chosen lengths).
"""

from __future__ import annotations

import copy
import random

import matplotlib.pyplot as plt
import torch

from grpo_lab.algo import grpo_loss as core
from grpo_lab.algo import logprobs
from grpo_lab.train.trainer import GRPOTrainer


def toy_distributions(vocab_size: int = 8):
    """(pi_theta, pi_ref, exact KL(pi_theta || pi_ref)): two random softmaxes from torch's
    global random stream, in that order."""
    policy = torch.softmax(torch.randn(vocab_size), 0)
    reference = torch.softmax(torch.randn(vocab_size), 0)
    return policy, reference, (policy * (policy.log() - reference.log())).sum().item()


def z_score(samples: torch.Tensor, target: float) -> float:
    """How many standard errors the mean of `samples` lies from `target`."""
    return ((samples.mean() - target) / (samples.std() / len(samples) ** 0.5)).item()


def plot_clip_panels(ratios, panels: dict, band: tuple[float, float]):
    """Figure 1b.1: for each advantage A in `panels` (A -> (objective, gradient, binds), one
    value per ratio), the per-token objective (top) and its gradient (bottom, 0 where the clip
    binds shaded) against the ratio, the clip band in green."""
    fig, axes = plt.subplots(2, len(panels), figsize=(11, 6.5), sharex=True, squeeze=False)
    for col, (A, (objective, token_grad, binds)) in enumerate(panels.items()):
        top, bottom = axes[0, col], axes[1, col]
        for ax in (top, bottom):
            ax.axvspan(*band, color="tab:green", alpha=0.12, label="clip band")
            ax.axvline(1.0, color="grey", lw=0.8)
            ax.grid(alpha=0.3)
        top.plot(ratios, ratios * A, "--", color="grey", label=r"unclipped $\rho A$")
        top.plot(ratios, objective, color="tab:blue", lw=2,
                 label=r"$\min(\rho A, \mathrm{clip}(\rho) A)$")
        top.set_title(f"A = {A:+.0f}: objective per token")
        bottom.plot(ratios, token_grad, color="tab:red", lw=2)
        bottom.fill_between(ratios, 0, 1, where=binds, color="tab:red", alpha=0.12,
                            transform=bottom.get_xaxis_transform(),
                            label="gradient 0: the clip binds")
        bottom.set_title(r"d objective / d log $\pi_\theta$ (autograd)")
        bottom.set_xlabel(r"ratio $\rho = \pi_\theta / \pi_{old}$")
        top.legend(fontsize=8)
        bottom.legend(fontsize=8)
    fig.tight_layout()
    return fig


def print_kl_gradient_table(losses: dict, kl_theta_ref: float, diffs: dict) -> None:
    """The expected losses beside the exact KL, then max |autograd - analytic| for each loss
    (`diffs`: name -> (vs d KL(pi_ref || pi_theta), vs d KL(pi_theta || pi_ref)))."""
    print("expected loss: " + ", ".join(f"{k} {v:.6f}" for k, v in losses.items())
          + f", exact KL(pi_theta || pi_ref) {kl_theta_ref:.6f}")
    print("max |autograd - analytic| over the logits:")
    print(f"{'':>26} {'d KL(pi_ref || pi_theta)':>26} {'d KL(pi_theta || pi_ref)':>26}")
    for name, (ref_theta, theta_ref) in diffs.items():
        print(f"{name:>26} {ref_theta:26.1e} {theta_ref:26.1e}")


def kl_to_reference(trainer, reference, problems):
    """On-policy samples of `problems`; per real completion token: (k3, exact KL at that
    position summed over the vocabulary, log-ratio k1), each a 1-D tensor."""
    batch, _, _ = trainer.make_batch(problems)  # sampled from pi_theta, as in training
    ids_and_masks = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                     batch.completion_mask)
    with torch.no_grad():  # (B, T, V): the logits that predict each completion token
        logps, ref_logps = (torch.log_softmax(logprobs.completion_logits(m, *ids_and_masks).float()
                                              / trainer.config.temperature, -1)
                            for m in (trainer.model, reference))
    exact = (logps.exp() * (logps - ref_logps)).sum(-1)  # (B, T)
    ids = batch.completion_ids.unsqueeze(-1)
    token_logps, token_ref = (lp.gather(-1, ids).squeeze(-1) for lp in (logps, ref_logps))
    real = batch.completion_mask.bool()
    return core.k3_kl(token_logps, token_ref)[real], exact[real], (token_logps - token_ref)[real]


def train_and_track_kl(config, probe_prompts: int, every: int):
    """Train a `GRPOTrainer(config)`, measuring (mean k3, mean exact KL) to the model at step 0
    on a fixed probe of `probe_prompts` prompts at step 0 and every `every` steps.
    Returns (trainer, reference, records, curve: step -> (k3, exact))."""
    trainer = GRPOTrainer(config)
    reference = copy.deepcopy(trainer.model).eval().requires_grad_(False)  # the model at step 0
    probe = trainer.task.sample_batch(random.Random(config.seed + 1), probe_prompts)
    curve = {}

    def measure(step):
        k3, exact, _ = kl_to_reference(trainer, reference, probe)
        curve[step] = (k3.mean().item(), exact.mean().item())

    measure(0)
    records = trainer.train(callback=lambda r: None if r["step"] % every else measure(r["step"]))
    return trainer, reference, records, curve


def report_kl_drift(runs: dict, steps: int, colors=("tab:red", "tab:blue")):
    """Figure 1b.3 and its summary. `runs`: name -> (trainer, records, curve) from
    `train_and_track_kl`. Draws each run's exact KL (line) and k3 estimate (dots) against the
    step, and the logged `kl` of the runs with beta > 0; prints each run's exact KL after
    `steps` steps and greedy accuracy before -> after. Returns the figure."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for (name, (trainer, records, curve)), color in zip(runs.items(), colors):
        measured = sorted(curve)
        for i, style, what in ((1, "-", "exact KL"), (0, "o", "k3 estimate")):
            ax.plot(measured, [curve[s][i] for s in measured], style, color=color,
                    label=f"{name}: {what}")
        logged = [(r["step"], r["kl"]) for r in records if "kl" in r]
        if trainer.config.beta > 0 and logged:
            ax.plot(*zip(*logged), ":", color=color, alpha=0.6, label=f"{name}: logged `kl`")
        (_, before), (_, after) = trainer.accuracy_history[0], trainer.accuracy_history[-1]
        print(f"{name:>9}: exact KL after {steps} steps {curve[steps][1]:.4f}, "
              f"greedy accuracy {before:.1%} -> {after:.1%}")
    ax.set(xlabel="step", ylabel=r"KL($\pi_\theta$ || $\pi_{ref}$) per token",
           title="Drift from the reference, with and without the KL term")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def group_logps(model, tokenizer, lengths: torch.Tensor, prompt: str = "07+45=", device="cpu"):
    """(completion_mask (G, max_len), logps (G, max_len) on the CPU): random digit completions
    of `lengths` tokens (right padded, digits from torch's global random stream) after `prompt`,
    scored by `model` without gradient."""
    G, max_len = len(lengths), int(lengths.max())
    completion_mask = (torch.arange(max_len) < lengths[:, None]).long()
    digits = torch.tensor(tokenizer.convert_tokens_to_ids(list("0123456789")))
    completion_ids = torch.where(completion_mask.bool(), digits[torch.randint(10, (G, max_len))],
                                 tokenizer.pad_token_id)
    enc = tokenizer([prompt] * G, return_tensors="pt")
    with torch.no_grad():
        logps = logprobs.policy_logprobs(model, enc["input_ids"].to(device),
                                     enc["attention_mask"].to(device), completion_ids.to(device),
                                     completion_mask.to(device)).cpu()
    return completion_mask, logps
