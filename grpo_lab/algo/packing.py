"""Token-budget micro-batching: split one optimizer step's rollouts into forward passes by tokens.

Each micro-batch holds at most `token_budget` tokens of forward input, padding included: rows
sorted by length (`packed=False`), or several sequences packed into one row with position ids
restarting at 0 and a block-diagonal causal mask (`packed=True`). `accumulate_grpo_loss` weights
each micro-batch's loss so that the step's loss and gradient are those of the whole batch in one
pass, over every process's share too (docs/internals.md, "Token-budget micro-batches").
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from .grpo_loss import grpo_loss
from .logprobs import completion_logprobs, model_logprobs


@dataclass
class MicroBatch(ABC):
    """Some sequences of a RolloutBatch, laid out for one forward pass (padded or packed)."""

    indices: list[int]  # rows of the RolloutBatch, in the order of the tensors below
    completion_ids: torch.Tensor  # (n, C) right padded
    completion_mask: torch.Tensor  # (n, C)
    old_logps: torch.Tensor  # (n, C)
    advantages: torch.Tensor  # (n,)
    input_tokens: int  # tokens in the forward input, padding included (what the budget bounds)
    importance_weights: torch.Tensor | None = None  # (n, C) or (n, 1): pi_old / pi_sampler
    real_tokens: int = 0  # of input_tokens, those that are not padding (what the model needs)

    @property
    def num_sequences(self) -> int:
        return len(self.indices)

    @property
    def num_completion_tokens(self) -> int:
        return int(self.completion_mask.sum())

    @abstractmethod
    def logprobs_and_entropy(self, model, temperature: float, entropy: bool = True):
        """Per-token log-probabilities of the completions under `model`, and the policy's
        per-token entropy (or None), from one forward: (n, C) each. The logits are never whole:
        the head runs on the completion positions, a chunk at a time (grpo_lab.algo.logprobs)."""

    def logprobs(self, model, temperature: float) -> torch.Tensor:
        """Per-token log-probabilities of the completions under `model`: (n, C)."""
        return self.logprobs_and_entropy(model, temperature, entropy=False)[0]


@dataclass
class PaddedMicroBatch(MicroBatch):
    prompt_ids: torch.Tensor = None  # (n, P) left padded, trimmed to this micro-batch's longest
    prompt_mask: torch.Tensor = None

    def logprobs_and_entropy(self, model, temperature: float, entropy: bool = True):
        return completion_logprobs(model, self.prompt_ids, self.prompt_mask, self.completion_ids,
                                   self.completion_mask, temperature, entropy)


@dataclass
class PackedMicroBatch(MicroBatch):
    input_ids: torch.Tensor = None  # (R, L) sequences concatenated, pad at the end of a row
    position_ids: torch.Tensor = None  # (R, L) restart at 0 for every sequence
    attention_mask: torch.Tensor = None  # (R, 1, L, L) bool, block-diagonal causal
    gather_rows: torch.Tensor = None  # (n, C) row of the state predicting each completion token
    gather_cols: torch.Tensor = None  # (n, C) its position in the row

    def logprobs_and_entropy(self, model, temperature: float, entropy: bool = True):
        inputs = dict(input_ids=self.input_ids, attention_mask=self.attention_mask,
                      position_ids=self.position_ids)
        return model_logprobs(model, inputs, lambda x: x[self.gather_rows, self.gather_cols],
                              self.completion_ids, temperature, entropy)


def block_causal_mask(segments: torch.Tensor) -> torch.Tensor:
    """(R, L) segment ids -> (R, 1, L, L) bool: query i sees key j iff j <= i, same segment."""
    L = segments.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()  # (L, L)
    same = segments[:, :, None] == segments[:, None, :]  # (R, L, L)
    return (same & causal)[:, None]


def _lengths(batch) -> tuple[list[int], list[int]]:
    return batch.prompt_mask.sum(1).tolist(), batch.completion_mask.sum(1).tolist()


def _fill(items: list, cost: Callable[[list], int], budget: int) -> list[list]:
    """Greedy: append items to the current group while `cost(group) <= budget`."""
    groups, current = [], []
    for item in items:
        if current and cost(current + [item]) > budget:
            groups.append(current)
            current = []
        current.append(item)
    return groups + [current] if current else groups


def plan_padded(prompt_lens, completion_lens, token_budget: int, sort: bool = True):
    """Index groups whose padded size, rows x (longest prompt + longest completion), fits."""
    order = list(range(len(prompt_lens)))
    if sort:  # longest first: neighbours have similar lengths, so little padding
        order.sort(key=lambda i: -(prompt_lens[i] + completion_lens[i]))

    def cost(group):
        width = max(prompt_lens[i] for i in group) + max(completion_lens[i] for i in group)
        return len(group) * width

    return _fill(order, cost, token_budget)


def plan_packed(lengths, token_budget: int, row_tokens: int) -> list[list[list[int]]]:
    """Rows of sequences (first-fit decreasing into `row_tokens`), grouped into micro-batches
    whose rows x longest row fits `token_budget`. Returns micro-batches of rows of indices."""
    row_tokens = min(row_tokens, token_budget)  # a row alone must fit the budget
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((r for r, free in enumerate(room) if free >= lengths[i]), None)
        if slot is None:
            rows.append([])
            room.append(row_tokens)
            slot = len(rows) - 1
        rows[slot].append(i)
        room[slot] -= lengths[i]

    def cost(group):
        return len(group) * max(sum(lengths[i] for i in row) for row in group)

    return _fill(rows, cost, token_budget)


def make_micro_batches(
    batch, token_budget: int | None, *, packed: bool = False, row_tokens: int = 64,
    sort: bool = True,
) -> list[MicroBatch]:
    """Split a RolloutBatch into micro-batches of at most `token_budget` forward tokens.

    `token_budget=None` gives one micro-batch holding the whole batch as it is (the plain pass).
    Raises ValueError if one sequence alone exceeds the budget (or a packed row).
    """
    prompt_lens, completion_lens = _lengths(batch)
    lengths = [p + c for p, c in zip(prompt_lens, completion_lens, strict=True)]
    if token_budget is None:
        plan = [list(range(len(lengths)))]
        return [_padded(batch, plan[0], prompt_lens, completion_lens)]
    limit = min(token_budget, row_tokens) if packed else token_budget
    if max(lengths) > limit:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the token budget {limit}")
    if packed:
        return [_packed(batch, rows, prompt_lens, completion_lens)
                for rows in plan_packed(lengths, token_budget, row_tokens)]
    return [_padded(batch, group, prompt_lens, completion_lens)
            for group in plan_padded(prompt_lens, completion_lens, token_budget, sort)]


def _padded(batch, idx: list[int], prompt_lens, completion_lens) -> PaddedMicroBatch:
    P = max(prompt_lens[i] for i in idx)  # prompts are left padded: keep the last P columns
    C = max(max(completion_lens[i] for i in idx), 1)  # completions right padded: the first C
    rows = torch.tensor(idx)
    return PaddedMicroBatch(
        **_sequence_fields(batch, idx, C),
        input_tokens=len(idx) * (P + C),
        real_tokens=sum(prompt_lens[i] + completion_lens[i] for i in idx),
        prompt_ids=batch.prompt_ids[rows][:, batch.prompt_ids.shape[1] - P:],
        prompt_mask=batch.prompt_mask[rows][:, batch.prompt_mask.shape[1] - P:],
    )


def _sequence_fields(batch, idx: list[int], C: int) -> dict:
    """What every micro-batch layout takes from the batch per sequence (its first C completion
    columns): the completions, their mask and old logprobs, and the advantages."""
    rows = torch.tensor(idx)
    return dict(indices=idx, completion_ids=batch.completion_ids[rows, :C],
                completion_mask=batch.completion_mask[rows, :C],
                old_logps=batch.old_logps[rows, :C], advantages=batch.advantages[rows])


def _packed(batch, rows: list[list[int]], prompt_lens, completion_lens) -> PackedMicroBatch:
    idx = [i for row in rows for i in row]
    C = max(max(completion_lens[i] for i in idx), 1)
    width = max(sum(prompt_lens[i] + completion_lens[i] for i in row) for row in rows)
    pad = 0
    input_ids = torch.full((len(rows), width), pad, dtype=batch.prompt_ids.dtype)
    position_ids = torch.zeros(len(rows), width, dtype=torch.long)
    segments = torch.full((len(rows), width), -1, dtype=torch.long)  # -1: padding at a row's end
    gather_rows = torch.zeros(len(idx), C, dtype=torch.long)
    gather_cols = torch.zeros(len(idx), C, dtype=torch.long)
    k = 0
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            P, Ci = prompt_lens[i], completion_lens[i]
            prompt = batch.prompt_ids[i, batch.prompt_ids.shape[1] - P:]  # real prompt tokens
            seq = torch.cat([prompt, batch.completion_ids[i, :Ci]])
            input_ids[r, offset:offset + P + Ci] = seq
            position_ids[r, offset:offset + P + Ci] = torch.arange(P + Ci)
            segments[r, offset:offset + P + Ci] = k
            # The logit at position t predicts token t+1: completion token j is predicted at
            # offset + P - 1 + j. Padding columns (j >= Ci) point at the last real one.
            gather_rows[k] = r
            gather_cols[k] = offset + P - 1 + torch.arange(C).clamp(max=max(Ci - 1, 0))
            offset += P + Ci
            k += 1
    return PackedMicroBatch(
        **_sequence_fields(batch, idx, C),
        input_tokens=len(rows) * width,
        real_tokens=sum(prompt_lens[i] + completion_lens[i] for i in idx),
        input_ids=input_ids.to(batch.prompt_ids.device),
        position_ids=position_ids.to(batch.prompt_ids.device),
        attention_mask=block_causal_mask(segments).to(batch.prompt_ids.device),
        gather_rows=gather_rows.to(batch.prompt_ids.device),
        gather_cols=gather_cols.to(batch.prompt_ids.device),
    )


def accumulate_grpo_loss(
    model,
    micro_batches: list[MicroBatch],
    *,
    temperature: float,
    loss_type: str = "grpo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    ref_logps: list[torch.Tensor] | None = None,
    max_completion_length: int | None = None,
    backward: bool = True,
    before_each: Callable[[MicroBatch], None] | None = None,
    on_logprobs: Callable[[MicroBatch, torch.Tensor], None] | None = None,
    processes=None,
    use_bias_correction_kl: bool = False,
) -> tuple[float, dict[str, float]]:
    """Forward (and backward) every micro-batch; returns the step's loss and metrics.

    Each micro-batch's `grpo_loss` is weighted by its share of the step's sequences (GRPO,
    Dr. GRPO) or tokens (DAPO), so the accumulated gradient is the whole batch's. The metrics are
    masked means over tokens, weighted by the micro-batch's share of the step's tokens.
    `before_each` runs before each forward pass (the async trainer uses it to pick thread counts).
    `on_logprobs(mb, logps)` gets each micro-batch's logprobs, detached, between its forward and
    its loss: the policy's before this step's update, so a hook may set the micro-batch's
    `old_logps` and `importance_weights` from them (grpo_lab.train.grpo_step.ProximalLogprobs)
    at no extra pass.
    `processes` (grpo_lab.train.distributed.Processes, several under `accelerate launch`): the
    micro-batches are this process's share of the step; `model` is the wrapped (DDP/FSDP2) one.
    """
    num_sequences = sum(mb.num_sequences for mb in micro_batches)
    num_tokens = sum(mb.num_completion_tokens for mb in micro_batches)
    max_len = max_completion_length or max(mb.completion_ids.shape[1] for mb in micro_batches)
    distributed = processes is not None and processes.distributed
    passes = len(micro_batches)
    if distributed:  # shares of the whole step: every process's sequences and tokens
        _, (num_sequences, num_tokens) = processes.loss_scale(loss_type, num_sequences, num_tokens)
        # As many passes on every process (one gradient sync each step, FSDP2's weight gathers):
        # a process with fewer micro-batches repeats its first one with weight 0.
        passes = processes.passes(len(micro_batches))
    total, metrics, extremes = 0.0, {}, {}
    for k in range(passes):
        real = k < len(micro_batches)
        mb = micro_batches[k if real else 0]
        if before_each is not None:
            before_each(mb)
        share = (mb.num_completion_tokens / max(num_tokens, 1) if loss_type == "dapo"
                 else mb.num_sequences / num_sequences) if real else 0.0
        # Several processes: gradients sync once, after the last pass.
        with processes.no_sync(model, sync=k == passes - 1) if distributed else nullcontext():
            logps, entropy = mb.logprobs_and_entropy(model, temperature)
            if on_logprobs is not None and real:
                on_logprobs(mb, logps.detach())
            loss, mb_metrics = grpo_loss(
                logps, mb.old_logps, mb.advantages, mb.completion_mask, loss_type=loss_type,
                epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
                ref_logps=None if ref_logps is None else ref_logps[k if real else 0],
                max_completion_length=max_len, entropy=entropy,
                importance_weights=mb.importance_weights if real else None,
                use_bias_correction_kl=use_bias_correction_kl,
            )
            if backward and not distributed:
                (loss * share).backward()
            elif backward:  # the all-reduce averages over the processes: times their number
                processes.backward(loss * (share * processes.num_processes))
        total += loss.item() * share
        token_share = mb.num_completion_tokens / max(num_tokens, 1) if real else 0.0
        for name, value in mb_metrics.items():
            if name.endswith(("_min", "_max")):  # extremes over the step's completions
                if real:
                    pick = min if name.endswith("_min") else max
                    extremes[name] = pick(extremes.get(name, value), value)
            else:
                metrics[name] = metrics.get(name, 0.0) + value * token_share
    if distributed:  # each process summed its part of the step's numbers: add them up
        names = sorted(metrics)
        sums = processes.sum([total, *(metrics[n] for n in names)])
        total, metrics = sums[0], dict(zip(names, sums[1:], strict=True))
        everyone = processes.gather(extremes)
        extremes = {n: (min if n.endswith("_min") else max)(e[n] for e in everyone if n in e)
                    for n in sorted(set().union(*everyone))}
    return total, {**metrics, **extremes}
