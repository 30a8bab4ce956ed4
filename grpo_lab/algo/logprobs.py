"""Per-token log-probabilities, the one home of GRPO's first step: log pi(token | context) at the
sampling temperature, and the policy's entropy there (a metric).

What the trainers call is at the end: `policy_logprobs` (and `_and_entropy`) for completions
after prompts, `token_logprobs` for given logits. Underneath, everything runs at a real
vocabulary's size without its (rows x V) logits at once.

A toy model's logits are small; Qwen2.5's have V = 151,936 columns, so the logits of a batch of
completions, (B, T, V) in float32, take B x T x 0.6 MB: 16 completions of 256 tokens, 2.5 GB,
and a log-softmax of them as much again. The trainer needs one number per token (the chosen
token's log-probability) and one metric (the entropy), so here

    1. the model's body runs once and keeps its last hidden states: (n, L, H), H << V;
    2. only the positions that predict a completion token are kept: (n, C, H);
    3. the LM head, the log-softmax and the gather run over chunks of those positions, at most
       `LOGITS_CHUNK_ELEMENTS` logits at a time; with gradients, each chunk is recomputed in the
       backward pass (activation checkpointing), so no chunk's logits outlive it.

The values are those of `log_softmax(logits / T).gather(target)` over the whole batch (the same
operations per position), and so is the gradient. TRL does the same with `logits_to_keep`,
`selective_log_softmax` and, in its asynchronous trainer, a chunked LM head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

LOGITS_CHUNK_ELEMENTS = 2**24
"""Logits computed at once, per chunk: 2^24 float32 = 64 MiB (a chunk's log-softmax and entropy
take a few times that), 110 positions of Qwen2.5's vocabulary, or every position of a toy
model's (one chunk: the plain computation)."""

HEAD_SPLIT_MODEL_TYPES = frozenset(
    {"llama", "qwen2", "qwen3", "mistral", "qwen2_moe", "qwen3_moe", "olmo2", "smollm3"})
"""Architectures whose causal-LM forward is `lm_head(decoder(...))` and nothing more (no logit
soft-capping or scaling), so the two halves may be run apart."""


