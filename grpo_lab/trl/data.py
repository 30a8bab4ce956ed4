"""What TRL's AsyncGRPOTrainer trains on, from grpo_lab's run config: the prompts as a dataset of
conversations, the rewards as TRL `reward_funcs`, and a way to read a completion back into a
message (grpo_lab.trl.async_trainer runs the job)."""

from __future__ import annotations

import random

from ..data.prompts import as_conversation
from ..data.reward_set import RewardSet, call_reward
from ..train.async_config import AsyncGRPOConfig


class WeightedReward:
    """One reward of a `RewardSet` times its weight, picklable (TRL scores in a spawned process)
    and named as grpo_lab logs it (TRL logs `rewards/<__name__>`)."""

    def __init__(self, name: str, fn, weight: float):
        self.__name__, self.fn, self.weight = name, fn, weight

    def __call__(self, completions, **kwargs) -> list[float | None]:
        values = call_reward(self.__name__, self.fn, {"completions": completions, **kwargs})
        return [None if v is None else self.weight * float(v) for v in values]


def reward_funcs(config: AsyncGRPOConfig) -> list[WeightedReward]:
    """The config's rewards as TRL `reward_funcs`: TRL sums them (None counts as 0 unless every
    reward is None), which is `RewardSet.score`'s weighted sum."""
    rewards = RewardSet.parse(config.reward, config.reward_weights)
    return [WeightedReward(n, f, w) for n, f, w in zip(rewards.names, rewards.functions,
                                                       rewards.weights)]


CHATML_RESPONSE = {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
                   "fields": {"content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}
"""How an assistant turn of a ChatML template without tools is read back into a message
(transformers' `response_template`): its text up to <|im_end|>."""


def with_response_parser(tokenizer):
    """TRL's rollout worker reads each completion back into a message (`parse_response`) and
    knows the templates of well-known models only; a ChatML template it does not know (the
    offline chat model's) gets `CHATML_RESPONSE`. Others must bring their own."""
    from .cpu import require_trl

    require_trl()
    from trl.chat_template_utils import add_response_schema

    if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None):
        return tokenizer
    try:
        return add_response_schema(tokenizer)
    except ValueError:
        if "<|im_start|>" not in (tokenizer.chat_template or ""):
            raise ValueError("TRL's AsyncGRPOTrainer cannot read this model's completions back "
                             "into messages: its chat template is neither one TRL knows nor "
                             "ChatML; set tokenizer.response_template") from None
    tokenizer.response_template = CHATML_RESPONSE
    return tokenizer


def trl_dataset(config: AsyncGRPOConfig, task=None):
    """One row per prompt of the run (`steps * prompts_per_step`), drawn as grpo_lab's trainer
    draws them (seeded, never a held-out prompt): `prompt` as a conversation (TRL's async trainer
    renders every prompt with the chat template), `answer` for the rewards."""
    from datasets import Dataset

    task = task or config.make_task()
    problems = task.sample_batch(random.Random(config.seed), config.steps * config.prompts_per_step)
    return Dataset.from_list([{"prompt": as_conversation(p.prompt, config.system_prompt),
                               "answer": p.answer} for p in problems])


def max_prompt_tokens(dataset, tokenizer) -> int:
    """The longest prompt of the run in tokens, rendered as TRL's rollout worker renders it."""
    return max(len(tokenizer.apply_chat_template(row["prompt"], return_dict=False,
                                                 add_generation_prompt=True))
               for row in dataset)
