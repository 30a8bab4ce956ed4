"""TRL parity at a real vocabulary: grpo_lab's per-token logprobs, GRPO losses, gradients and
clip/KL metrics equal TRL's `GRPOTrainer`'s on SmolLM2-135M-Instruct (Llama, 49,152 tokens), where
the tiny model's 22-token vocabulary could hide a difference in the log-softmax, the temperature or
the LM head. The batch, the comparisons and the float32 tolerances are those of
test_trl_parity_loss.py (tests/trl_parity_helpers.py), whose full grid runs on the tiny model; here
each loss type once, off-policy (both clip branches fire) with the KL term on."""

from __future__ import annotations

import pytest
import torch
import trl_parity_helpers as parity
from float_tolerance import assert_f32_close, assert_grads_close

from grpo_lab.algo import grpo_loss as core
from grpo_lab.algo import logprobs

VOCABULARY = 49_152
"""SmolLM2's: its logprobs of random tokens reach -29, so the tiny model's rule (a log-softmax's
vocab x size) would allow 0.67 nats; float_tolerance.logprob_atol takes the logits' hidden-size
sums and the vocabulary's sum of probabilities apart (0.03 here, measured differences 2e-5)."""


@pytest.fixture(scope="module")
def trainer(smollm2_dir, tmp_path_factory):
    return parity.make_trainer(smollm2_dir, tmp_path_factory.mktemp("trl-parity-real"))


@pytest.fixture(scope="module")
def model(trainer):
    # LoRA B at 0.02 x N(0, 1): at 0.3 (the tiny model's) 30 layers of rank-1 updates push a
    # 576-wide model's logits far off its pretrained ones; the KL to the base is still > 0.
    return parity.randomised_lora(trainer, scale=0.02)


@pytest.fixture(scope="module")
def batch(trainer, model):
    return parity.make_batch(trainer, model)


def test_the_batch_is_at_the_real_vocabulary(trainer, batch):
    assert len(trainer.processing_class) == VOCABULARY
    assert int(batch["completion_ids"].max()) > 22 * 100  # ids the tiny vocabulary never reaches


def test_per_token_logprobs_match_at_the_real_vocabulary(trainer, model, batch):
    with torch.no_grad():
        theirs = parity.trl_logprobs(trainer, model, batch)
        ours = parity.our_logprobs(model, batch)
    real = batch["completion_mask"].bool()
    atol = parity.batch_logprob_atol(batch, VOCABULARY, hidden_size=model.config.hidden_size)
    assert atol < 0.05  # the tiny model's rule (vocab x size) would allow 0.67 nats here
    assert_f32_close(ours[real], theirs[real], atol, "logprobs")
    with torch.no_grad():  # the tolerance is far below what a real difference (temperature) moves
        at_t1 = logprobs.policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                     batch["completion_ids"], batch["completion_mask"], 1.0)
    assert (at_t1[real] - theirs[real]).abs().max() > parity.MISS * atol


@pytest.mark.parametrize("loss_type", core.LOSS_TYPES)
def test_loss_gradients_and_metrics_match_at_the_real_vocabulary(trainer, model, batch,
                                                                 loss_type):
    beta = parity.BETA
    with parity.configured(trainer, loss_type=loss_type, beta=beta, epsilon_low=0.2,
                           epsilon_high=0.28):
        theirs = trainer._compute_loss(model, parity.trl_inputs(batch, off_policy=True, beta=beta))
        ours, metrics = parity.grpo_lab_loss(model, batch, off_policy=True, beta=beta,
                                             loss_type=loss_type, epsilon_low=0.2,
                                             epsilon_high=0.28)
        assert_f32_close(ours.item(), theirs.item(),
                         parity.loss_atol(batch, off_policy=True, beta=beta), "loss")
        # each of the 30 layers' backward passes adds its rounding to the gradient that flows
        # to the layers below it: the tiny model's rule (positions) times the depth
        depth = model.config.num_hidden_layers
        assert_grads_close(parity.gradients(model, ours), parity.gradients(model, theirs),
                           parity.positions(batch) * depth)
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert_f32_close(metrics[name], parity.last_metric(trainer, name),
                             parity.fraction_atol(batch), name)
        # the kl is computed from each side's own logprobs, which differ by `drift` (a forward
        # through 30 layers in another order): k3's slope |e^(ref - cur) - 1| carries it through
        real = batch["completion_mask"].bool()
        with torch.no_grad():
            drift = (parity.trl_logprobs(trainer, model, batch)
                     - parity.our_logprobs(model, batch))[real]
        slope = (batch["ref_logps"] - batch["current_logps"]).exp().sub(1).abs()[real].mean()
        kl_tolerance = parity.kl_atol(batch) + slope.item() * drift.abs().max().item()
        assert_f32_close(metrics["kl"], parity.last_metric(trainer, "kl"), kl_tolerance, "kl")
        assert kl_tolerance < 0.01 * metrics["kl"]
    assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    assert metrics["kl"] > 0
