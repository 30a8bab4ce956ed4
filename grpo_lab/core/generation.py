"""Sampling completions with their per-token log-probabilities, in process, with `generate`.

The log-probabilities are the *processed* ones (after temperature), the same quantity vLLM returns
with `--logprobs-mode processed_logprobs`, so the trainer can use them as the old policy's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import GenerationConfig


@dataclass
class Completions:
    """Completions of a list of prompts, `num_generations` per prompt, prompt-major order."""

    prompt_ids: list[list[int]]  # per completion, the prompt's token ids (no padding)
    completion_ids: list[list[int]]  # sampled ids, up to and including EOS
    logprobs: list[list[float]]  # log p(token) under the sampling distribution
    texts: list[str]  # decoded completions without special tokens
    finish_reasons: list[str] = field(default_factory=list)  # "stop" (EOS) or "length"

    def __len__(self) -> int:
        return len(self.completion_ids)

    @property
    def num_tokens(self) -> int:
        return sum(len(c) for c in self.completion_ids)


def sampling_config(
    tokenizer, max_new_tokens: int, temperature: float = 1.0, do_sample: bool = True
) -> GenerationConfig:
    """A full config so that a hub model's own defaults (top_k=50, penalties...) never leak in."""
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        do_sample=do_sample,
        repetition_penalty=1.0,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        output_scores=True,
        return_dict_in_generate=True,
    )
    if do_sample:
        # GRPO scores tokens with softmax(logits / T): sampling must not truncate the distribution.
        kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
    return GenerationConfig(**kwargs)


@torch.no_grad()
def generate_completions(
    model,
    tokenizer,
    prompts: list[str],
    *,
    max_new_tokens: int,
    num_generations: int = 1,
    temperature: float = 1.0,
    do_sample: bool = True,
) -> Completions:
    """Sample `num_generations` completions per prompt (greedy if `do_sample=False`)."""
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True)  # left padded
    input_ids = enc["input_ids"].repeat_interleave(num_generations, dim=0).to(device)
    attention_mask = enc["attention_mask"].repeat_interleave(num_generations, dim=0).to(device)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        generation_config=sampling_config(tokenizer, max_new_tokens, temperature, do_sample),
    )
    new_ids = out.sequences[:, input_ids.shape[1] :]  # (B, T_new)
    scores = torch.stack(out.scores, dim=1).float()  # (B, T_new, V) logits after temperature
    token_logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new_ids.unsqueeze(-1)).squeeze(-1)

    prompt_ids, completion_ids, logprobs, finish = [], [], [], []
    eos = tokenizer.eos_token_id
    for row in range(new_ids.shape[0]):
        ids = new_ids[row].tolist()
        stop = ids.index(eos) + 1 if eos in ids else len(ids)  # keep the EOS token itself
        completion_ids.append(ids[:stop])
        logprobs.append(token_logprobs[row, :stop].tolist())
        finish.append("stop" if stop <= len(ids) and eos in ids[:stop] else "length")
        prompt_ids.append(input_ids[row][attention_mask[row].bool()].tolist())
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return Completions(prompt_ids, completion_ids, logprobs, texts, finish)
