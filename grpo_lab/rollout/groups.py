"""Scored groups (prompts with their G completions and rewards: what the rollout worker puts in
the buffer, and what a step trains on), and how a step's groups are shared out between trainer
processes."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.completions import Completions
from ..data.tasks import Problem


@dataclass
class SampledGroups:
    """Problems with their G completions each and the completions' rewards (Stages 1-2's
    output), prompt-major: group k is rows k*G .. k*G+G-1. The synchronous trainer samples one
    for a step; the rollout worker puts one per prompt in the buffer (`per_problem`), and the
    trainer joins a step's (`concat`). Advantages (stage 3) come when a step's groups are
    chosen (grpo_lab.train.grpo_step.to_batch)."""

    problems: list[Problem]
    out: Completions
    rewards: torch.Tensor  # (B,)
    parts: dict[str, torch.Tensor]  # each reward function's scores, (B,) each

    def groups(self, keep: list[int]) -> SampledGroups:
        """The groups `keep` (indices into `problems`), in that order."""
        G = len(self.out) // max(len(self.problems), 1)
        rows = torch.tensor([k * G + j for k in keep for j in range(G)], dtype=torch.long)
        return SampledGroups([self.problems[k] for k in keep],
                             Completions.concat([self.out[k * G:(k + 1) * G] for k in keep]),
                             self.rewards[rows], {n: v[rows] for n, v in self.parts.items()})

    def per_problem(self) -> list[SampledGroups]:
        """One SampledGroups per problem, in order (what the buffer holds)."""
        return [self.groups([k]) for k in range(len(self.problems))]

    @classmethod
    def concat(cls, parts: list[SampledGroups]) -> SampledGroups:
        """Several SampledGroups as one, in the order given (all with the same reward names)."""
        return cls([p for part in parts for p in part.problems],
                   Completions.concat([part.out for part in parts]),
                   torch.cat([part.rewards for part in parts]),
                   {n: torch.cat([part.parts[n] for part in parts]) for n in parts[0].parts})


def split(items: list, parts: int) -> list[list]:
    """`items` in `parts` contiguous shares, the first ones one longer if it does not divide."""
    size, extra = divmod(len(items), parts)
    bounds = [k * size + min(k, extra) for k in range(parts + 1)]
    return [items[bounds[k]:bounds[k + 1]] for k in range(parts)]

