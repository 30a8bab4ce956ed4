"""Sampling completions with their per-token log-probabilities, in process, with `generate`.

The log-probabilities are the *processed* ones (after temperature), the same quantity vLLM returns
with `--logprobs-mode processed_logprobs`, so the trainer can use them as the old policy's.
"""

from __future__ import annotations

import inspect

import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    TemperatureLogitsWarper,
)

from ..data.completions import Completions
from ..data.prompts import Prompt, encode_prompts


def sampling_config(tokenizer, max_new_tokens: int, do_sample: bool = True) -> GenerationConfig:
    """A full config so that a hub model's own defaults (top_k=50, penalties...) never leak in.
    The temperature is `ChosenLogprobs`'s to apply (`sample_from_ids`), so that it sees the
    processed logits."""
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        repetition_penalty=1.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if do_sample:
        # GRPO scores tokens with softmax(logits / T): sampling must not truncate the distribution.
        kwargs.update(temperature=1.0, top_k=0, top_p=1.0)
    return GenerationConfig(**kwargs)


class ChosenLogprobs(LogitsProcessor):
    """The log-probability of each sampled token, kept as `generate` samples it.

    As the last logits processor it sees the scores the next token is drawn from (after the
    temperature). It keeps one step's log-softmax, (B, V), and at the next step, when the token
    drawn from it is the last column of `input_ids`, keeps that token's entry: (B,) a step.
    Asking `generate` for `output_scores` instead holds every step's (B, V) to the end, which
    at a real vocabulary (Qwen2.5's 151,936 columns) outgrows the model's own memory."""

    def __init__(self):
        self.logprobs: list[torch.Tensor] = []  # (B,) per sampled token but the last
        self.pending: torch.Tensor | None = None  # (B, V): the last step's log-softmax

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.take(input_ids[:, -1])
        self.pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def take(self, tokens: torch.Tensor) -> None:
        """The pending step's log-probabilities of `tokens` (B,), the tokens drawn from it."""
        if self.pending is not None:
            self.logprobs.append(self.pending.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))
            self.pending = None

    def finish(self, new_ids: torch.Tensor) -> torch.Tensor:
        """(B, T_new) logprobs of the new tokens, once `generate` returned them."""
        T = new_ids.shape[1]
        if len(self.logprobs) < T:  # the last token's step is still pending
            self.take(new_ids[:, len(self.logprobs)])
        return torch.stack(self.logprobs[:T], dim=1) if T else new_ids.float()


def generate_completions(
    model,
    tokenizer,
    prompts: list[Prompt],
    *,
    max_new_tokens: int,
    num_generations: int = 1,
    temperature: float = 1.0,
    do_sample: bool = True,
    system_prompt: str | None = None,
    chat_template: bool | None = None,
    with_logprobs: bool = True,
) -> Completions:
    """Sample `num_generations` completions per prompt (greedy if `do_sample=False`); prompts are
    text or conversations, turned into ids as TRL does (grpo_lab.data.prompts)."""
    prompt_ids = encode_prompts(tokenizer, prompts, system_prompt=system_prompt,
                                chat_template=chat_template)  # no padding: sample_from_ids pads
    return sample_from_ids(model, tokenizer, prompt_ids, max_new_tokens=max_new_tokens,
                           num_generations=num_generations, temperature=temperature,
                           do_sample=do_sample, with_logprobs=with_logprobs)


def common_prefix_length(prompt_ids: list[list[int]]) -> int:
    """How many leading tokens every prompt shares (a chat template's system turn, a task's
    instructions), leaving each prompt at least its last token of its own."""
    if len(prompt_ids) < 2:
        return 0
    limit = min(map(len, prompt_ids)) - 1
    first = prompt_ids[0]
    n = 0
    while n < limit and all(r[n] == first[n] for r in prompt_ids):
        n += 1
    return n


