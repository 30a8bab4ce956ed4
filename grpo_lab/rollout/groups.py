"""A scored group (one prompt's G completions after stages 1-3, what the rollout worker puts in
the buffer), and how a step's groups are joined or shared out between trainer processes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.completions import Completions
from ..data.tasks import Problem


@dataclass
class ScoredGroup:
    """One prompt's G completions after stages 1-3: what the worker puts in the buffer."""

    problem: Problem
    completions: Completions  # G rows
    rewards: torch.Tensor  # (G,) the weighted sum
    advantages: torch.Tensor  # (G,)
    parts: dict[str, torch.Tensor]  # each reward function's scores, (G,) each


def concat_groups(groups: list[ScoredGroup]):
    """(completions, rewards, advantages, reward parts) of groups, concatenated in order."""
    out = Completions.concat([g.completions for g in groups])
    rewards = torch.cat([g.rewards for g in groups])
    advantages = torch.cat([g.advantages for g in groups])
    parts = {name: torch.cat([g.parts[name] for g in groups]) for name in groups[0].parts}
    return out, rewards, advantages, parts


def split(items: list, parts: int) -> list[list]:
    """`items` in `parts` contiguous shares, the first ones one longer if it does not divide."""
    size, extra = divmod(len(items), parts)
    bounds = [k * size + min(k, extra) for k in range(parts + 1)]
    return [items[bounds[k]:bounds[k + 1]] for k in range(parts)]

