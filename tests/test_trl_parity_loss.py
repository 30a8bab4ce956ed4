"""TRL parity: grpo_lab's GRPO loss equals the loss of TRL's `GRPOTrainer` on the same batch.

One TRL `GRPOTrainer` (the pinned trl release, CPU, the tiny offline model, a rank-1 LoRA) is
built per module (tests/trl_parity_helpers.py). Each case feeds TRL's `_compute_loss(model,
inputs)` and grpo_lab's `policy_logprobs` + `grpo_loss` the same batch, on the same model: prompt
and completion ids and masks (left-padded prompts, right-padded completions), advantages, old
per-token logprobs (absent = the ratio is 1, as TRL does at num_iterations 1; perturbed = ratio
!= 1, as from the second of num_iterations > 1 updates) and reference logprobs when beta > 0.
Losses, gradients and the clip/KL metrics agree to float32 rounding (tests/float_tolerance.py: a
few ulps of the summed terms' size per term) for every loss type both libraries have (grpo,
dapo, dr_grpo). A parametrised negative case shows the comparison fails once grpo_lab's side
changes. The vLLM importance-sampling correction is in test_trl_parity_sampler.py.

Differences by design, each named and pinned by a test below:
  1. KL bias correction: TRL (default `use_bias_correction_kl=True`) multiplies the k3 KL by the
     ratio pi_theta / pi_old; grpo_lab's `grpo_loss` has the option under TRL's name, off by
     default (DeepSeekMath's k3). The ratio is differentiable: at ratio 1 the losses are equal and
     the gradients are not (without it the KL term follows the gradient of KL(pi_ref || pi_theta),
     with it that of KL(pi_theta || pi_ref): notebook 01b). The grid uses False;
     `test_kl_term_matches_trl` compares the KL term's loss and gradients with both settings.
  2. Position ids: TRL's scoring forward passes none (positions count the left padding);
     grpo_lab passes `cumsum(mask) - 1` as `generate` does. RoPE only sees position
     differences, so Llama's logprobs agree anyway.
  3. Padded completion positions: TRL's per-token logprobs are exactly 0 there, grpo_lab's are
     the model's logprob of the pad token. Both losses mask them out.
  4. dr_grpo's constant: TRL divides by its config's `max_completion_length`; `grpo_loss` uses
     the batch's padded width unless given `max_completion_length` (grpo_lab's trainer passes it).
  5. Gradient accumulation: TRL divides each micro-batch loss by the accumulation steps (dapo:
     by the generation batch's token count); grpo_lab computes one loss on the whole batch. The
     micro-batch losses and gradients sum to grpo_lab's.
  6. Defaults: TRL's loss_type is "dapo", its lr 1e-6 with linear decay, no weight decay,
     512 completion tokens, gradient checkpointing on; grpo_lab's are in `GRPOConfig`.
"""

from __future__ import annotations

import inspect
import math
import random
import warnings

import pytest
import torch
from float_tolerance import assert_f32_close, assert_grads_close, f32_atol
from peft import LoraConfig
from trl import GRPOConfig as TRLConfig
from trl import GRPOTrainer as TRLTrainer
from trl_parity_helpers import (
    BETA,
    CHECKPOINTING,
    EPSILONS,
    LONGEST_COMPLETION,
    LORA,
    MAX_COMPLETION_LENGTH,
    MISS,
    NUM_PROMPTS,
    TEMPERATURE,
    B,
    G,
    addition_dataset,
    batch_logprob_atol,
    configured,
    fraction_atol,
    gradients,
    grpo_lab_loss,
    kl_atol,
    last_metric,
    loss_atol,
    make_batch,
    make_trainer,
    our_logprobs,
    positions,
    randomised_lora,
    single_torch_thread,
    trl_args,
    trl_inputs,
    trl_logprobs,
)

from grpo_lab.algo import grpo_loss as core
from grpo_lab.algo import logprobs
from grpo_lab.data.rewards import exact_match_reward
from grpo_lab.data.tasks import AdditionTask
from grpo_lab.model.models import load_model_and_tokenizer
from grpo_lab.train.config import GRPOConfig


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with single_torch_thread():
        yield


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    return make_trainer(tiny_model_dir, tmp_path_factory.mktemp("trl-parity"))


