"""The GRPO core against small hand-computed cases."""

import math

import pytest
import torch

from grpo_lab.algo import grpo_loss as core
from grpo_lab.algo import logprobs


def test_token_logprobs_divides_by_temperature():
    logits = torch.tensor([[[2.0, 0.0, 0.0]]])  # (B=1, T=1, V=3)
    targets = torch.tensor([[0]])
    at_t1 = math.log(math.e**2 / (math.e**2 + 2))
    at_t2 = math.log(math.e / (math.e + 2))  # logits / 2
    assert logprobs.token_logprobs(logits, targets, 1.0).item() == pytest.approx(at_t1, abs=1e-6)
    assert logprobs.token_logprobs(logits, targets, 2.0).item() == pytest.approx(at_t2, abs=1e-6)


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    adv = core.group_advantages(rewards, group_size=3)
    # group 1: mean 1/3, unbiased std sqrt(1/3)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    assert adv[0].item() == pytest.approx((2 / 3) / (std + 1e-4), rel=1e-5)
    assert adv[1].item() == pytest.approx((-1 / 3) / (std + 1e-4), rel=1e-5)
    # each group sums to zero
    assert adv.view(2, 3).sum(1).abs().max().item() < 1e-5


def test_group_advantages_without_std_scaling():
    adv = core.group_advantages(torch.tensor([3.0, 1.0]), 2, scale_by_std=False)
    assert adv.tolist() == [1.0, -1.0]


def test_all_equal_rewards_give_zero_advantage_and_no_nan():
    adv = core.group_advantages(torch.ones(8), group_size=8)
    assert torch.all(adv == 0) and not torch.isnan(adv).any()
    logps = torch.zeros(8, 3, requires_grad=True)
    loss, _ = core.grpo_loss(logps, logps.detach(), adv, torch.ones(8, 3))
    loss.backward()
    assert loss.item() == 0 and torch.all(logps.grad == 0)


def test_group_advantages_rejects_ragged_groups():
    with pytest.raises(ValueError, match="groups of 4"):
        core.group_advantages(torch.ones(6), 4)


def test_clipped_surrogate_hand_computed():
    # ratio = 1.5: positive advantage is clipped at 1.2, negative is not (min picks the unclipped)
    logps = torch.log(torch.tensor([[1.5, 1.5, 0.5]]))
    old = torch.zeros(1, 3)
    pos = core.clipped_surrogate(logps, old, torch.tensor([2.0]), 0.2, 0.2)
    assert pos.per_token_loss.tolist()[0] == pytest.approx([-2.4, -2.4, -1.0])
    assert pos.high_clipped.tolist() == [[True, True, False]]
    neg = core.clipped_surrogate(logps, old, torch.tensor([-2.0]), 0.2, 0.2)
    # ratio 1.5 with A<0: min(-3, -2.4) = -3 -> loss 3; ratio 0.5: min(-1, -1.6) -> loss 1.6
    assert neg.per_token_loss.tolist()[0] == pytest.approx([3.0, 3.0, 1.6])
    assert neg.low_clipped.tolist() == [[False, False, True]]


def test_separate_low_and_high_epsilon():
    logps = torch.log(torch.tensor([[1.25]]))
    out = core.clipped_surrogate(logps, torch.zeros(1, 1), torch.tensor([1.0]), 0.2, 0.28)
    assert out.per_token_loss.item() == pytest.approx(-1.25)  # inside 1 + 0.28: not clipped
    out = core.clipped_surrogate(logps, torch.zeros(1, 1), torch.tensor([1.0]), 0.2, 0.2)
    assert out.per_token_loss.item() == pytest.approx(-1.2)


def test_k3_kl_is_zero_at_equality_and_matches_formula():
    logp = torch.tensor([-1.0, -2.0])
    assert torch.all(core.k3_kl(logp, logp) == 0)
    d = -0.5 - (-1.0)
    assert core.k3_kl(torch.tensor([-1.0]), torch.tensor([-0.5])).item() == pytest.approx(
        math.exp(d) - d - 1
    )


def test_aggregations_hand_computed_and_padding_ignored():
    per_token = torch.tensor([[1.0, 2.0, 99.0], [4.0, 99.0, 99.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert core.grpo_aggregate(per_token, mask).item() == pytest.approx((1.5 + 4.0) / 2)
    assert core.dapo_aggregate(per_token, mask).item() == pytest.approx(7.0 / 3)
    assert core.dr_grpo_aggregate(per_token, mask, 5).item() == pytest.approx(7.0 / 10)


def test_padded_tokens_get_no_gradient():
    logps = torch.randn(2, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    for loss_type in core.LOSS_TYPES:
        logps.grad = None
        loss, _ = core.grpo_loss(logps, logps.detach() + 0.1, torch.tensor([1.0, -1.0]), mask,
                                 loss_type=loss_type, beta=0.1, ref_logps=torch.zeros(2, 4))
        loss.backward()
        assert torch.all(logps.grad[mask == 0] == 0), loss_type
        assert torch.all(logps.grad[mask == 1] != 0), loss_type


def test_grpo_loss_metrics_and_errors():
    logps = torch.zeros(1, 2)
    loss, metrics = core.grpo_loss(logps, logps, torch.tensor([1.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-1.0) and metrics["ratio"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="ref_logps"):
        core.grpo_loss(logps, logps, torch.tensor([1.0]), torch.ones(1, 2), beta=0.1)
    with pytest.raises(ValueError, match="unknown loss_type"):
        core.grpo_loss(logps, logps, torch.tensor([1.0]), torch.ones(1, 2), loss_type="ppo")


def test_position_ids_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert logprobs.position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_policy_logprobs_equal_generation_logprobs(tiny_model_and_tokenizer):
    """The trainer's forward pass must score exactly what `generate` sampled (left padding too)."""
    from grpo_lab.model.generation import generate_completions
    from grpo_lab.train.rollout_batch import pad_left, pad_right

    model, tokenizer = tiny_model_and_tokenizer
    torch.manual_seed(0)
    out = generate_completions(model, tokenizer, ["1+2=", "07+45=", "99+99="], max_new_tokens=4,
                               num_generations=3, temperature=0.7)
    prompt_ids, prompt_mask = pad_left(out.prompt_ids, tokenizer.pad_token_id)
    completion_ids, completion_mask = pad_right(out.completion_ids, tokenizer.pad_token_id)
    old, _ = pad_right(out.logprobs, 0.0)
    with torch.no_grad():
        new = logprobs.policy_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                   completion_mask, temperature=0.7)
    assert (new - old).mul(completion_mask).abs().max().item() < 1e-4
