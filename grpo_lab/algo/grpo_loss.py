"""The GRPO core, one function per idea (docs/internals.md, "The GRPO loss").

    1. per-token log-probabilities at the sampling temperature   grpo_lab.algo.logprobs
    2. group-relative advantages                                  group_advantages
    3. the clipped surrogate with separate low/high epsilon       clipped_surrogate
    4. an optional KL penalty against a reference (k3 estimator)  k3_kl
    5. per-token losses aggregated into one number                grpo_, dapo_, dr_grpo_aggregate

Shapes: B completions (G per prompt, prompt-major), T completion tokens (right padded), V vocab.
`mask` is 1 on real completion tokens and 0 on padding: padding never contributes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# ---------------------------------------------------------------------------------------------
# 2. Advantages


def group_advantages(rewards: torch.Tensor, group_size: int, scale_by_std: bool = True, eps=1e-4):
    """A_i = (r_i - mean(r_group)) / (std(r_group) + eps): (B,) -> (B,).

    GRPO (Shao et al. 2024, DeepSeekMath, eq. 3) replaces PPO's value function with the group
    mean. Dividing by the group's std gives groups whose rewards barely differ (nearly all
    right, or nearly all wrong) the largest advantages: a bias towards too-easy and too-hard
    questions. Dr. GRPO (Liu et al. 2025) removes it by not dividing (`scale_by_std=False`).
    std is the unbiased (Bessel) one, as in TRL.
    A group whose rewards are all equal gets advantage 0: it carries no learning signal.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.view(-1, group_size)  # (B/G, G)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale_by_std:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


# ---------------------------------------------------------------------------------------------
# 3. Clipped surrogate


@dataclass
class SurrogateOutput:
    per_token_loss: torch.Tensor  # (B, T), to be minimised
    ratio: torch.Tensor  # (B, T) pi_theta / pi_old
    low_clipped: torch.Tensor  # (B, T) bool: ratio < 1 - eps_low with A < 0
    high_clipped: torch.Tensor  # (B, T) bool: ratio > 1 + eps_high with A > 0


def clipped_surrogate(
    logps: torch.Tensor,  # (B, T) current policy
    old_logps: torch.Tensor,  # (B, T) the policy that sampled the tokens
    advantages: torch.Tensor,  # (B,), or (B, 1) / (B, T) already per token
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
) -> SurrogateOutput:
    """-min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) per token (PPO, Schulman et al. 2017).

    Separate low/high epsilon is DAPO's "clip-higher" (Yu et al. 2025): a larger eps_high lets
    unlikely tokens with positive advantage grow faster. Advantages given per token (2-D) are
    used as they are, as TRL does.
    """
    ratio = torch.exp(logps - old_logps)  # (B, T)
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(1)  # broadcast over tokens
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high) * adv
    return SurrogateOutput(
        per_token_loss=-torch.min(unclipped, clipped),
        ratio=ratio,
        low_clipped=(ratio < 1 - epsilon_low) & (adv < 0),
        high_clipped=(ratio > 1 + epsilon_high) & (adv > 0),
    )


# ---------------------------------------------------------------------------------------------
# 4. KL penalty


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """KL(pi_theta || pi_ref) per token with the k3 estimator: exp(d) - d - 1, d = ref - logp.

    Its value is an unbiased estimate on tokens sampled from pi_theta itself, always >= 0 and
    low-variance (Schulman, "Approximating KL divergence", 2020); the estimator GRPO uses
    (DeepSeekMath eq. 4). Its gradient is not that of KL(pi_theta || pi_ref): minimised on such
    tokens it follows the gradient of KL(pi_ref || pi_theta) (notebook 01b derives it). Weighing
    it by the ratio pi_theta / pi_old (`grpo_loss(..., use_bias_correction_kl=True)`, TRL's
    option) gives the gradient of KL(pi_theta || pi_ref), even at ratio 1.
    """
    delta = ref_logps - logps
    # expm1(d) - d is exp(d) - 1 - d without the cancellation of exp(d) - 1 near d = 0: never
    # below 0 in float32 (exp(d) - d - 1 gives -1e-8 or so when the two logprobs differ by
    # rounding), the same value otherwise.
    return torch.expm1(delta) - delta


# ---------------------------------------------------------------------------------------------
# 5. Aggregations: how per-token losses become one scalar