@pytest.fixture(scope="module")
def model(trainer):
    return randomised_lora(trainer)


@pytest.fixture(scope="module")
def batch(trainer, model):
    return make_batch(trainer, model)


# ---------------------------------------------------------------------------------------------
# The parity grid


def test_trainer_reads_its_config(trainer):
    """`configured` sets these attributes: check TRL's __init__ copies them from its config."""
    args = trainer.args
    assert (trainer.loss_type, trainer.beta) == (args.loss_type, args.beta) == ("grpo", 0.0)
    assert (trainer.epsilon_low, trainer.epsilon_high) == (args.epsilon, args.epsilon_high)
    assert (args.epsilon, args.epsilon_high) == (0.2, 0.28)
    assert trainer.scale_rewards == args.scale_rewards == "group"
    assert trainer.max_completion_length == MAX_COMPLETION_LENGTH
    assert trainer.temperature == TEMPERATURE
    assert args.steps_per_generation == args.gradient_accumulation_steps == 1


def test_per_token_logprobs_match(trainer, model, batch):
    """TRL's fused LM head and grpo_lab's `policy_logprobs` score the completions alike."""
    with torch.no_grad():
        trl_logps = trl_logprobs(trainer, model, batch)
        ours = our_logprobs(model, batch)
    real = batch["completion_mask"].bool()
    atol = batch_logprob_atol(batch, len(trainer.processing_class))
    assert_f32_close(ours[real], trl_logps[real], atol, "logprobs")
    # ... and the tolerance is far below what a real difference moves: the temperature.
    with torch.no_grad():
        at_t1 = logprobs.policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                     batch["completion_ids"], batch["completion_mask"], 1.0)
    assert (at_t1[real] - trl_logps[real]).abs().max() > MISS * atol
    # Difference 3: TRL's are exactly 0 on padding; grpo_lab's are real numbers (masked later).
    assert torch.all(trl_logps[~real] == 0)
    assert torch.all(ours[~real] < 0)


@pytest.mark.parametrize("loss_type", core.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, BETA])
@pytest.mark.parametrize("off_policy", [False, True], ids=["ratio1", "ratio!=1"])
@pytest.mark.parametrize("epsilons", EPSILONS, ids=lambda e: f"eps{e[0]}-{e[1]}")
def test_loss_matches_trl(trainer, model, batch, loss_type, beta, off_policy, epsilons):
    epsilon_low, epsilon_high = epsilons
    with configured(trainer, loss_type=loss_type, beta=beta, epsilon_low=epsilon_low,
                    epsilon_high=epsilon_high):
        trl_loss = trainer._compute_loss(model, trl_inputs(batch, off_policy=off_policy, beta=beta))
        ours, metrics = grpo_lab_loss(model, batch, off_policy=off_policy, beta=beta,
                                      loss_type=loss_type, epsilon_low=epsilon_low,
                                      epsilon_high=epsilon_high)
        assert_f32_close(ours.item(), trl_loss.item(),
                         loss_atol(batch, off_policy=off_policy, beta=beta), "loss")
        # The same gradient, not just the same value.
        assert_grads_close(gradients(model, ours), gradients(model, trl_loss), positions(batch))
        # grpo_lab's metric names are TRL's; the values agree too.
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
                     "clip_ratio/low_min", "clip_ratio/high_max"):  # the last two per completion
            assert_f32_close(metrics[name], last_metric(trainer, name), fraction_atol(batch), name)
        if beta:
            assert_f32_close(metrics["kl"], last_metric(trainer, "kl"), kl_atol(batch), "kl")
    if off_policy:  # the batch exercises both clip branches, so epsilon parity is not vacuous
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    else:
        assert metrics["ratio"] == 1.0 and metrics["clip_ratio/region_mean"] == 0.0


