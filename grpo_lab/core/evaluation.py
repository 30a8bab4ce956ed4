"""Held-out greedy accuracy: the number every notebook and the demo report before and after."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .generation import generate_completions
from .rewards import exact_match_reward
from .tasks import Problem


def greedy_accuracy(
    model,
    tokenizer,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int,
    reward_fn: Callable = exact_match_reward,
    batch_size: int = 256,
    system_prompt: str | None = None,
    chat_template: bool | None = None,
) -> float:
    """Fraction of problems whose greedy completion earns reward 1 (prompts formatted as in
    training: grpo_lab.core.prompts)."""
    was_training = model.training
    model.eval()
    correct = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        out = generate_completions(
            model, tokenizer, [p.prompt for p in chunk], max_new_tokens=max_new_tokens,
            do_sample=False, system_prompt=system_prompt, chat_template=chat_template,
        )
        correct += sum(r >= 1.0 for r in reward_fn(out.texts, answer=[p.answer for p in chunk]))
    model.train(was_training)
    return correct / max(len(problems), 1)
