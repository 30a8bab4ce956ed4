"""The `entropy` metric (TRL's: the policy's per-token entropy over completion tokens, from the
update's own forward pass) and the completion-length metrics, in both trainers."""

import math

import pytest
import torch

from grpo_lab.algo.grpo_loss import grpo_loss, masked_mean
from grpo_lab.algo.logprobs import (
    policy_logprobs_and_entropy,
    token_logprobs,
    token_logprobs_and_entropy,
)
from grpo_lab.algo.packing import accumulate_grpo_loss, make_micro_batches
from grpo_lab.data.completions import Completions
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.async_trainer import AsyncGRPOTrainer
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.rollout_batch import RolloutBatch, pad_left, pad_right, rollout_metrics
from grpo_lab.train.trainer import GRPOTrainer


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_entropy_is_the_sampling_distributions_and_carries_no_gradient(temperature):
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 7, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3))
    logps, entropy = token_logprobs_and_entropy(logits, targets, temperature)
    expected = torch.distributions.Categorical(logits=logits / temperature).entropy()
    assert torch.allclose(entropy, expected, atol=1e-6)
    assert torch.equal(logps, token_logprobs(logits, targets, temperature))
    assert logps.requires_grad and not entropy.requires_grad
    peaked = torch.tensor([[[30.0, 0.0, 0.0]]])  # a collapsed policy: one token, entropy ~0
    flat = torch.zeros(1, 1, 3)  # uniform: entropy log V, the most there is
    assert token_logprobs_and_entropy(peaked, torch.zeros(1, 1, dtype=torch.long))[1] < 1e-9
    assert token_logprobs_and_entropy(flat, torch.zeros(1, 1, dtype=torch.long))[1].item() == \
        pytest.approx(math.log(3))


def test_grpo_loss_logs_the_masked_mean_entropy_only_when_given():
    logps = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    entropy = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])  # padding must not count
    _, metrics = grpo_loss(logps, logps, torch.tensor([1.0, -1.0]), mask, entropy=entropy)
    assert metrics["entropy"] == pytest.approx(2.0)
    assert "entropy" not in grpo_loss(logps, logps, torch.tensor([1.0, -1.0]), mask)[1]


def test_rollout_metrics_give_min_max_mean_length_and_the_clipped_share():
    out = Completions([[1]] * 4, [[5, 2], [5, 5, 5, 5], [2], [5, 5, 5, 5]], [[0.0]] * 4,
                      ["a"] * 4, ["stop", "length", "stop", "length"])
    metrics = rollout_metrics(torch.tensor([1.0, 0.0, 1.0, 1.0]), out, group_size=2)
    assert metrics["completions/min_length"] == 1 and metrics["completions/max_length"] == 4
    assert metrics["completions/mean_length"] == pytest.approx(11 / 4)
    assert metrics["completions/clipped_ratio"] == 0.5
    assert metrics["frac_reward_zero_std"] == 0.5


@pytest.mark.parametrize("layout", [dict(token_budget=48), dict(token_budget=64, packed=True,
                                                                 row_tokens=32)],
                         ids=["padded", "packed"])
def test_micro_batched_entropy_equals_the_whole_batchs(tiny_model_and_tokenizer, layout):
    model, tokenizer = tiny_model_and_tokenizer
    torch.manual_seed(0)
    prompts = [[1] + torch.randint(4, 20, (n,)).tolist() for n in (3, 8, 5, 2, 6, 4)]
    completions = [torch.randint(4, 20, (n,)).tolist() + [2] for n in (1, 5, 3, 4, 2, 6)]
    prompt_ids, prompt_mask = pad_left(prompts, tokenizer.pad_token_id)
    completion_ids, completion_mask = pad_right(completions, tokenizer.pad_token_id)
    old_logps, _ = pad_right([[-1.0] * len(c) for c in completions], 0.0)
    batch = RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask,
                         old_logps.float(), torch.zeros(6), torch.randn(6))
    with torch.no_grad():
        _, entropy = policy_logprobs_and_entropy(model, prompt_ids, prompt_mask, completion_ids,
                                                 completion_mask, 0.7)
        whole = masked_mean(entropy, completion_mask.float()).item()
        micro_batches = make_micro_batches(batch, **layout)
        _, metrics = accumulate_grpo_loss(model, micro_batches, temperature=0.7, backward=False)
    assert len(micro_batches) > 1
    assert metrics["entropy"] == pytest.approx(whole, abs=1e-5)


SMALL = dict(steps=2, prompts_per_step=2, num_generations=3, eval_every=0, eval_size=4,
             progress=False, log_completions_every=0, log_every=100)


@pytest.mark.parametrize("trainer_class, config_class", [(GRPOTrainer, GRPOConfig),
                                                         (AsyncGRPOTrainer, AsyncGRPOConfig)],
                         ids=["sync", "async"])
def test_both_trainers_log_entropy_and_completion_lengths(tiny_model_dir, trainer_class,
                                                          config_class):
    cfg = config_class(model=str(tiny_model_dir), max_completion_length=3, **SMALL)
    trainer = trainer_class(cfg)
    records = [r for r in trainer.train() if "reward" in r]
    vocab = trainer.model.config.vocab_size
    for r in records:
        assert 0 < r["entropy"] <= math.log(vocab)
        assert 1 <= r["completions/min_length"] <= r["completions/mean_length"] \
            <= r["completions/max_length"] <= 3
    # The tiny model's answers are 3+ characters long: a cap of 3 cuts most of them.
    assert any(r["completions/clipped_ratio"] > 0 and r["completions/max_length"] == 3
               for r in records)