@pytest.mark.parametrize("loss_type", core.LOSS_TYPES)
def test_beta_term_is_not_negligible(model, batch, loss_type):
    """The KL term moves the loss by far more than its tolerance, so beta > 0 parity is a real
    check."""
    kwargs = dict(off_policy=True, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28)
    with torch.no_grad():
        without = grpo_lab_loss(model, batch, beta=0.0, **kwargs)[0]
        with_kl, metrics = grpo_lab_loss(model, batch, beta=BETA, **kwargs)
    assert metrics["kl"] > 0.01
    assert abs(with_kl - without).item() > MISS * loss_atol(batch, off_policy=True, beta=BETA)


@pytest.mark.parametrize("loss_type", core.LOSS_TYPES)
@pytest.mark.parametrize("off_policy", [False, True], ids=["ratio1", "ratio!=1"])
@pytest.mark.parametrize("bias_correction", [False, True], ids=["k3", "ratio*k3"])
def test_kl_term_matches_trl(trainer, model, batch, loss_type, off_policy, bias_correction):
    """The KL term alone, with and without TRL's `use_bias_correction_kl`: the same loss, `kl`
    metric and gradients. Advantages 0 make the surrogate and its gradient 0, so the gradients
    compared are the KL term's, not drowned in the surrogate's."""
    eps = dict(epsilon_low=0.2, epsilon_high=0.28)
    batch = dict(batch, advantages=torch.zeros_like(batch["advantages"]))
    with configured(trainer, loss_type=loss_type, beta=BETA, use_bias_correction_kl=bias_correction,
                    **eps):
        trl_loss = trainer._compute_loss(model, trl_inputs(batch, off_policy=off_policy, beta=BETA))
        ours, metrics = grpo_lab_loss(model, batch, off_policy=off_policy, beta=BETA,
                                      loss_type=loss_type, use_bias_correction_kl=bias_correction,
                                      **eps)
        kl = dict(off_policy=off_policy, bias_correction=bias_correction)
        assert_f32_close(ours.item(), trl_loss.item(), loss_atol(batch, beta=BETA, **kl), "loss")
        assert_f32_close(metrics["kl"], last_metric(trainer, "kl"), kl_atol(batch, **kl), "kl")
    trl_grads, our_grads = gradients(model, trl_loss), gradients(model, ours)
    assert max(g.abs().max().item() for g in our_grads.values()) > 1e-3  # a real gradient
    assert_grads_close(our_grads, trl_grads, positions(batch))


# ---------------------------------------------------------------------------------------------
# Negative cases: alter one thing on grpo_lab's side and the comparison must fail


ALTERATIONS = {  # name: (the loss type both sides start from, what changes on grpo_lab's side)
    "epsilon_high 0.28->0.2": ("grpo", dict(epsilon_high=0.2)),
    "epsilon_low 0.2->0.3": ("grpo", dict(epsilon_low=0.3)),
    "aggregation grpo->dapo": ("grpo", dict(loss_type="dapo")),
    "aggregation dapo->grpo": ("dapo", dict(loss_type="grpo")),
    "aggregation grpo->dr_grpo": ("grpo", dict(loss_type="dr_grpo")),
    "beta 0.1->0.05": ("grpo", dict(beta=0.05)),
    "dr_grpo constant 5->4": ("dr_grpo", dict(max_completion_length=4)),
}


@pytest.mark.parametrize("alteration", ALTERATIONS, ids=list(ALTERATIONS))
def test_altered_loss_does_not_match(trainer, model, batch, alteration):
    loss_type, change = ALTERATIONS[alteration]
    reference = dict(loss_type=loss_type, beta=BETA, epsilon_low=0.2, epsilon_high=0.28)
    with configured(trainer, **reference), torch.no_grad():
        trl_loss = trainer._compute_loss(model, trl_inputs(batch, off_policy=True, beta=BETA))
        same, _ = grpo_lab_loss(model, batch, off_policy=True, **reference)
        altered, _ = grpo_lab_loss(model, batch, off_policy=True, **{**reference, **change})
    atol = loss_atol(batch, off_policy=True, beta=BETA)
    assert_f32_close(same.item(), trl_loss.item(), atol, "loss")  # the unaltered copy matches ...
    assert abs(trl_loss.item() - altered.item()) > MISS * atol, (alteration, trl_loss.item(),
                                                                 altered.item())


