"""Importance weights for the sampler/trainer mismatch (TRL's `vllm_importance_sampling_*`).

An inference engine does not give a sampled token exactly the trainer's log-probability, even
with the same weights. TRL weights each token's loss with w = pi_old / pi_sampler, per token or
per sequence, truncated or masked; `kl` is the k3 estimate of KL(pi_sampler || pi_theta). Shapes
as in grpo_lab.algo.grpo_loss (docs/internals.md, "The sampler correction").
"""

from __future__ import annotations

import math

import torch

from .grpo_loss import k3_kl, masked_mean

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def is_sequence_level(mode: str) -> bool:
    """`sequence_*` modes give one weight per sequence, `token_*` modes one per token."""
    if mode not in IS_MODES:
        raise ValueError(f"unknown vllm_importance_sampling_mode {mode!r}; "
                         f"choose one of {IS_MODES}")
    return mode.startswith("sequence")


def sampler_log_ratio(old_logps: torch.Tensor, sampler_logps: torch.Tensor,
                      mask: torch.Tensor) -> torch.Tensor:
    """log(pi_old / pi_sampler) per token, 0 on padding and where the sampler gave NaN: (B, T)."""
    return torch.nan_to_num((old_logps - sampler_logps) * mask, nan=0.0)


def truncated_weights(ratio: torch.Tensor, clip_min: float | None, clip_max: float | None):
    """Truncated IS: clamp(w, clip_min, clip_max); an unset bound does not clamp."""
    if clip_min is None and clip_max is None:  # torch.clamp refuses two unset bounds
        return ratio
    return torch.clamp(ratio, min=clip_min, max=clip_max)


def masked_weights(ratio: torch.Tensor, clip_min: float | None, clip_max: float | None):
    """Masked IS: w itself inside [clip_min, clip_max], 0 outside (an unset bound is infinite)."""
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@torch.no_grad()
def sampler_importance_weights(
    old_logps: torch.Tensor,  # (B, T) the trainer's logprobs before the update (pi_old)
    sampler_logps: torch.Tensor,  # (B, T) the sampler's logprobs of the same tokens
    mask: torch.Tensor,  # (B, T)
    mode: str = "sequence_mask",
    clip_max: float | None = 3.0,
    clip_min: float | None = None,
) -> torch.Tensor:
    """The importance weights pi_old / pi_sampler of `mode`, detached: (B, T) or (B, 1)."""
    log_ratio = sampler_log_ratio(old_logps, sampler_logps, mask.to(old_logps.dtype))
    if is_sequence_level(mode):
        # A sequence's probability is the product of its tokens': sum (not mean) the log-ratios.
        log_ratio = log_ratio.sum(dim=-1, keepdim=True)  # (B, 1)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return truncated_weights(ratio, clip_min, clip_max)
    return masked_weights(ratio, clip_min, clip_max)


@torch.no_grad()
def sampler_correction_metrics(old_logps: torch.Tensor, sampler_logps: torch.Tensor,
                               weights: torch.Tensor, mask: torch.Tensor,
                               mode: str) -> dict[str, float]:
    """TRL's `sampling/*` metrics: |log pi_old - log pi_sampler| over real tokens (NaNs left
    out), and the weights after truncation or masking (per sequence, or per real token)."""
    real = mask.bool()
    delta = (old_logps - sampler_logps).abs()
    delta = delta[real & ~torch.isnan(delta)]
    weights = weights.flatten() if is_sequence_level(mode) else weights[real]

    def stat(values: torch.Tensor, reduce) -> float:
        return reduce(values).item() if values.numel() else 0.0  # TRL logs 0 for an empty batch

    return {
        "sampling/sampling_logp_difference/mean": stat(delta, torch.mean),
        "sampling/sampling_logp_difference/max": stat(delta, torch.max),
        "sampling/importance_sampling_ratio/min": stat(weights, torch.min),
        "sampling/importance_sampling_ratio/mean": stat(weights, torch.mean),
        "sampling/importance_sampling_ratio/max": stat(weights, torch.max),
    }


@torch.no_grad()
def sampler_kl(logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor) -> float:
    """TRL AsyncGRPOTrainer's `kl`: mean k3 estimate of KL(pi_sampler || pi_theta) over real
    tokens, (r - 1) - log r with r = pi_theta / pi_sampler (Schulman 2020; the tokens are the
    sampler's, so this k3 is unbiased for that direction)."""
    return masked_mean(k3_kl(sampler_logps, logps), mask.to(logps.dtype)).item()
