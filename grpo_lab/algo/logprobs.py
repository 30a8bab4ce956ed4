"""Per-token log-probabilities at a real vocabulary's size, without its (rows x V) logits at once.

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
