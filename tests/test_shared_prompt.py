"""Each prompt forwarded once per group (a row per group) and prefilled once per group (the
sampler): the same logprobs, loss and gradient as a row per sequence, up to float rounding."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from grpo_lab.algo.grpo_loss import grpo_loss
from grpo_lab.algo.logprobs import policy_logprobs_and_entropy
from grpo_lab.algo.packing import PackedMicroBatch, PaddedMicroBatch, accumulate_grpo_loss
from grpo_lab.algo.shared_prompt import layout_micro_batches, shared_prompt_mask
from grpo_lab.model import generation
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.rollout_batch import RolloutBatch, pad_left, pad_right
from grpo_lab.train.trainer import GRPOTrainer

G = 4
pytestmark = pytest.mark.usefixtures("one_thread")


def grouped_batch(tokenizer, groups: int = 5, seed: int = 0) -> RolloutBatch:
    """`groups` prompts of different lengths (so left padding), G completions of 1-6 tokens each."""
    rng = random.Random(seed)
    prompts = [[1] + [rng.randrange(4, 20) for _ in range(rng.randrange(2, 9))]
               for _ in range(groups)]
    rows = [p for p in prompts for _ in range(G)]
    completions = [[rng.randrange(4, 20) for _ in range(rng.randrange(0, 5))] + [2] for _ in rows]
    torch.manual_seed(seed)
    prompt_ids, prompt_mask = pad_left(rows, tokenizer.pad_token_id)
    completion_ids, completion_mask = pad_right(completions, tokenizer.pad_token_id)
    old, _ = pad_right([(-torch.rand(len(c))).tolist() for c in completions], 0.0)
    return RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, old.float(),
                        torch.zeros(len(rows)), torch.randn(len(rows)))


@pytest.fixture(scope="module")
def model_and_batch(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    return copy.deepcopy(model).train(), grouped_batch(tokenizer)


def test_shared_prompt_mask():
    mask = shared_prompt_mask(torch.tensor([[0, 0, 1, 1, 2, 2, -1]]))[0, 0]
    assert mask[1, 0] and not mask[0, 1]  # the prompt: causal
    assert mask[3, 0] and mask[3, 2] and mask[5, 1]  # a completion sees the prompt and itself
    assert not mask[4, 2] and not mask[4, 3] and not mask[5, 3]  # ... never another completion
    assert mask[6, 0] and mask[6, 6] and not mask[6, 5]  # end padding: the prompt and itself


@pytest.mark.parametrize("budget", [None, 40])
def test_logprobs_loss_and_gradient_equal_a_row_per_sequence(model_and_batch, budget):
    model, batch = model_and_batch
    logps, entropy = policy_logprobs_and_entropy(model, batch.prompt_ids, batch.prompt_mask,
                                                 batch.completion_ids, batch.completion_mask)
    loss, _ = grpo_loss(logps, batch.old_logps, batch.advantages, batch.completion_mask,
                        max_completion_length=8)
    model.zero_grad(set_to_none=True)
    loss.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    micro_batches = layout_micro_batches(batch, budget, group_size=G)
    assert all(isinstance(mb, PackedMicroBatch) for mb in micro_batches)
    assert sorted(i for mb in micro_batches for i in mb.indices) == list(range(5 * G))
    real = int(batch.prompt_mask.sum() + batch.completion_mask.sum())
    assert sum(mb.input_tokens for mb in micro_batches) < real  # each prompt once, not G times
    if budget is None:  # one micro-batch, rows in the batch's order
        mb = micro_batches[0]
        got, got_entropy = mb.logprobs_and_entropy(model, 1.0)
        real_tokens = batch.completion_mask.bool()
        assert torch.allclose(got[real_tokens], logps[real_tokens], atol=1e-5)
        assert torch.allclose(got_entropy[real_tokens], entropy[real_tokens], atol=1e-5)
    else:
        assert len(micro_batches) > 1 and all(mb.input_tokens <= budget for mb in micro_batches)
    total, _ = accumulate_grpo_loss(model, micro_batches, temperature=1.0,
                                    max_completion_length=8)
    assert total == pytest.approx(loss.item(), abs=1e-6)
    for p, want in zip(model.parameters(), expected, strict=True):
        assert torch.allclose(p.grad, want, atol=1e-5, rtol=1e-4)
    model.zero_grad(set_to_none=True)


def test_a_completion_never_sees_its_neighbours(model_and_batch):
    model, batch = model_and_batch
    changed = copy.deepcopy(batch)
    changed.completion_ids[1] = 5  # the first group's second completion, every column
    with torch.no_grad():
        before = layout_micro_batches(batch, None, group_size=G)[0].logprobs(model, 1.0)
        after = layout_micro_batches(changed, None, group_size=G)[0].logprobs(model, 1.0)
    others = [i for i in range(5 * G) if i != 1]
    assert torch.allclose(before[others], after[others], atol=1e-6)


def test_falls_back_to_a_row_per_sequence(model_and_batch):
    _, batch = model_and_batch
    mixed = copy.deepcopy(batch)
    mixed.prompt_ids[1, -1] = 7  # a group whose rows hold two prompts
    for laid_out in (layout_micro_batches(mixed, None, group_size=G),
                     layout_micro_batches(batch, None, group_size=G, max_row_tokens=10),
                     layout_micro_batches(batch, None, group_size=None)):
        assert [type(mb) for mb in laid_out] == [PaddedMicroBatch]


def test_the_trainer_uses_it_where_the_attention_takes_the_mask(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    for shared in (True, False):
        config = GRPOConfig(prompts_per_step=2, num_generations=G, progress=False,
                            shared_prompt=shared)
        trainer = GRPOTrainer(config, model=copy.deepcopy(model), tokenizer=tokenizer)
        batch = grouped_batch(tokenizer, groups=2)
        kind = type(trainer.micro_batches(batch)[0])
        assert trainer.share_prompts is shared
        assert kind is (PackedMicroBatch if shared else PaddedMicroBatch)


def test_sampling_prefills_each_prompt_once(tiny_model_and_tokenizer, monkeypatch):
    model, tokenizer = tiny_model_and_tokenizer
    model = copy.deepcopy(model).eval()
    prompts = [[1, 4, 11, 14, 8, 9, 17], [1, 5, 12], [1], [1, 6, 6, 13, 8]]  # left padded
    outs = []
    for shared in (True, False):
        if not shared:
            monkeypatch.setattr(generation, "shared_prompt_cache", lambda *a, **k: {})
        torch.manual_seed(0)
        outs.append(generation.sample_from_ids(model, tokenizer, prompts, max_new_tokens=6,
                                               num_generations=G))
    assert outs[0].completion_ids == outs[1].completion_ids
    assert outs[0].prompt_ids == outs[1].prompt_ids == [p for p in prompts for _ in range(G)]
    for a, b in zip(outs[0].logprobs, outs[1].logprobs, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)