# ---------------------------------------------------------------------------------------------
# Advantages: TRL's inline formula (run for real) vs grpo_lab's group_advantages


@pytest.mark.parametrize("scale_rewards, scale_by_std", [("group", True), ("none", False)])
def test_advantages_match(trainer, model, scale_rewards, scale_by_std):
    """TRL samples, scores and computes advantages; grpo_lab rescoring its completions agrees."""
    problems = AdditionTask(eval_size=64).sample_batch(random.Random(2), NUM_PROMPTS)
    rows = [{"prompt": p.prompt, "answer": p.answer} for p in problems for _ in range(G)]
    torch.manual_seed(0)
    # The base model (adapter off) is right ~30 % of the time: groups with mixed rewards.
    with configured(trainer, scale_rewards=scale_rewards, beta=0.0), model.disable_adapter():
        out = trainer._generate_and_score_completions(rows)
    tokenizer = trainer.processing_class
    texts = tokenizer.batch_decode(
        [ids[m.bool()]
         for ids, m in zip(out["completion_ids"], out["completion_mask"], strict=True)],
        skip_special_tokens=True)
    rewards = torch.tensor(exact_match_reward(texts, answer=[r["answer"] for r in rows]))
    groups = rewards.view(-1, G)
    assert ((groups.min(1).values < groups.max(1).values).sum() >= 1), "need a mixed group"
    ours = core.group_advantages(rewards, G, scale_by_std=scale_by_std)
    # A group's mean and std sum its G rewards (in [0, 1]); the advantages are their quotient.
    assert_f32_close(out["advantages"], ours, f32_atol(ours.abs().max().item(), G), "advantages")
    assert_f32_close(last_metric(trainer, "reward"), rewards.mean().item(), f32_atol(1.0, B),
                     "reward")


# ---------------------------------------------------------------------------------------------
# Differences by design, pinned


@pytest.mark.parametrize("loss_type", core.LOSS_TYPES)
def test_difference_kl_bias_correction(trainer, model, batch, loss_type):
    """1. TRL's default `use_bias_correction_kl=True` weighs the k3 KL by the ratio; grpo_lab's
    default does not. Off-policy the losses differ; at ratio 1 the losses agree, the gradients
    do not."""
    eps = dict(epsilon_low=0.2, epsilon_high=0.28)
    mask = batch["completion_mask"].float()
    # The correction adds beta * (ratio - 1) * k3 per token to the loss, and beta * k3 * ratio
    # * d log pi_theta to its gradient. Built so that both are large whatever the model: a
    # reference ~1 nat from the policy (k3 ~ 0.6 per token) and old logprobs 0.3 nat below the
    # current ones (ratio ~ 1.4 on average), not a model-dependent adapter gap.
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        current = our_logprobs(model, batch)
    noise = torch.randn(current.shape, generator=generator)
    batch = dict(batch, ref_logps=(current + noise) * mask, old_logps=(current - 0.3) * mask)
    kwargs = dict(beta=BETA, loss_type=loss_type, **eps)
    with configured(trainer, use_bias_correction_kl=True, **kwargs):
        with torch.no_grad():
            trl_loss = trainer._compute_loss(model, trl_inputs(batch, off_policy=True, beta=BETA))
            ours, _ = grpo_lab_loss(model, batch, off_policy=True, **kwargs)
            corrected, _ = grpo_lab_loss(model, batch, off_policy=True, use_bias_correction_kl=True,
                                         **kwargs)
        trl_on_policy = trainer._compute_loss(model, trl_inputs(batch, off_policy=False, beta=BETA))
    ours_on_policy, _ = grpo_lab_loss(model, batch, off_policy=False, **kwargs)
    corrected_on_policy, _ = grpo_lab_loss(model, batch, off_policy=False,
                                           use_bias_correction_kl=True, **kwargs)
    off_atol = loss_atol(batch, off_policy=True, beta=BETA, bias_correction=True)
    assert abs(trl_loss - ours).item() > MISS * off_atol  # off-policy: different values
    assert_f32_close(corrected.item(), trl_loss.item(), off_atol, "loss")  # TRL's term
    # At ratio 1: the same value ...
    assert_f32_close(ours_on_policy.item(), trl_on_policy.item(),
                     loss_atol(batch, off_policy=False, beta=BETA), "loss at ratio 1")
    # ... and not the same gradient, unless grpo_lab weighs by the ratio too.
    trl_grads = gradients(model, trl_on_policy)
    our_grads = gradients(model, ours_on_policy)
    corrected_grads = gradients(model, corrected_on_policy)
    # the gap in units of each tensor's tolerance (assert_grads_close's rule)
    gap = max((trl_grads[n] - our_grads[n]).abs().max().item()
              / f32_atol(trl_grads[n].abs().max().item(), positions(batch)) for n in our_grads)
    assert gap > MISS, gap
    assert_grads_close(corrected_grads, trl_grads, positions(batch))
    assert TRLConfig.__dataclass_fields__["use_bias_correction_kl"].default is True
    assert inspect.signature(core.grpo_loss).parameters["use_bias_correction_kl"].default is False