def lay_out_prompts(prompt_ids: list[list[int]], common: int, pad: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, W) ids and mask, the `common` shared tokens first in every row, then the padding,
    then each prompt's own tokens: the positions (the mask's cumulative sum) are each token's
    place in its own prompt, and the shared tokens sit in the same columns of every row."""
    width = max(map(len, prompt_ids))
    ids = [r[:common] + [pad] * (width - len(r)) + r[common:] for r in prompt_ids]
    mask = [[1] * common + [0] * (width - len(r)) + [1] * (len(r) - common) for r in prompt_ids]
    return torch.tensor(ids), torch.tensor(mask)


def shared_prompt_cache(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                        num_generations: int, common: int = 0) -> dict:
    """The prompts' KV cache, each shared token computed once, as `generate`'s keyword:
    the `common` leading tokens of every prompt once for all of them, then (with G > 1) each
    prompt's own tokens but its last once for its G rows; `generate` computes the rest.
    prompt_ids, prompt_mask: (N, P) laid out by `lay_out_prompts`, one row per prompt.
    Empty when nothing is shared."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    takes = inspect.signature(base.forward).parameters
    name = "cache" if "cache" in takes else "past_key_values"
    # Only the cache is wanted: one position's logits, not (N, P, V) (where the model allows).
    keep = {"logits_to_keep": 1} if "logits_to_keep" in takes else {}
    cache, cached, (rows, width) = DynamicCache(), 0, prompt_ids.shape

    def prefill(ids: torch.Tensor, start: int, end: int) -> None:
        mask = prompt_mask[:ids.shape[0], :end]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, start:end]
        model(input_ids=ids[:, start:end], attention_mask=mask, position_ids=positions,
              use_cache=True, **{name: cache}, **keep)

    if common > 0 and rows > 1:  # the shared tokens: one row, then one copy per prompt
        prefill(prompt_ids[:1], 0, common)
        cache.batch_repeat_interleave(rows)
        cached = common
    if num_generations > 1 and width - 1 > cached:  # each prompt's own tokens, but its last
        prefill(prompt_ids, cached, width - 1)
        cached = width - 1
    if not cached:
        return {}
    if num_generations > 1:
        cache.batch_repeat_interleave(num_generations)  # (N, ...) -> (N * G, ...), prompt-major
    return {name: cache}


def check_context(model, prompt_tokens: int, max_new_tokens: int) -> None:
    """A ValueError when the longest prompt plus `max_new_tokens` does not fit the model's
    context (`max_position_embeddings`), as `grpo-lab serve` and vLLM answer 400: the positions
    past it are ones the model never saw in training."""
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and prompt_tokens + max_new_tokens > context:
        raise ValueError(
            f"a prompt of {prompt_tokens} tokens plus {max_new_tokens} completion tokens "
            f"(max_completion_length) is {prompt_tokens + max_new_tokens} tokens, past the model's "
            f"context of {context} (max_position_embeddings): shorten the prompts or lower "
            "max_completion_length")


@torch.no_grad()
def sample_from_ids(
    model,
    tokenizer,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    num_generations: int = 1,
    temperature: float = 1.0,
    do_sample: bool = True,
    with_logprobs: bool = True,
) -> Completions:
    """Sample from prompts given as token ids: the one sampling loop of grpo_lab's in-process
    generators (the trainer, the evaluation and LocalGenerator all come here). The tokens every
    prompt starts with (a chat template's system turn) are prefilled once for all prompts, and
    with G > 1 each prompt once for its G rows (`shared_prompt_cache`): the same tokens and
    logprobs, up to float rounding, for a fraction of the prompts' compute.
    `with_logprobs=False` (an evaluation) leaves each completion's logprobs empty. A prompt
    whose length plus `max_new_tokens` passes the model's context is refused, as a server does."""
    device = next(model.parameters()).device
    width = max(map(len, prompt_ids))
    check_context(model, width, max_new_tokens)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    common = common_prefix_length(prompt_ids)
    ids, mask = (t.to(device) for t in lay_out_prompts(prompt_ids, common, pad))  # (N, P)
    cache = shared_prompt_cache(model, ids, mask, num_generations, common)
    processors = LogitsProcessorList()
    if do_sample and temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))  # scores = logits / T
    chosen = ChosenLogprobs() if with_logprobs else None
    if chosen is not None:
        processors.append(chosen)  # last: it sees what the tokens are drawn from
    out = model.generate(
        input_ids=ids.repeat_interleave(num_generations, 0),  # (B, P), prompt-major
        attention_mask=mask.repeat_interleave(num_generations, 0),
        generation_config=sampling_config(tokenizer, max_new_tokens, do_sample),
        logits_processor=processors,
        **cache,
    )
    rows = [r for r in prompt_ids for _ in range(num_generations)]
    new_ids = out[:, width:]  # (B, T_new)
    token_logprobs = chosen.finish(new_ids) if chosen is not None else None

    completion_ids, logprobs, finish = [], [], []
    for row in range(new_ids.shape[0]):
        ids = new_ids[row].tolist()
        # Up to and including the first EOS ("stop"); no EOS within the cap is "length".
        stop = ids.index(eos) + 1 if eos in ids else len(ids)
        completion_ids.append(ids[:stop])
        logprobs.append(token_logprobs[row, :stop].tolist() if with_logprobs else [])
        finish.append("stop" if eos in ids else "length")
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return Completions([list(r) for r in rows], completion_ids, logprobs, texts, finish)
