"""Sampled completions as lists: what every generator returns, in process or over HTTP.

A dataclass of lists with no torch in it, so the HTTP rollout path (`rollout/http_generator`)
and the proxy's users need neither torch nor transformers to hold a batch of completions.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    FIELDS = ("prompt_ids", "completion_ids", "logprobs", "texts", "finish_reasons")

    def __getitem__(self, rows: slice) -> Completions:
        """Completions `rows` (a slice), e.g. one prompt's group: `out[k * G:(k + 1) * G]`."""
        return Completions(*(getattr(self, f)[rows] for f in self.FIELDS))

    @classmethod
    def concat(cls, parts: list[Completions]) -> Completions:
        """Several batches' completions as one, in the order given."""
        return cls(*(sum((getattr(c, f) for c in parts), []) for f in cls.FIELDS))

    @classmethod
    def from_choices(cls, replies: list[dict]) -> Completions:
        """From `/v1/completions` replies (vLLM's fields, `return_token_ids` and processed
        logprobs), choices in reply order: prompt-major when the requests were."""
        choices = [choice for reply in replies for choice in reply["choices"]]
        return cls([c["prompt_token_ids"] for c in choices], [c["token_ids"] for c in choices],
                   [c["logprobs"]["token_logprobs"] for c in choices],
                   [c["text"] for c in choices], [c["finish_reason"] for c in choices])
