"""Several reward functions, weighted and summed: the reward a GRPO group is compared on.

    reward="math_answer,format", reward_weights="1.0,0.2"     correctness, plus a little for form

As TRL's `reward_funcs` and `reward_weights` (a None score counts as 0); `module:function`
imports a reward from your code. The first reward is the one the held-out evaluation counts
(docs/internals.md, "Several rewards").
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .rewards import REWARDS


def import_reward(spec: str) -> Callable:
    """`module:function` -> the function, with a message that says what is wrong."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"unknown reward {spec!r}: choose a built-in one "
                         f"({', '.join(sorted(REWARDS))}) or write module:function")
    added = os.getcwd() not in sys.path
    if added:  # `grpo-lab` as a console script does not search the working directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({exc})") from None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name} has no function {attr!r}")
    return fn


def parse_weights(text: str | None, count: int) -> list[float]:
    """`"1,0.2"` -> [1.0, 0.2]; None -> all 1.0."""
    if text is None or str(text).strip() == "":
        return [1.0] * count
    try:
        weights = [float(w) for w in str(text).split(",")]
    except ValueError:
        raise ValueError(f"reward_weights {text!r}: write numbers separated by commas") from None
    if len(weights) != count:
        raise ValueError(f"reward_weights {text!r} has {len(weights)} weights for {count} rewards")
    if not all(math.isfinite(w) for w in weights):
        raise ValueError(f"reward_weights {text!r}: every weight must be a finite number")
    return weights


@dataclass
class RewardSet:
    """Named reward functions and their weights."""

    names: list[str]
    functions: list[Callable]
    weights: list[float]

    @classmethod
    def parse(cls, rewards: str, weights: str | None = None) -> RewardSet:
        """From the config's strings: names or `module:function`, comma separated."""
        specs = [s.strip() for s in str(rewards).split(",") if s.strip()]
        if not specs:
            raise ValueError("reward: name at least one reward function")
        if len(set(specs)) != len(specs):
            raise ValueError(f"reward {rewards!r} names a reward twice")
        functions = [REWARDS[s] if s in REWARDS else import_reward(s) for s in specs]
        return cls(specs, functions, parse_weights(weights, len(specs)))

    @property
    def correctness(self) -> Callable:
        """The first reward: what the held-out evaluation counts."""
        return self.functions[0]

    def score(self, completions: Sequence, answers: Sequence[str], prompts: Sequence | None = None
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(weighted sum per completion, each reward per completion), tensors of shape (B,)."""
        per_reward = {}
        for name, fn in zip(self.names, self.functions):
            values = fn(list(completions), prompts=list(prompts or []), answer=list(answers))
            if values is None or len(values) != len(completions):
                raise ValueError(f"reward {name!r} returned {len(values or [])} values for "
                                 f"{len(completions)} completions")
            per_reward[name] = torch.tensor([math.nan if v is None else float(v) for v in values])
        total = sum(w * torch.nan_to_num(per_reward[n], nan=0.0)
                    for n, w in zip(self.names, self.weights))
        return total.float(), per_reward

    @staticmethod
    def metrics(per_reward: dict[str, torch.Tensor]) -> dict[str, float]:
        """`rewards/<name>/mean` and `/std` (TRL's names), ignoring None (NaN) values."""
        out = {}
        for name, values in per_reward.items():
            seen = values[~values.isnan()]
            out[f"rewards/{name}/mean"] = seen.mean().item() if len(seen) else math.nan
            out[f"rewards/{name}/std"] = seen.std().item() if len(seen) > 1 else 0.0
        return out
