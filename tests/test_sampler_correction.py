"""The sampler/trainer importance-sampling correction (grpo_lab.algo.sampler_correction): hand-made
edge cases, its config checks, and both trainers using it. TRL parity is in
test_trl_parity_sampler.py. Float32 tolerances follow tests/float_tolerance.py."""

from __future__ import annotations

import math

import pytest
import torch
from float_tolerance import assert_f32_close, f32_atol, logprob_atol, mean_atol

from grpo_lab.algo import grpo_loss as core
from grpo_lab.algo import logprobs
from grpo_lab.algo.packing import accumulate_grpo_loss, make_micro_batches
from grpo_lab.algo.sampler_correction import (
    IS_MODES,
    sampler_correction_metrics,
    sampler_importance_weights,
    sampler_kl,
)
from grpo_lab.model.models import load_model_and_tokenizer
from grpo_lab.rollout.generators import LocalGenerator
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.async_trainer import AsyncGRPOTrainer
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.grpo_step import ProximalLogprobs
from grpo_lab.train.trainer import GRPOTrainer

SAMPLING_METRICS = {"sampling/sampling_logp_difference/mean",
                    "sampling/sampling_logp_difference/max",
                    "sampling/importance_sampling_ratio/min",
                    "sampling/importance_sampling_ratio/mean",
                    "sampling/importance_sampling_ratio/max"}


pytestmark = pytest.mark.usefixtures("one_thread")


def case(log_ratios: list[list[float]], lengths: list[int]):
    """Old and sampler logprobs whose per-token log-ratios are `log_ratios`, a mask, and
    advantages alternating +1, -1; a leaf `logps` (= old: ratio 1) to differentiate."""
    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    old = -torch.rand(len(lengths), width, generator=torch.Generator().manual_seed(0)) - 0.5
    sampler = old - torch.tensor(log_ratios) * mask
    advantages = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(lengths))])
    logps = old.clone().requires_grad_(True)
    return logps, old, sampler, mask, advantages


def loss_and_grad(logps, old, advantages, mask, weights=None, loss_type="grpo"):
    loss, metrics = core.grpo_loss(logps, old, advantages, mask, loss_type=loss_type,
                                   importance_weights=weights)
    (grad,) = torch.autograd.grad(loss, logps)
    return loss, grad, metrics


# ---------------------------------------------------------------------------------------------
# Edge cases


@pytest.mark.parametrize("mode", IS_MODES)
def test_sampler_equal_to_trainer_leaves_loss_unchanged(mode):
    """The sync trainer's case: the sampler is the trainer, every weight is exactly 1."""
    logps, old, _, mask, adv = case([[0.0] * 3] * 4, [3, 2, 3, 1])
    weights = sampler_importance_weights(old, old, mask, mode=mode, clip_max=3.0)
    assert torch.all(weights == 1)
    plain = loss_and_grad(logps, old, adv, mask)
    corrected = loss_and_grad(logps, old, adv, mask, weights)
    assert corrected[0].item() == plain[0].item()
    assert torch.equal(corrected[1], plain[1])


@pytest.mark.parametrize("mode", IS_MODES)
@pytest.mark.parametrize("loss_type", core.LOSS_TYPES)
def test_all_weights_under_the_cap_are_plain_importance_weights(mode, loss_type):
    """No weight reaches the cap: truncation and masking change nothing, the loss is the one
    weighted by the raw pi_old / pi_sampler (token or sequence)."""
    log_ratios = [[0.3, -0.2, 0.1], [-0.4, 0.2, 0.0], [0.05, 0.1, -0.3], [0.2, 0.0, 0.0]]
    logps, old, sampler, mask, adv = case(log_ratios, [3, 2, 3, 1])
    weights = sampler_importance_weights(old, sampler, mask, mode=mode, clip_max=3.0)
    uncapped = sampler_importance_weights(old, sampler, mask, mode=mode, clip_max=math.inf)
    assert torch.equal(weights, uncapped) and weights.max() < 3.0
    raw = torch.exp(torch.tensor(log_ratios) * mask)
    expected = raw.prod(-1, keepdim=True) if mode.startswith("sequence") else raw
    # The weights see each log-ratio as a difference of logprobs (rounded to their size), and a
    # sequence's weight sums 3 of them.
    weight_atol = f32_atol(expected.max().item() * sampler.abs().max().item(), 3)
    assert_f32_close(weights, expected, weight_atol, "weights")
    ours = loss_and_grad(logps, old, adv, mask, weights, loss_type)
    by_hand = core.clipped_surrogate(logps, old, adv).per_token_loss * expected
    loss_atol = mean_atol(by_hand[mask.bool()]) + weight_atol  # the loss's terms, and the weights
    assert_f32_close(ours[0].item(), core.aggregate(loss_type, by_hand, mask, 3).item(), loss_atol,
                     "loss")
    # The raw weights are not 1 here: the correction does change the loss.
    uncorrected = loss_and_grad(logps, old, adv, mask, None, loss_type)[0].item()
    assert abs(ours[0].item() - uncorrected) > 100 * loss_atol


