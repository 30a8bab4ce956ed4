"""Held-out greedy accuracy: the number every notebook and the demo report before and after."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..data.prompts import encode_prompts
from ..data.reward_set import checked_scores
from ..data.rewards import exact_match_reward
from ..data.tasks import Problem
from .generation import generate_completions

EVAL_TOKEN_BUDGET = 65_536
"""Tokens (prompt + new, per row) generated at once in an evaluation: the KV cache's size. At
Qwen2.5-0.5B's 12 KiB a token in bfloat16, 0.75 GiB; a toy model's 512 problems fit in one batch."""


def token_batches(lengths: Sequence[int], max_new_tokens: int, token_budget: int,
                  max_rows: int) -> list[range]:
    """Consecutive ranges of rows such that rows x (longest prompt + max_new_tokens) fits the
    budget (a row alone always goes), at most `max_rows` each."""
    batches, start, width = [], 0, 0
    for i, length in enumerate(lengths):
        width_with = max(width, length + max_new_tokens)
        rows = i - start + 1
        if i > start and (rows * width_with > token_budget or rows > max_rows):
            batches.append(range(start, i))
            start, width_with = i, length + max_new_tokens
        width = width_with
    return batches + [range(start, len(lengths))] if len(lengths) else batches


Score = Callable[[list[str], Sequence[Problem], list[list[int]]], list[float]]
"""How an evaluation scores greedy completions: (texts, their problems, their token ids) -> one
reward per completion. The trainers pass `RewardSet.correctness_scores`: the training reward's
contract, every keyword and column."""


def exact_match_scores(texts: list[str], problems: Sequence[Problem], completion_ids) -> list:
    """The default score: `exact_match_reward` against each problem's answer."""
    return exact_match_reward(texts, answer=[p.answer for p in problems])


def greedy_answers(
    model,
    tokenizer,
    problems: Sequence[Problem],
    *,
    max_new_tokens: int,
    score: Score = exact_match_scores,
    batch_size: int = 256,
    token_budget: int = EVAL_TOKEN_BUDGET,
    system_prompt: str | None = None,
    chat_template: bool | None = None,
) -> tuple[list[str], list[float]]:
    """Each problem's greedy completion and its score (prompts formatted as in training:
    grpo_lab.data.prompts). Problems go in batches of at most `batch_size` rows and
    `token_budget` tokens of prompt and completion, so the KV cache stays bounded at any size."""
    was_training = model.training
    model.eval()
    prompt_format = dict(system_prompt=system_prompt, chat_template=chat_template)
    lengths = [len(ids) for ids in encode_prompts(tokenizer, [p.prompt for p in problems],
                                                  **prompt_format)]
    texts, scores = [], []
    for rows in token_batches(lengths, max_new_tokens, token_budget, batch_size):
        chunk = [problems[i] for i in rows]
        out = generate_completions(
            model, tokenizer, [p.prompt for p in chunk], max_new_tokens=max_new_tokens,
            do_sample=False, with_logprobs=False, **prompt_format,
        )
        texts += out.texts
        scores += [float(r) for r in score(out.texts, chunk, out.completion_ids)]
    model.train(was_training)
    return texts, scores


def greedy_accuracy(model, tokenizer, problems: Sequence[Problem], *, max_new_tokens: int,
                    reward_fn: Callable = exact_match_reward, **batching) -> float:
    """Fraction of problems whose greedy completion earns `reward_fn(completions, answer=...)`
    of at least 1 (`greedy_answers`); what it returns is checked as training checks a reward
    (`checked_scores`: the reward named when it is not one number per completion). The
    trainers' own evaluation calls their correctness reward with every keyword instead."""
    name = getattr(reward_fn, "__name__", "reward_fn")
    _, scores = greedy_answers(
        model, tokenizer, problems, max_new_tokens=max_new_tokens,
        score=lambda texts, chunk, _ids: checked_scores(  # named if it returns the wrong thing
            name, reward_fn(texts, answer=[p.answer for p in chunk]), len(texts)),
        **batching)
    return sum(r >= 1.0 for r in scores) / max(len(problems), 1)  # NaN (None) is not >= 1
