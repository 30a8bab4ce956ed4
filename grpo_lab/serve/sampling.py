"""From next-token logits to a sampled token and its log-probability, for a batch of requests
that each carry their own sampling parameters and their own seeded random generator.

The processing steps come in vLLM's order (repetition penalty, temperature, min_p, top-k,
top-p), so `processed_logprobs` mean what they mean in vLLM, and a trainer's
log_softmax(logits / T) equals them when sampling is untruncated. Each row samples by the
exponential race with its own generator, so a seeded request gets the same tokens whatever shares
its batch; everything runs in float32 (docs/internals.md, "Sampling").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

LOGPROB_FLOOR = -9999.0  # vLLM floors -inf (a token outside top-k/top-p) so that JSON can carry it
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class SamplingParams:
    """The sampling fields of one completion request (vLLM's names and meanings)."""

    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 16
    seed: int | None = None  # child i of n uses seed + i
    logprobs: int | None = None  # None = no logprobs; k = the sampled token and the top k
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5


def repetition_penalty(logits, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """(B, V), (B, V) bool, (B, 1) -> (B, V): CTRL's penalty (Keskar et al. 2019) as vLLM has it."""
    penalties = torch.where(seen, penalty, torch.ones_like(logits))
    return torch.where(logits > 0, logits / penalties, logits * penalties)


def min_p_filter(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """(B, V), (B, 1): keep tokens whose probability is at least min_p times the largest."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p
    return logits.masked_fill(probs < threshold, float("-inf"))


def top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    """(B, V), (B,) ints in [1, V], (B,) floats in (0, 1]: mask everything outside top-k/top-p."""
    sorted_logits, order = logits.sort(dim=-1)  # ascending
    V = logits.shape[-1]
    if top_k is not None:
        kth_largest = sorted_logits.gather(1, (V - top_k).unsqueeze(1))  # (B, 1)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_largest, float("-inf"))
    if top_p is not None:
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1 - top_p.unsqueeze(1)  # the low tail holding mass <= 1 - p
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # (B,) sampled ids
    logprobs: torch.Tensor  # (B,) log-probability of each sampled token (raw or processed)
    logprob_rows: torch.Tensor | None  # (B, V) all log-probabilities, when a row asked for top-k


def sample(
    logits: torch.Tensor,  # (B, V) next-token logits
    params: list[SamplingParams],  # one per row
    generators: list[torch.Generator],  # one per row
    seen: list[torch.Tensor | None],  # per row, (V,) bool of prompt+output tokens (penalty only)
    logprobs_mode: str = "raw_logprobs",
) -> SampleOutput:
    """Process the logits of every row with its own parameters, then sample one token each."""
    logits = logits.float()  # bfloat16 logits keep ~3 digits; their log_softmax gets float32
    device = logits.device
    raw = torch.log_softmax(logits, dim=-1) if logprobs_mode == "raw_logprobs" else None

    # 1. repetition penalty
    if any(p.repetition_penalty != 1.0 for p in params):
        penalty = torch.tensor([[p.repetition_penalty] for p in params], device=device)
        seen_rows = torch.stack([s if s is not None else torch.zeros(logits.shape[-1],
                                                                     dtype=torch.bool,
                                                                     device=device)
                                 for s in seen])
        logits = repetition_penalty(logits, seen_rows, penalty)
    # 2. temperature (greedy rows keep their logits: vLLM divides them by 1)
    temps = [1.0 if p.greedy else p.temperature for p in params]
    if any(t != 1.0 for t in temps):
        logits = logits / torch.tensor(temps, device=device).unsqueeze(1)
    # 3. min_p (greedy requests ignore the truncation parameters, as in vLLM)
    if any(p.min_p > 0 and not p.greedy for p in params):
        min_p = torch.tensor([[0.0 if p.greedy else p.min_p] for p in params], device=device)
        logits = min_p_filter(logits, min_p)
    # 4. top-k then top-p
    V = logits.shape[-1]
    ks = [V if p.greedy or p.top_k <= 0 else min(p.top_k, V) for p in params]
    ps = [1.0 if p.greedy else p.top_p for p in params]
    use_k, use_p = any(k < V for k in ks), any(p < 1.0 for p in ps)
    if use_k or use_p:
        logits = top_k_top_p_filter(logits, torch.tensor(ks, device=device) if use_k else None,
                                    torch.tensor(ps, device=device) if use_p else None)
    processed = torch.log_softmax(logits, dim=-1)  # (B, V)

    # Sample: argmax of p / q with q ~ Exp(1) from each row's generator; argmax for greedy rows.
    q = torch.empty_like(processed)
    for q_row, p, gen in zip(q.unbind(0), params, generators, strict=True):  # views of q's rows
        if p.greedy:
            q_row.fill_(1.0)
        else:
            q_row.exponential_(generator=gen)
    q.clamp_(min=1e-30)  # an exact 0 would turn a zero-probability token into 0/0
    tokens = (processed.exp() / q).argmax(dim=-1)  # (B,)
    chosen = (raw if raw is not None else processed)
    token_logprobs = chosen.gather(1, tokens.unsqueeze(1)).squeeze(1).clamp(min=LOGPROB_FLOOR)
    want_rows = any(p.logprobs for p in params)
    return SampleOutput(tokens, token_logprobs, chosen if want_rows else None)