def chunk_positions(vocab_size: int, elements: int = LOGITS_CHUNK_ELEMENTS) -> int:
    """Positions per chunk so that a chunk holds at most `elements` logits."""
    return max(1, elements // max(vocab_size, 1))


def _scored(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool):
    """log softmax(logits / T)[target], and the entropy of softmax(logits / T): (N, V), (N,)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logps = torch.log_softmax(logits, dim=-1)  # (N, V)
    chosen = logps.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N,)
    if not entropy:
        return chosen, None
    with torch.no_grad():  # a metric: H = -sum_v p log p
        return chosen, -(logps.exp() * logps).sum(-1)


def selective_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                       entropy: bool = False, chunk: int | None = None):
    """From given logits (..., V): the chosen tokens' logprobs (...), and the entropy (...) or
    None, one chunk of positions at a time (the log-softmax of one chunk alive at once)."""
    shape, V = targets.shape, logits.shape[-1]
    flat, flat_targets = logits.reshape(-1, V), targets.reshape(-1)
    step = chunk or chunk_positions(V)
    parts = [_scored(flat[i:i + step], flat_targets[i:i + step], temperature, entropy)
             for i in range(0, flat.shape[0], step)]
    chosen = torch.cat([p[0] for p in parts]).view(shape)
    return chosen, (torch.cat([p[1] for p in parts]).view(shape) if entropy else None)


def head_split(model) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """(decoder, lm_head) of a causal LM, or None where running them apart is not safe: an
    architecture that does more than `lm_head(hidden)`, or a model wrapped for several processes
    (DDP, FSDP2), whose hooks run only through its own forward."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return None
    try:
        from torch.distributed.fsdp import FSDPModule
        if isinstance(model, FSDPModule) or isinstance(base, FSDPModule):
            return None
    except ImportError:  # pragma: no cover (torch without distributed)
        pass
    config = getattr(base, "config", None)
    if getattr(config, "model_type", None) not in HEAD_SPLIT_MODEL_TYPES:
        return None
    if not (hasattr(base, "get_decoder") and hasattr(base, "get_output_embeddings")):
        return None
    head = base.get_output_embeddings()
    return (base.get_decoder(), head) if isinstance(head, torch.nn.Module) else None


def _head_chunk(head, temperature: float, entropy: bool):
    def run(hidden: torch.Tensor, targets: torch.Tensor):  # (N, H), (N,)
        return _scored(head(hidden), targets, temperature, entropy)
    return run


def model_logprobs(
    model,
    inputs: dict,
    pick: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    temperature: float = 1.0,
    entropy: bool = False,
    logits_to_keep: int | None = None,
    chunk: int | None = None,
):
    """Logprobs of `targets` (n, C) under `model` run on `inputs` (input_ids, attention_mask,
    position_ids); `pick` maps a (rows, L, D) tensor to the (n, C, D) positions that predict the
    targets. Returns ((n, C), (n, C) entropy or None).

    With the decoder and head apart (`head_split`): the head runs on the picked hidden states
    chunk by chunk. Otherwise the model's own forward gives the logits (only the last
    `logits_to_keep` positions where the layout allows) and the chunks start from them.
    """
    split = head_split(model)
    if split is None:
        extra = {"logits_to_keep": logits_to_keep} if logits_to_keep else {}
        logits = pick(model(**inputs, **extra).logits)  # (n, C, V)
        return selective_logprobs(logits, targets, temperature, entropy, chunk)
    decoder, head = split
    hidden = pick(decoder(**inputs, use_cache=False).last_hidden_state)  # (n, C, H)
    flat, flat_targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    step = chunk or chunk_positions(head.weight.shape[0])
    run = _head_chunk(head, temperature, entropy)
    # With gradients and several chunks, keep only each chunk's hidden states: its logits are
    # recomputed in the backward pass instead of held until it. One chunk: the plain way.
    recompute = torch.is_grad_enabled() and flat.requires_grad and flat.shape[0] > step
    parts = []
    for i in range(0, flat.shape[0], step):
        args = (flat[i:i + step], flat_targets[i:i + step])
        parts.append(checkpoint(run, *args, use_reentrant=False) if recompute else run(*args))
    chosen = torch.cat([p[0] for p in parts]).view(targets.shape)
    return chosen, (torch.cat([p[1] for p in parts]).view(targets.shape) if entropy else None)


# ---------------------------------------------------------------------------------------------
# Completions under a model: what the trainers call


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """log softmax(logits / T)[target] per position: (B, T, V), (B, T) -> (B, T).

    Dividing by the sampling temperature makes these the log-probabilities of the distribution
    the tokens were actually sampled from (vLLM's `processed_logprobs`). The log-softmax runs
    over chunks of positions (grpo_lab.algo.logprobs): a real vocabulary's is never whole.
    """
    return selective_logprobs(logits, targets, temperature)[0]


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding (`cumsum - 1`), exactly as `generate` derives them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def token_logprobs_and_entropy(logits: torch.Tensor, targets: torch.Tensor,
                               temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs` and the entropy in nats of softmax(logits / T) at each position, from
    the same log-softmax: (B, T, V), (B, T) -> ((B, T), (B, T)).

    The entropy is a metric (no gradient): its mean over completion tokens is TRL's `entropy`.
    A policy whose entropy falls towards 0 samples the same tokens every time (entropy
    collapse), and its groups stop differing.
    """
    return selective_logprobs(logits, targets, temperature, entropy=True)


def completion_logits(
    model,
    prompt_ids: torch.Tensor,  # (B, P) left padded
    prompt_mask: torch.Tensor,  # (B, P)
    completion_ids: torch.Tensor,  # (B, T) right padded
    completion_mask: torch.Tensor,  # (B, T)
) -> torch.Tensor:
    """The logits that predict each completion token under `model`: (B, T, V)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P+T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    ).logits  # (B, P+T, V)
    # The logit at position t predicts token t+1: keep the T positions that predict the completion.
    T = completion_ids.shape[1]
    return logits[:, -T - 1 : -1, :]


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                        temperature: float = 1.0, entropy: bool = False):
    """Per-token log-probabilities of the completions under `model`, (B, T), and the entropy
    (B, T) or None: `completion_logits` + `token_logprobs_and_entropy`, without the (B, T, V)
    logits at once (the head runs on the completion positions, chunk by chunk:
    grpo_lab.algo.logprobs.model_logprobs)."""
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P+T)
    attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
    inputs = dict(input_ids=input_ids, attention_mask=attention_mask,
                  position_ids=position_ids_from_mask(attention_mask))
    T = completion_ids.shape[1]
    # The state at position t predicts token t+1: the T positions before the last.
    return model_logprobs(model, inputs, lambda x: x[:, -T - 1:-1], completion_ids,
                          temperature, entropy, logits_to_keep=T + 1)


def policy_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                    temperature: float = 1.0) -> torch.Tensor:
    """Per-token log-probabilities of the completions under `model`: (B, T)."""
    return completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                               temperature)[0]


def policy_logprobs_and_entropy(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                                temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`policy_logprobs` and the policy's per-token entropy, from the same forward: (B, T) each."""
    return completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                               temperature, entropy=True)