def test_token_mask_zeroes_exactly_the_tokens_above_the_cap():
    log_ratios = [[0.2, math.log(4.0), 0.0], [math.log(2.5), -0.1, math.log(3.5)]]
    logps, old, sampler, mask, adv = case(log_ratios, [3, 3])
    weights = sampler_importance_weights(old, sampler, mask, mode="token_mask", clip_max=3.0)
    above = torch.tensor([[False, True, False], [False, False, True]])
    assert torch.all(weights[above] == 0) and torch.all(weights[~above] > 0)
    torch.testing.assert_close(weights[~above], torch.exp(torch.tensor(log_ratios)[~above]))
    _, grad, _ = loss_and_grad(logps, old, adv, mask, weights)
    assert torch.all(grad[above] == 0) and torch.all(grad[~above] != 0)
    # Truncation keeps those tokens at weight 3 instead.
    truncated = sampler_importance_weights(old, sampler, mask, mode="token_truncate", clip_max=3.0)
    assert torch.all(truncated[above] == 3.0)
    torch.testing.assert_close(truncated[~above], weights[~above])


def test_sequence_mask_zeroes_whole_sequences_whose_product_is_above_the_cap():
    """Every token's ratio is under the cap, but sequence 0's product (1.5^3 = 3.4) is not: the
    sequence weight multiplies the token ratios (sums the log-ratios), it does not average them."""
    log_ratios = [[math.log(1.5)] * 3, [math.log(1.2), 0.0, 0.0], [-0.1, -0.2, 0.0]]
    logps, old, sampler, mask, adv = case(log_ratios, [3, 3, 2])
    weights = sampler_importance_weights(old, sampler, mask, mode="sequence_mask", clip_max=3.0)
    assert weights.shape == (3, 1) and weights[0, 0] == 0
    torch.testing.assert_close(weights[1:, 0], torch.tensor([1.2, math.exp(-0.3)]))
    _, grad, _ = loss_and_grad(logps, old, adv, mask, weights)
    assert torch.all(grad[0] == 0) and torch.all(grad[1:][mask[1:].bool()] != 0)
    assert torch.all(sampler_importance_weights(old, sampler, mask, mode="token_mask",
                                                clip_max=3.0) > 0)
    truncated = sampler_importance_weights(old, sampler, mask, mode="sequence_truncate",
                                           clip_max=3.0)
    assert truncated[0, 0] == 3.0


def test_clip_min_truncates_or_masks_from_below():
    log_ratios = [[math.log(0.25), 0.0], [math.log(0.8), math.log(0.5)]]
    _, old, sampler, mask, _ = case(log_ratios, [2, 2])
    token = sampler_importance_weights(old, sampler, mask, mode="token_truncate", clip_max=None,
                                       clip_min=0.5)
    torch.testing.assert_close(token, torch.tensor([[0.5, 1.0], [0.8, 0.5]]))
    masked = sampler_importance_weights(old, sampler, mask, mode="sequence_mask", clip_max=3.0,
                                        clip_min=0.5)
    torch.testing.assert_close(masked, torch.tensor([[0.0], [0.0]]))  # 0.25 and 0.4 < 0.5