def test_difference_position_ids(trainer, model, batch):
    """2. TRL scores without position ids; RoPE makes the left-padding offset harmless."""
    seen = []
    backbone = model.get_base_model().model  # LlamaModel
    hook = backbone.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs.get("position_ids")), with_kwargs=True)
    try:
        with torch.no_grad():
            trl_logps = trl_logprobs(trainer, model, batch)
            ours = our_logprobs(model, batch)
    finally:
        hook.remove()
    trl_positions, our_positions = seen
    # TRL: no position ids, so Llama numbers the tokens 0..L-1 and a row's first real token sits
    # at position (number of pads). grpo_lab: the first real token is at position 0 in every row.
    assert trl_positions is None
    first_real = batch["prompt_mask"].argmax(1)  # = the number of left pads
    assert first_real.max() > 0, "the batch must hold left-padded rows"
    assert our_positions[torch.arange(B), first_real].eq(0).all()
    real = batch["completion_mask"].bool()
    assert_f32_close(ours[real], trl_logps[real],
                     batch_logprob_atol(batch, len(trainer.processing_class)), "logprobs")


def test_difference_dr_grpo_constant(trainer, model, batch):
    """4. Without `max_completion_length`, grpo_loss's dr_grpo divides by the batch's width."""
    assert batch["completion_ids"].shape[1] == LONGEST_COMPLETION < MAX_COMPLETION_LENGTH
    eps = dict(epsilon_low=0.2, epsilon_high=0.28)
    with configured(trainer, loss_type="dr_grpo", beta=0.0, **eps), torch.no_grad():
        trl_loss = trainer._compute_loss(model, trl_inputs(batch, off_policy=True, beta=0.0))
        default, _ = grpo_lab_loss(model, batch, off_policy=True, beta=0.0, loss_type="dr_grpo",
                                   max_completion_length=None, **eps)
    scale = MAX_COMPLETION_LENGTH / LONGEST_COMPLETION
    atol = loss_atol(batch, off_policy=True, beta=0.0) * scale
    assert_f32_close(default.item(), trl_loss.item() * scale, atol, "dr_grpo loss")
    assert abs(default.item() - trl_loss.item()) > MISS * atol  # the constant matters here


