"""One step's rollouts as the trainer holds them: padded tensors (`RolloutBatch`, from the
scored groups of grpo_lab.rollout.groups), the step's reward and completion metrics (TRL's
names), and the step gathered from every trainer process."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.completions import Completions
from ..data.reward_set import RewardSet
from .distributed import Processes


def pad_left(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists: (ids, mask), each (B, max_len)."""
    width = max(map(len, rows))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def pad_right(rows: list[list], pad) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad lists (token ids or logprobs): (values, mask), each (B, max_len)."""
    width = max(max(map(len, rows)), 1)
    values = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return values, mask


def zero_std_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(B,) rewards -> (B / G,) bool: True for a group whose G rewards are all equal (advantage 0
    for each: no learning signal)."""
    return rewards.view(-1, group_size).std(dim=1) == 0


@dataclass
class RolloutBatch:
    """One step's rollouts as tensors: B = prompts_per_step * G rows, prompt-major."""

    prompt_ids: torch.Tensor  # (B, P) left padded
    prompt_mask: torch.Tensor  # (B, P)
    completion_ids: torch.Tensor  # (B, T) right padded
    completion_mask: torch.Tensor  # (B, T)
    old_logps: torch.Tensor  # (B, T) log-probs of the sampling policy
    rewards: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,)

    @classmethod
    def from_completions(cls, out: Completions, rewards, advantages, pad_id: int) -> RolloutBatch:
        prompt_ids, prompt_mask = pad_left(out.prompt_ids, pad_id)
        completion_ids, completion_mask = pad_right(out.completion_ids, pad_id)
        old_logps, _ = pad_right(out.logprobs, 0.0)
        return cls(prompt_ids, prompt_mask, completion_ids, completion_mask, old_logps.float(),
                   rewards, advantages)

    def to(self, device) -> RolloutBatch:
        return RolloutBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def gather_samples(processes: Processes, problems, out: Completions, rewards: torch.Tensor,
                   parts: dict[str, torch.Tensor]):
    """Every process's problems, completions, rewards and reward parts, concatenated in process
    order: the whole step, as one process would have it."""
    shares = processes.gather((problems, out, rewards, parts))
    return ([p for share in shares for p in share[0]],
            Completions.concat([share[1] for share in shares]),
            torch.cat([share[2] for share in shares]),
            {name: torch.cat([share[3][name] for share in shares]) for name in parts})


def rollout_metrics(rewards: torch.Tensor, out: Completions, group_size: int,
                    parts: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Reward and completion metrics of one step's rollouts (TRL's names), and each reward
    function's mean and std (`rewards/<name>/mean`)."""
    lengths = [len(ids) for ids in out.completion_ids]
    return {
        **RewardSet.metrics(parts or {}),
        "reward": rewards.mean().item(),
        "reward_std": rewards.std().item(),
        "frac_reward_zero_std": zero_std_groups(rewards, group_size).float().mean().item(),
        "completions/mean_length": out.num_tokens / len(out),
        "completions/min_length": min(lengths),
        "completions/max_length": max(lengths),
        "completions/clipped_ratio": out.finish_reasons.count("length") / len(out),
    }