def test_padding_and_missing_sampler_logprobs_get_weight_one_and_are_not_measured():
    logps, old, sampler, mask, _ = case([[0.5, 0.0, 0.0], [0.1, 0.2, 0.0]], [1, 3])
    sampler[1, 2] = float("nan")  # a token the sampler could not score
    sampler[0, 1:] = 7.0  # garbage on padding
    weights = sampler_importance_weights(old, sampler, mask, mode="token_truncate", clip_max=3.0)
    assert weights[0, 1:].tolist() == [1.0, 1.0] and weights[1, 2].item() == 1.0
    metrics = sampler_correction_metrics(old, sampler, weights, mask, "token_truncate")
    assert metrics["sampling/sampling_logp_difference/max"] == pytest.approx(0.5)
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx((0.5 + 0.1 + 0.2) / 3)
    # Weights over the 4 real tokens (the NaN one included, at 1).
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(
        (math.exp(0.5) + math.exp(0.1) + math.exp(0.2) + 1) / 4)
    seq = sampler_importance_weights(old, sampler, mask, mode="sequence_mask", clip_max=1.5)
    seq_metrics = sampler_correction_metrics(old, sampler, seq, mask, "sequence_mask")
    assert seq[0, 0] == 0  # exp(0.5) = 1.65 > 1.5: masked, and counted at 0 in the metrics
    assert seq_metrics["sampling/importance_sampling_ratio/min"] == 0.0
    assert seq_metrics["sampling/importance_sampling_ratio/max"] == pytest.approx(math.exp(0.3))
    assert set(metrics) == SAMPLING_METRICS