@pytest.mark.parametrize("loss_type", core.LOSS_TYPES)
def test_difference_gradient_accumulation(trainer, model, batch, loss_type):
    """5. TRL over 2 accumulated micro-batches == grpo_lab on the whole batch (value and grad)."""
    eps = dict(epsilon_low=0.2, epsilon_high=0.28)
    halves = [slice(0, B // 2), slice(B // 2, B)]  # two whole groups each
    total_tokens = batch["completion_mask"].sum()  # TRL counts the generation batch's tokens
    with configured(trainer, loss_type=loss_type, beta=BETA, current_gradient_accumulation_steps=2,
                    steps_per_generation=2, **eps):
        trl_losses = [trainer._compute_loss(model, trl_inputs(batch, rows, off_policy=True,
                                                              beta=BETA,
                                                              num_items_in_batch=total_tokens))
                      for rows in halves]
    ours, _ = grpo_lab_loss(model, batch, off_policy=True, beta=BETA, loss_type=loss_type, **eps)
    trl_total = trl_losses[0] + trl_losses[1]
    atol = loss_atol(batch, off_policy=True, beta=BETA)
    assert_f32_close(ours.item(), trl_total.item(), atol, "loss")
    # Each micro-batch alone is not grpo_lab's loss of that half: TRL divides by 2 (and dapo by
    # the whole batch's tokens).
    half, _ = grpo_lab_loss(model, {k: v[halves[0]] for k, v in batch.items()}, off_policy=True,
                            beta=BETA, loss_type=loss_type, **eps)
    assert abs(trl_losses[0] - half).item() > MISS * atol
    assert_grads_close(gradients(model, ours), gradients(model, trl_total), positions(batch))


def test_difference_defaults(tmp_path):
    """6. The defaults differ; notebook 03 maps them field by field."""
    with warnings.catch_warnings():  # TRL's own default trips transformers' rename warning
        warnings.simplefilter("ignore", FutureWarning)
        trl = TRLConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False)
    ours = GRPOConfig()
    assert (trl.loss_type, ours.loss_type) == ("dapo", "grpo")
    assert (trl.learning_rate, ours.learning_rate) == (1e-6, 1e-3)
    assert trl.lr_scheduler_type == "linear"  # decays to 0; grpo_lab's lr is constant
    assert trl.weight_decay == 0.0 and trl.adam_beta2 == 0.999  # grpo_lab: 0.0 and 0.95
    assert trl.max_completion_length == 512 and ours.max_completion_length is None  # task + 2
    assert getattr(trl, CHECKPOINTING) is True  # `gradient_checkpointing` before 5.23
    assert trl.epsilon_high is None  # = epsilon
    assert (trl.scale_rewards, ours.scale_rewards) == ("group", True)
    assert (trl.beta, ours.beta) == (0.0, 0.0)
    assert (trl.epsilon, ours.epsilon_low) == (0.2, 0.2)
    assert (trl.num_generations, ours.num_generations) == (8, 8)
    assert (trl.top_k, trl.top_p, trl.temperature) == (0, 1.0, 1.0)  # untruncated, as grpo_lab


# ---------------------------------------------------------------------------------------------
# TRL trains grpo_lab's task with grpo_lab's reward, unchanged


@pytest.mark.slow
def test_trl_trains_tiny_model_on_grpo_lab_task(tiny_model_dir, tmp_path):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    args = trl_args(
        tmp_path,
        temperature=1.0,
        per_device_train_batch_size=8 * G,  # 8 prompts x G completions per step
        max_steps=4,
        learning_rate=1e-3,  # default 1e-6 barely moves a LoRA adapter
        logging_steps=1,
        loss_type="grpo",
    )
    trainer = TRLTrainer(model=model, reward_funcs=exact_match_reward, args=args,
                         train_dataset=addition_dataset(64), processing_class=tokenizer,
                         peft_config=LoraConfig(**LORA))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = dict(trainer.model.named_parameters())
    lora = [n for n in before if "lora_" in n]
    assert lora and all(after[n].requires_grad for n in lora)
    changed = [n for n in lora if not torch.equal(before[n], after[n])]
    assert changed == lora, f"unchanged LoRA parameters: {sorted(set(lora) - set(changed))}"
    frozen = [n for n in before if "lora_" not in n]
    assert all(torch.equal(before[n], after[n]) for n in frozen), "base weights must stay frozen"
    logs = [r for r in trainer.state.log_history if "reward" in r]
    assert len(logs) == 4
    for record in logs:
        assert 0.0 <= record["reward"] <= 1.0
        assert record["rewards/exact_match_reward/mean"] == pytest.approx(record["reward"])
        assert math.isfinite(record["loss"])
        assert "clip_ratio/region_mean" in record and "completions/mean_length" in record
