"""Token-budget micro-batching: same loss, same gradient, same samples, every micro-batch in
budget."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_lab.algo.grpo_loss import grpo_loss
from grpo_lab.algo.logprobs import policy_logprobs
from grpo_lab.algo.packing import (
    accumulate_grpo_loss,
    block_causal_mask,
    make_micro_batches,
    plan_packed,
    plan_padded,
)
from grpo_lab.train.rollout_batch import RolloutBatch, pad_left, pad_right

LAYOUTS = [
    dict(token_budget=None),
    dict(token_budget=60),  # padded, sorted by length
    dict(token_budget=96, packed=True, row_tokens=32),  # padding-free rows, block-diagonal mask
]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def batch_and_model(tiny_model_and_tokenizer):
    """12 sequences of varied prompt and completion lengths, with off-policy old logprobs."""
    model, tokenizer = tiny_model_and_tokenizer
    model = copy.deepcopy(model).train()
    rng = random.Random(0)
    prompts = [[1] + [rng.randrange(4, 20) for _ in range(rng.randrange(2, 9))] for _ in range(12)]
    completions = [[rng.randrange(4, 20) for _ in range(rng.randrange(1, 6))] + [2]
                   for _ in range(12)]
    torch.manual_seed(0)
    old = [(-torch.rand(len(c))).tolist() for c in completions]
    prompt_ids, prompt_mask = pad_left(prompts, tokenizer.pad_token_id)
    completion_ids, completion_mask = pad_right(completions, tokenizer.pad_token_id)
    old_logps, _ = pad_right(old, 0.0)
    rewards = torch.tensor([float(i % 3 == 0) for i in range(12)])
    advantages = torch.randn(12)
    batch = RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask,
                         old_logps.float(), rewards, advantages)
    return batch, model


def plain_loss(model, batch, loss_type):
    logps = policy_logprobs(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                            batch.completion_mask)
    return grpo_loss(logps, batch.old_logps, batch.advantages, batch.completion_mask,
                     loss_type=loss_type, max_completion_length=8)


def grads(model):
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=["plain", "padded", "packed"])
def test_budgeted_loss_and_gradient_equal_the_plain_ones(batch_and_model, layout, loss_type):
    batch, model = batch_and_model
    model.zero_grad(set_to_none=True)
    loss, metrics = plain_loss(model, batch, loss_type)
    loss.backward()
    expected_grads = grads(model)
    model.zero_grad(set_to_none=True)

    micro_batches = make_micro_batches(batch, **layout)
    total, mb_metrics = accumulate_grpo_loss(model, micro_batches, temperature=1.0,
                                             loss_type=loss_type, max_completion_length=8)
    assert abs(total - loss.item()) < 1e-5
    for name in ("ratio", "clip_ratio/region_mean"):
        assert abs(mb_metrics[name] - metrics[name]) < 1e-5
    for got, want in zip(grads(model), expected_grads, strict=True):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=["padded", "packed"])
def test_every_sample_once_and_every_micro_batch_within_budget(batch_and_model, layout):
    batch, _ = batch_and_model
    micro_batches = make_micro_batches(batch, **layout)
    assert len(micro_batches) > 1
    indices = sorted(i for mb in micro_batches for i in mb.indices)
    assert indices == list(range(12))  # the optimizer step sees the same samples
    assert all(mb.input_tokens <= layout["token_budget"] for mb in micro_batches)
    real = int(batch.prompt_mask.sum() + batch.completion_mask.sum())
    padded_whole = batch.prompt_ids.numel() + batch.completion_ids.numel()
    assert real <= sum(mb.input_tokens for mb in micro_batches) < padded_whole  # less padding


def test_a_sequence_longer_than_the_budget_is_refused(batch_and_model):
    batch, _ = batch_and_model
    with pytest.raises(ValueError, match="exceeds the token budget"):
        make_micro_batches(batch, token_budget=8)


def test_block_causal_mask_separates_sequences():
    mask = block_causal_mask(torch.tensor([[0, 0, 1, 1, 1, -1]]))[0, 0]
    assert mask[1, 0] and not mask[0, 1]  # causal within a sequence
    assert not mask[2, 1] and mask[4, 2]  # the second sequence never sees the first
    assert mask[5, 5] and not mask[5, 4]  # row-end padding only sees itself


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 12), st.integers(1, 8)), min_size=1, max_size=40),
       budget=st.integers(20, 200), row_tokens=st.integers(20, 40))
def test_plans_cover_every_sequence_within_budget(lengths, budget, row_tokens):
    prompt_lens = [p for p, _ in lengths]
    completion_lens = [c for _, c in lengths]
    groups = plan_padded(prompt_lens, completion_lens, budget)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        width = max(prompt_lens[i] for i in g) + max(completion_lens[i] for i in g)
        assert len(g) * width <= budget
    totals = [p + c for p, c in lengths]
    packed = plan_packed(totals, budget, row_tokens)
    assert sorted(i for mb in packed for row in mb for i in row) == list(range(len(lengths)))
    for mb in packed:
        assert all(sum(totals[i] for i in row) <= row_tokens for row in mb)
        assert len(mb) * max(sum(totals[i] for i in row) for row in mb) <= budget
