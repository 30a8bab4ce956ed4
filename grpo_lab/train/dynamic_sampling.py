"""DAPO's dynamic sampling (Yu et al. 2025, section 3.2): train only on groups that carry a signal.

A group whose G rewards are all equal has advantage 0 on every completion: it adds nothing to
the gradient but takes a place in the batch. Rounds of fresh prompts are generated until
`prompts_per_step` groups with a signal are held, or `dynamic_sampling_max_rounds` is reached;
the extra generation is logged as `dynamic_sampling/*` (docs/internals.md, "Dynamic sampling").
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..data.tasks import Problem
from ..rollout.groups import SampledGroups
from .rollout_batch import zero_std_groups


def sample_with_signal(
    sample: Callable[[list[Problem]], SampledGroups],
    draw: Callable[[int], list[Problem]],
    problems: list[Problem],
    group_size: int,
    max_rounds: int,
) -> tuple[SampledGroups, dict[str, float]]:
    """`len(problems)` groups, those whose rewards differ first; returns them and the metrics.

    `sample` generates and scores G completions per problem (Stages 1-2), `draw(n)` gives n fresh
    problems for the next round, `problems` are the first round's.
    """
    want = len(problems)
    kept: list[SampledGroups] = []
    rounds = generated = zero_std = have = 0
    while True:
        batch = sample(problems)
        flat = zero_std_groups(batch.rewards, group_size).tolist()  # (len(problems),)
        rounds, generated, zero_std = rounds + 1, generated + len(flat), zero_std + sum(flat)
        kept.append(batch.groups([k for k, no_signal in enumerate(flat) if not no_signal]))
        have += len(kept[-1].problems)
        if have >= want or rounds >= max_rounds:
            break
        # Enough to fill the batch if the next groups are kept as often as these were.
        problems = draw(min(want, math.ceil((want - have) * generated / have)) if have else want)
    chosen = SampledGroups.concat(kept).groups(list(range(min(have, want))))
    filled = want - len(chosen.problems)  # the cap was hit: the last round's zero-signal groups
    if filled:
        chosen = SampledGroups.concat(
            [chosen, batch.groups([k for k, no_signal in enumerate(flat) if no_signal][:filled])])
    return chosen, {
        "dynamic_sampling/rounds": rounds,
        "dynamic_sampling/generated_groups": generated,
        "dynamic_sampling/zero_std_groups": zero_std,
        "dynamic_sampling/dropped_groups": zero_std - filled,
    }