def grpo_aggregate(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GRPO: mean over each sequence's tokens, then mean over sequences (DeepSeekMath eq. 3).

    Long completions weigh each token less: a length bias Dr. GRPO and DAPO remove.
    """
    per_sequence = (per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sequence.mean()


def dapo_aggregate(per_token_loss: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """DAPO: token-level mean over every token in the batch (Yu et al. 2025, eq. 8)."""
    return (per_token_loss * mask).sum() / mask.sum().clamp(min=1)


def dr_grpo_aggregate(
    per_token_loss: torch.Tensor, mask: torch.Tensor, max_completion_length: int
) -> torch.Tensor:
    """Dr. GRPO: sum over tokens divided by a constant B * max_len (Liu et al. 2025, eq. 5)."""
    return (per_token_loss * mask).sum() / (per_token_loss.shape[0] * max_completion_length)


LOSS_TYPES = ("grpo", "dapo", "dr_grpo")


def aggregate(loss_type: str, per_token_loss, mask, max_completion_length: int) -> torch.Tensor:
    """Dispatch to the aggregation named by `loss_type` (one of LOSS_TYPES)."""
    if loss_type == "grpo":
        return grpo_aggregate(per_token_loss, mask)
    if loss_type == "dapo":
        return dapo_aggregate(per_token_loss, mask)
    if loss_type == "dr_grpo":
        return dr_grpo_aggregate(per_token_loss, mask, max_completion_length)
    raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {LOSS_TYPES}")


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over real tokens only."""
    return (values * mask).sum() / mask.sum().clamp(min=1)


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "grpo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
    max_completion_length: int | None = None,
    importance_weights: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    use_bias_correction_kl: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The full GRPO objective: surrogate (x importance weight) (+ beta * KL), aggregated;
    returns (loss, metrics).

    `importance_weights`, (B, T) or (B, 1), detached: pi_old / pi_sampler truncated or masked
    (grpo_lab.algo.sampler_correction.sampler_importance_weights). They weigh the surrogate
    only, not the KL term, as in TRL's GRPOTrainer. None = no correction.
    `entropy`, (B, T), the policy's per-token entropy
    (grpo_lab.algo.logprobs.token_logprobs_and_entropy), is only logged: its mean over
    completion tokens is TRL's `entropy` metric.
    `use_bias_correction_kl` (TRL's name): weigh the k3 KL by the ratio pi_theta / pi_old. The
    ratio is differentiable, so this changes the KL term's gradient even where its value is 1
    (see `k3_kl`); the logged `kl` is then the weighted one, as TRL logs it.
    """
    mask = mask.to(logps.dtype)
    surrogate = clipped_surrogate(logps, old_logps, advantages, epsilon_low, epsilon_high)
    per_token_loss = surrogate.per_token_loss
    if importance_weights is not None:
        # The tokens came from pi_sampler, the ratio is against pi_old: reweigh by
        # pi_old / pi_sampler (TRL's vllm_importance_sampling_correction).
        per_token_loss = per_token_loss * importance_weights
    metrics = {}
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps")
        kl = k3_kl(logps, ref_logps)
        if use_bias_correction_kl:  # value unchanged at ratio 1; gradient + kl * d log pi_theta
            kl = kl * surrogate.ratio
        per_token_loss = per_token_loss + beta * kl
        metrics["kl"] = masked_mean(kl, mask).item()
    loss = aggregate(loss_type, per_token_loss, mask, max_completion_length or mask.shape[1])
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy, mask).item()
    metrics["ratio"] = masked_mean(surrogate.ratio, mask).item()
    metrics["clip_ratio/low_mean"] = masked_mean(surrogate.low_clipped.float(), mask).item()
    metrics["clip_ratio/high_mean"] = masked_mean(surrogate.high_clipped.float(), mask).item()
    metrics["clip_ratio/region_mean"] = masked_mean(
        (surrogate.low_clipped | surrogate.high_clipped).float(), mask
    ).item()
    # Per-completion extremes (TRL's): the clipped fraction of each completion's tokens.
    lengths = mask.sum(1)  # (B,)
    if bool((lengths > 0).any()):
        def per_completion(clipped):  # (B',) over the completions with tokens
            return ((clipped.float() * mask).sum(1) / lengths.clamp(min=1))[lengths > 0]
        metrics["clip_ratio/low_min"] = per_completion(surrogate.low_clipped).min().item()
        metrics["clip_ratio/high_max"] = per_completion(surrogate.high_clipped).max().item()
    return loss, metrics