def test_sampler_kl_is_trl_async_k3():
    """TRL AsyncGRPOTrainer: kl = mean((r - 1) - log r), r = pi_theta / pi_sampler."""
    logps = torch.tensor([[-1.0, -2.0, -0.5]])
    sampler = torch.tensor([[-1.2, -1.5, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    log_r = torch.tensor([0.2, -0.5])
    expected = ((log_r.exp() - 1) - log_r).mean().item()
    # The log-ratios are differences of logprobs (rounded to their size, <= 2), and k3 moves by
    # less than they do (|d k3 / d log r| = |r - 1| < 1); the mean sums 2 tokens.
    assert_f32_close(sampler_kl(logps, sampler, mask), expected,
                     f32_atol(logps.abs().max().item(), 2), "kl")
    assert sampler_kl(sampler, sampler, mask) == 0.0


@pytest.mark.parametrize("mode", IS_MODES)
def test_weights_in_the_advantages_are_the_weighted_loss(mode):
    """The async trainer puts w into per-token advantages (accumulate_grpo_loss takes no weights):
    -min(r A w, clip(r) A w) = w * -min(r A, clip(r) A) for w >= 0, same loss and gradient."""
    log_ratios = [[0.3, 1.5, 0.1], [-0.4, 0.2, 0.0], [1.2, 0.1, -0.3], [0.2, 0.0, 0.0]]
    logps, old, sampler, mask, adv = case(log_ratios, [3, 2, 3, 1])
    current = (old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
               ).requires_grad_(True)  # ratio != 1: both clip branches
    weights = sampler_importance_weights(old, sampler, mask, mode=mode, clip_max=2.0)
    weighted = loss_and_grad(current, old, adv, mask, weights)
    folded = loss_and_grad(current, old, adv.unsqueeze(1) * weights, mask)
    # r A w and (r A) w round differently: an ulp per token, of terms of size |A w r|.
    terms = (adv.unsqueeze(1) * weights * (current - old).exp()).detach()[mask.bool()]
    assert_f32_close(folded[0].item(), weighted[0].item(), mean_atol(terms), "loss")
    assert_f32_close(folded[1], weighted[1], f32_atol(weighted[1].abs().max().item()), "grad")


@pytest.mark.parametrize("kwargs, message", [
    ({"vllm_importance_sampling_mode": "sequence"}, "unknown vllm_importance_sampling_mode"),
    ({"vllm_importance_sampling_clip_min": 3.0}, "must be less than"),
    ({"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None},
     "needs vllm_importance_sampling_clip_min or _clip_max"),
])
def test_invalid_correction_config_fails_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**kwargs)
    # A mask mode needs no bound (it then masks nothing), as in TRL.
    GRPOConfig(vllm_importance_sampling_mode="token_mask", vllm_importance_sampling_clip_max=None)


# ---------------------------------------------------------------------------------------------
# The trainers

SMALL = dict(steps=1, prompts_per_step=2, num_generations=4, eval_size=4, eval_every=0,
             progress=False, log_every=100)


def test_sync_trainer_weights_are_one_and_logged(tiny_model_dir):
    """The sync trainer samples with the policy itself: |logp difference| is float rounding."""
    trainer = GRPOTrainer(GRPOConfig(model=str(tiny_model_dir), **SMALL))
    record = trainer.step()
    assert SAMPLING_METRICS <= set(record)
    assert record["sampling/sampling_logp_difference/max"] < 1e-4
    for stat in ("min", "mean", "max"):
        assert record[f"sampling/importance_sampling_ratio/{stat}"] == pytest.approx(1, abs=1e-3)
    assert record["ratio"] == 1.0  # against the trainer's own logprobs, at the first update
    off = GRPOTrainer(GRPOConfig(model=str(tiny_model_dir),
                                 vllm_importance_sampling_correction=False, **SMALL)).step()
    assert not SAMPLING_METRICS & set(off)


class BF16LikeGenerator:
    """A LocalGenerator whose logprobs are off by a deterministic 0.1 nat per token, as an
    engine in another precision gives them: too low in even rows, too high in odd ones."""

    def __init__(self, inner: LocalGenerator):
        self.inner = inner

    def publish(self, model, version):
        self.inner.publish(model, version)

    @property
    def latest_version(self):
        return self.inner.latest_version

    def generate(self, prompt_ids, **kwargs):
        out = self.inner.generate(prompt_ids, **kwargs)
        out.logprobs = [[lp + (0.1 if i % 2 else -0.1) for lp in row]
                        for i, row in enumerate(out.logprobs)]
        return out


def async_trainer(tiny_model_dir, **overrides) -> AsyncGRPOTrainer:
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    cfg = AsyncGRPOConfig(**{**SMALL, "asynchronous": False, "trainer_threads": 1,
                             "generator_threads": 1,
                             "vllm_importance_sampling_correction": True,  # off by default here
                             **overrides})
    trainer = AsyncGRPOTrainer(cfg, model=model, tokenizer=tokenizer)
    trainer.generator = BF16LikeGenerator(trainer.generator)
    return trainer


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["token_truncate", "sequence_mask"])
def test_async_trainer_corrects_every_micro_batch(tiny_model_dir, mode):
    """Packed micro-batches in any order get the weights of their own rows, and their
    accumulated loss is grpo_loss on the whole batch with the weights."""
    trainer = async_trainer(tiny_model_dir, vllm_importance_sampling_mode=mode,
                            vllm_importance_sampling_clip_max=1.05, token_budget=48,
                            pack_sequences=True, pack_row_tokens=24)
    trainer.publish_current()
    batch, _, _ = trainer.collate(trainer.produce(0))
    micro_batches = make_micro_batches(batch, 48, packed=True, row_tokens=24)
    assert len(micro_batches) > 1
    # pi_old from the update's own forward, each micro-batch corrected before its loss.
    proximal = ProximalLogprobs(trainer, batch)
    loss, _ = accumulate_grpo_loss(trainer.model, micro_batches, temperature=1.0, backward=False,
                                   max_completion_length=trainer.max_completion_length,
                                   on_logprobs=proximal)
    metrics = trainer.sampler_metrics(batch, proximal.logps)

    # ... the same numbers as a no-grad pass of its own (TRL's old_per_token_logps), up to the
    # rounding of another forward (packed rows).
    with torch.no_grad():
        trainer_logps = logprobs.policy_logprobs(trainer.model, batch.prompt_ids, batch.prompt_mask,
                                             batch.completion_ids, batch.completion_mask, 1.0)
    lp_atol = logprob_atol(trainer_logps, trainer.model.config.vocab_size)
    assert_f32_close(proximal.logps, trainer_logps, lp_atol, "logprobs")
    weights = sampler_importance_weights(trainer_logps, batch.old_logps, batch.completion_mask,
                                         mode=mode, clip_max=1.05)
    # The cap bites (on the even rows' tokens or sequences), and not everywhere.
    assert weights.min() < 1.0
    if mode == "token_truncate":
        assert weights.max().item() == pytest.approx(1.05)
    else:
        assert (weights == 0).any()
    expected = sampler_correction_metrics(trainer_logps, batch.old_logps, weights,
                                          batch.completion_mask, mode)
    # Functions of logprobs that differ by up to lp_atol: the |logp difference| statistics move by
    # as much, a weight exp(sum of up to `length` log-ratios) by w x length x as much.
    length = int(batch.completion_mask.sum(1).max()) if mode.startswith("sequence") else 1
    w_max = max(1.0, weights.max().item())
    assert_f32_close({k: metrics[k] for k in expected}, expected, lp_atol * length * w_max,
                     "sampling metrics")
    assert metrics["sampling/sampling_logp_difference/mean"] == pytest.approx(0.1, abs=1e-3)
    # k3 = (r - 1) - log r (r = pi_theta / pi_sampler) moves by |r - 1| times the logprobs, and
    # its mean rounds at the size of r - 1 and log r.
    real = batch.completion_mask.bool()
    log_r = (trainer_logps - batch.old_logps)[real]
    kl_atol = (lp_atol * (log_r.exp() - 1).abs().max().item()
               + mean_atol((log_r.exp() - 1).abs() + log_r.abs()))
    assert_f32_close(metrics["kl"], sampler_kl(trainer_logps, batch.old_logps,
                                               batch.completion_mask), kl_atol, "kl")
    assert metrics["kl"] > 1e-3

    whole, _ = core.grpo_loss(trainer_logps, trainer_logps, batch.advantages, batch.completion_mask,
                              max_completion_length=trainer.max_completion_length,
                              importance_weights=weights)
    # At ratio 1 the loss averages -A w: the weights move with the logprobs, the sum rounds.
    terms = (batch.advantages.unsqueeze(1) * weights.expand_as(trainer_logps))[real]
    loss_atol = terms.abs().max().item() * length * lp_atol + mean_atol(terms)
    assert_f32_close(loss, whole.item(), loss_atol, "loss")


@pytest.mark.timeout(300)
def test_async_trainer_logs_trl_names(tiny_model_dir):
    trainer = async_trainer(tiny_model_dir)
    try:
        record = trainer.step()
    finally:
        trainer.stop_steps()
    assert SAMPLING_METRICS | {"kl"} <= set(record)
    assert record["ratio"] == pytest.approx(1.0, abs=1e-6)  # against pi_old, at the first update
    off = async_trainer(tiny_model_dir, vllm_importance_sampling_correction=False)
    try:
        record = off.step()
    finally:
        off.stop_steps()
    assert "kl" in record and not SAMPLING_METRICS & set(record)
    assert record["ratio"] != pytest.approx(1.0, abs=1e-3)  # against the sampler's logprobs
    with_ref = async_trainer(tiny_model_dir, beta=0.1)
    try:
        record = with_ref.step()
    finally:
        with_ref.stop_steps()
    # `kl` stays TRL AsyncGRPOTrainer's (sampler vs policy); the reference KL is `ref_kl`.
    assert record["kl"] >= 0 and record["ref_kl"] >= 0 and SAMPLING_METRICS <= set(record)


def test_truncation_without_bounds_leaves_the_weights():
    from grpo_lab.algo.sampler_correction import truncated_weights

    ratio = torch.tensor([[0.5, 1.0, 7.0]])
    assert torch.equal(truncated_weights(ratio, None, None), ratio)
    assert torch.equal(truncated_weights(ratio, None, 3.0), torch.tensor([[0.5, 1.0, 3.0]]))
