"""Each prompt forwarded once for its group: a group's G completions in one row behind the prompt.

GRPO samples G completions of every prompt, so a padded batch forwards each prompt G times. Here
one row holds a group: its prompt once, then its G completions one after the other,

    row     [ p p p p p p p | c1 c1 c1 c1 | c2 c2 c2 | ... | cG cG cG cG ]
    mask    each completion's tokens see the prompt and their own completion's earlier tokens
    pos     0 1 2 3 4 5 6   | 7  8  9  10 | 7  8  9  | ... | 7  8  9  10

so each completion is scored as in a row of its own (Prefix Grouper, Liu et al. 2025, does the
same without the dense mask; TRL's AsyncGRPOTrainer packs its micro-batches into a prefix trie).
Fewer tokens go through the model: on the default task (7 prompt tokens, 4-5 per completion,
G = 8) 624 instead of 1,408 per step, and the forward and backward take ~0.43x the time (one
thread; benchmarks/async_vs_sync.py measures the throughput). The logprobs are the padded pass's
up to float rounding (~1e-6), and so are the loss and the gradient, which reach each prompt
token through every completion that sees it.

The mask is dense (row x row), and a completion's attention spans the whole row: for long
completions (hundreds of tokens) it costs more than it saves, hence `max_row_tokens`. The
micro-batches are grpo_lab.algo.packing's packed ones (a 4-D mask, position ids, a gather of
the logits), so both trainers use them as they use any other layout.
"""

from __future__ import annotations

import torch

from .packing import (
    MicroBatch,
    PackedMicroBatch,
    _fill,
    _lengths,
    _sequence_fields,
    make_micro_batches,
)


def supports_shared_prompt(model) -> bool:
    """Whether the model's attention takes a 4-D mask as given (sdpa, eager; not flash)."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", "eager")


def groups_share_prompts(batch, group_size: int) -> bool:
    """Whether the batch is whole groups of `group_size` rows, each group with one prompt."""
    B = batch.prompt_ids.shape[0]
    if group_size < 2 or B % group_size:
        return False
    grouped = batch.prompt_ids.view(B // group_size, group_size, -1)  # (B/G, G, P)
    masks = batch.prompt_mask.view(B // group_size, group_size, -1)
    return bool((grouped == grouped[:, :1]).all() and (masks == masks[:, :1]).all())


def shared_prompt_mask(segments: torch.Tensor) -> torch.Tensor:
    """(R, L) segment ids (0 the prompt, k the k-th completion, -1 padding at a row's end) ->
    (R, 1, L, L) bool: query i sees key j iff j <= i and j is in the prompt or in i's segment."""
    L = segments.shape[1]
    causal = torch.ones(L, L, dtype=torch.bool).tril()  # (L, L)
    same = segments[:, :, None] == segments[:, None, :]  # (R, L, L)
    prompt_key = (segments == 0)[:, None, :]  # (R, 1, L)
    return ((same | prompt_key) & causal)[:, None]


def shared_prompt_micro_batch(batch, groups: list[int], group_size: int, prompt_lens,
                              completion_lens) -> PackedMicroBatch:
    """One micro-batch of whole groups (indices of groups), one row each."""
    G = group_size
    idx = [g * G + k for g in groups for k in range(G)]
    C = max(max(completion_lens[i] for i in idx), 1)
    prompts, completions = batch.prompt_ids.tolist(), batch.completion_ids.tolist()
    ids, positions, segments, gather_rows, gather_cols = [], [], [], [], []
    for r, g in enumerate(groups):
        P = prompt_lens[g * G]
        row_ids, row_pos, row_seg = prompts[g * G][-P:], list(range(P)), [0] * P
        for k in range(G):
            i = g * G + k
            Ci, offset = completion_lens[i], len(row_ids)
            row_ids += completions[i][:Ci]
            row_pos += range(P, P + Ci)
            row_seg += [k + 1] * Ci
            # Completion token 0 is predicted by the prompt's last logit, token j > 0 by the
            # logit at its predecessor; padding columns (j >= Ci) point at the last real one.
            gather_rows.append([r] * C)
            gather_cols.append([P - 1 if j == 0 else offset + j - 1
                                for j in (min(j, max(Ci - 1, 0)) for j in range(C))])
        ids.append(row_ids)
        positions.append(row_pos)
        segments.append(row_seg)
    width = max(map(len, ids))

    def padded(rows, value):  # rows padded at the end to the longest: (R, width)
        return torch.tensor([row + [value] * (width - len(row)) for row in rows])

    device = batch.prompt_ids.device
    return PackedMicroBatch(
        **_sequence_fields(batch, idx, C),
        input_tokens=len(groups) * width,
        real_tokens=sum(map(len, ids)),
        input_ids=padded(ids, 0).to(device=device, dtype=batch.prompt_ids.dtype),
        position_ids=padded(positions, 0).to(device),
        attention_mask=shared_prompt_mask(padded(segments, -1)).to(device),
        gather_rows=torch.tensor(gather_rows).to(device),
        gather_cols=torch.tensor(gather_cols).to(device),
    )


def layout_micro_batches(batch, token_budget: int | None, *, group_size: int | None = None,
                         max_row_tokens: int = 512, packed: bool = False, row_tokens: int = 64
                         ) -> list[MicroBatch]:
    """The step's micro-batches: a row per group (`group_size` = G) when the batch is whole
    groups and every group's row fits `max_row_tokens` (and the token budget), whole groups per
    micro-batch, longest rows first; else grpo_lab.algo.packing.make_micro_batches's layouts.
    `token_budget=None`: one micro-batch, in the batch's row order."""
    if group_size and groups_share_prompts(batch, group_size):
        prompt_lens, completion_lens = _lengths(batch)
        G = group_size
        rows = [prompt_lens[g * G] + sum(completion_lens[g * G:(g + 1) * G])
                for g in range(len(prompt_lens) // G)]
        limit = min(max_row_tokens, token_budget or max_row_tokens)
        if max(rows) <= limit:
            if token_budget is None:
                plan = [list(range(len(rows)))]
            else:
                order = sorted(range(len(rows)), key=lambda g: -rows[g])
                plan = _fill(order, lambda gs: len(gs) * max(rows[g] for g in gs), token_budget)
            return [shared_prompt_micro_batch(batch, gs, G, prompt_lens, completion_lens)
                    for gs in plan]
    return make_micro_batches(batch, token_budget, packed=packed, row_tokens=row_tokens)
