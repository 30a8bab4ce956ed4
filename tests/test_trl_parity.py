"""TRL parity: grpo_lab's GRPO loss equals the loss of TRL's `GRPOTrainer` on the same batch.

One TRL `GRPOTrainer` (the pinned trl release, CPU, the tiny offline model, a rank-1 LoRA) is
built per module. Each case feeds TRL's `_compute_loss(model, inputs)` and grpo_lab's
`policy_logprobs` + `grpo_loss` the same batch, on the same model: prompt and completion ids and
masks (left-padded prompts, right-padded completions), advantages, old per-token logprobs
(absent = the ratio is 1, as TRL does at num_iterations 1; perturbed = ratio != 1, as from the
second of num_iterations > 1 updates) and reference logprobs when beta > 0. Losses, gradients
and the clip/KL metrics agree to 1e-5 for every loss type both libraries have (grpo, dapo,
dr_grpo). A parametrised negative case shows the comparison fails once grpo_lab's side changes.
The vLLM importance-sampling correction (every `vllm_importance_sampling_mode`, with and without
clip_min) agrees with TRL's own code to 1e-6: weights, `sampling/*` metrics, loss and gradients.

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
from contextlib import contextmanager

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from trl import GRPOConfig as TRLConfig
from trl import GRPOTrainer as TRLTrainer

from grpo_lab.core import grpo_loss as core
from grpo_lab.core.config import GRPOConfig
from grpo_lab.core.models import load_model_and_tokenizer
from grpo_lab.core.rewards import exact_match_reward
from grpo_lab.core.sampler_correction import (
    sampler_correction_metrics,
    sampler_importance_weights,
    sampler_log_ratio,
)
from grpo_lab.core.tasks import AdditionTask
from grpo_lab.train.trainer import pad_left, pad_right

TOL = 1e-5  # the bar for losses and metrics
G = 4  # completions per prompt
NUM_PROMPTS = 4
B = NUM_PROMPTS * G  # one generation batch = one TRL micro-batch
MAX_COMPLETION_LENGTH = 5  # the task's answer (3 chars) + 2, as grpo_lab's trainer sets it
LONGEST_COMPLETION = 4  # batch width < MAX_COMPLETION_LENGTH, so dr_grpo's constant matters
TEMPERATURE = 0.8  # != 1, so both sides must divide the logits by it
EPSILONS = [(0.2, 0.2), (0.2, 0.28)]  # (low, high): symmetric, and DAPO's clip-higher
BETA = 0.1
LORA = dict(r=1, lora_alpha=2, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")


def trl_args(output_dir, **overrides) -> TRLConfig:
    """TRL's GRPOConfig shrunk for the tiny model on a CPU (its defaults suit 7B models on GPUs)."""
    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,  # TRL raises on a CPU-only machine without it
        bf16=False,  # use_cpu alone leaves bf16 on
        report_to="none",
        save_strategy="no",
        # TRL's default True (as gradient_checkpointing) only slows 1M params
        activation_checkpointing=False,
        per_device_train_batch_size=B,  # completions per micro-batch
        num_generations=G,
        max_completion_length=MAX_COMPLETION_LENGTH,  # default 512
        temperature=TEMPERATURE,
        seed=0,
    )
    values.update(overrides)
    return TRLConfig(**values)


def addition_dataset(n: int, seed: int = 0) -> Dataset:
    """grpo_lab's AdditionTask as the in-memory dataset TRL wants: `prompt` + `answer` columns."""
    problems = AdditionTask(eval_size=64).sample_batch(random.Random(seed), n)
    return Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])


# ---------------------------------------------------------------------------------------------
# Fixtures: one TRL trainer, one synthetic batch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One thread: the tiny model gains nothing from two, and two threads in each of two busy
    processes on a 2-core machine ran every call ~100x slower (shared/docs/tiny-model.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    """TRL's GRPOTrainer on a fresh copy of the tiny model (TRL patches and wraps the model)."""
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    trainer = TRLTrainer(
        model=model,
        reward_funcs=exact_match_reward,
        args=trl_args(tmp_path_factory.mktemp("trl-parity"), loss_type="grpo",
                      epsilon=0.2, epsilon_high=0.28, use_bias_correction_kl=False),
        train_dataset=addition_dataset(32),
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA),
    )
    # TRL's training loop sets this before every optimizer step; with gradient_accumulation_steps=1
    # it is 1. `_compute_loss` divides by it.
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()  # "train" mode: TRL's normalisers for training, not evaluation
    return trainer


@pytest.fixture(scope="module")
def model(trainer):
    """The peft model, with LoRA B randomised so the adapter (and so the KL to the base) is not
    0."""
    peft_model = trainer.model
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=generator))
    return peft_model


@pytest.fixture(scope="module")
def batch(trainer, model):
    """A deterministic batch: 4 prompts x G completions of random tokens with padding."""
    tokenizer = trainer.processing_class
    generator = torch.Generator().manual_seed(1)
    problems = AdditionTask(eval_size=64).sample_batch(random.Random(1), NUM_PROMPTS - 1)
    # One 1-digit prompt is shorter: its rows are left padded (difference 2 in the docstring).
    prompts = [p.prompt for p in problems] + ["3+4="]
    prompt_rows = [tokenizer(p)["input_ids"] for p in prompts for _ in range(G)]
    prompt_ids, prompt_mask = pad_left(prompt_rows, tokenizer.pad_token_id)
    # Completion lengths 1..LONGEST_COMPLETION: right padding in most rows (difference 3).
    lengths = [1 + (7 * i) % LONGEST_COMPLETION for i in range(B)]
    completions = [torch.randint(3, len(tokenizer), (n,), generator=generator).tolist()
                   for n in lengths]
    completion_ids, completion_mask = pad_right(completions, tokenizer.pad_token_id)
    # Rewards: binary groups, a graded one, and a group with no signal (advantage 0, no NaN).
    rewards = torch.tensor([1, 0, 0, 1, 0, 0, 0, 1, 0.5, 0, 1, 0.25, 1, 1, 1, 1],
                           dtype=torch.float32)
    advantages = core.group_advantages(rewards, G)
    with torch.no_grad():
        current = core.policy_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                       completion_mask, TEMPERATURE)
        with model.disable_adapter():  # LoRA's reference: the base model, as in both trainers
            ref_logps = core.policy_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                             completion_mask, TEMPERATURE)
    # "Old" logprobs as after a few updates: about +-0.4 (1 sigma) around the current ones, so both
    # clip branches fire. Zero on padding, as TRL pads them.
    old_logps = (current + 0.4 * torch.randn(current.shape, generator=generator)) * completion_mask
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, rewards=rewards, advantages=advantages,
                old_logps=old_logps, ref_logps=ref_logps)


# ---------------------------------------------------------------------------------------------
# Helpers: one loss from each library


TRAINER_ATTRS = ("loss_type", "beta", "epsilon_low", "epsilon_high", "scale_rewards",
                 "current_gradient_accumulation_steps")
ARGS_ATTRS = ("use_bias_correction_kl", "steps_per_generation")


@contextmanager
def configured(trainer, **settings):
    """Set what `_compute_loss` reads (attributes TRL's __init__ copies from its GRPOConfig, or the
    config itself), restoring them afterwards. `test_trainer_reads_its_config` checks the copy."""
    saved = {}
    for name, value in settings.items():
        owner = trainer.args if name in ARGS_ATTRS else trainer
        assert name in TRAINER_ATTRS + ARGS_ATTRS, name
        saved[name] = getattr(owner, name)
        setattr(owner, name, value)
    try:
        yield trainer
    finally:
        for name, value in saved.items():
            setattr(trainer.args if name in ARGS_ATTRS else trainer, name, value)


def trl_inputs(batch, rows=slice(None), *, off_policy: bool, beta: float,
               num_items_in_batch=None) -> dict:
    """The dict TRL's `_generate_and_score_completions` hands to `_compute_loss`."""
    inputs = {key: batch[key][rows] for key in
              ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages")}
    # Tokens of the whole generation batch (all processes): dapo's normaliser.
    inputs["num_items_in_batch"] = (num_items_in_batch if num_items_in_batch is not None
                                    else inputs["completion_mask"].sum())
    if off_policy:  # TRL only passes old logprobs when they can differ from the current ones
        inputs["old_per_token_logps"] = batch["old_logps"][rows]
    if beta:
        inputs["ref_per_token_logps"] = batch["ref_logps"][rows]
    return inputs


def grpo_lab_loss(model, batch, *, off_policy: bool, beta: float, loss_type: str,
                  epsilon_low: float, epsilon_high: float,
                  max_completion_length=MAX_COMPLETION_LENGTH,
                  use_bias_correction_kl: bool = False):
    logps = core.policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                 batch["completion_ids"], batch["completion_mask"], TEMPERATURE)
    old = batch["old_logps"] if off_policy else logps.detach()
    return core.grpo_loss(
        logps, old, batch["advantages"], batch["completion_mask"], loss_type=loss_type,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
        ref_logps=batch["ref_logps"] if beta else None, max_completion_length=max_completion_length,
        use_bias_correction_kl=use_bias_correction_kl,
    )


def gradients(model, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """d loss / d LoRA parameters, leaving the model's .grad clean."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named])
    return {n: g for (n, _), g in zip(named, grads, strict=True)}


def last_metric(trainer, name: str) -> float:
    return trainer._metrics["train"][name][-1]


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
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        trl_logps, _, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, batch["completion_ids"].shape[1])
        ours = core.policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                    batch["completion_ids"], batch["completion_mask"], TEMPERATURE)
    real = batch["completion_mask"].bool()
    torch.testing.assert_close(trl_logps[real], ours[real], atol=TOL, rtol=0)
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
        assert abs(trl_loss.item() - ours.item()) <= TOL, (trl_loss.item(), ours.item())
        # The same gradient, not just the same value.
        trl_grads, our_grads = gradients(model, trl_loss), gradients(model, ours)
        for name in our_grads:
            torch.testing.assert_close(trl_grads[name], our_grads[name], atol=TOL, rtol=1e-4)
        # grpo_lab's metric names are TRL's; the values agree too.
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert last_metric(trainer, name) == pytest.approx(metrics[name], abs=TOL)
        if beta:
            assert last_metric(trainer, "kl") == pytest.approx(metrics["kl"], abs=TOL)
    if off_policy:  # the batch exercises both clip branches, so epsilon parity is not vacuous
        assert metrics["clip_ratio/low_mean"] > 0 and metrics["clip_ratio/high_mean"] > 0
    else:
        assert metrics["ratio"] == 1.0 and metrics["clip_ratio/region_mean"] == 0.0


@pytest.mark.parametrize("loss_type", core.LOSS_TYPES)
def test_beta_term_is_not_negligible(model, batch, loss_type):
    """The KL term moves the loss by far more than TOL, so beta > 0 parity is a real check."""
    kwargs = dict(off_policy=True, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28)
    with torch.no_grad():
        without = grpo_lab_loss(model, batch, beta=0.0, **kwargs)[0]
        with_kl, metrics = grpo_lab_loss(model, batch, beta=BETA, **kwargs)
    assert metrics["kl"] > 0.01
    assert abs(with_kl - without).item() > 100 * TOL


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
        assert abs(trl_loss.item() - ours.item()) <= TOL, (trl_loss.item(), ours.item())
        assert last_metric(trainer, "kl") == pytest.approx(metrics["kl"], abs=TOL)
    trl_grads, our_grads = gradients(model, trl_loss), gradients(model, ours)
    assert max(g.abs().max().item() for g in our_grads.values()) > 100 * TOL  # a real gradient
    for name in our_grads:
        torch.testing.assert_close(trl_grads[name], our_grads[name], atol=TOL, rtol=1e-4)


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
    assert abs(trl_loss.item() - same.item()) <= TOL  # the unaltered copy matches ...
    assert abs(trl_loss.item() - altered.item()) > 100 * TOL, (alteration, trl_loss.item(),
                                                               altered.item())


# ---------------------------------------------------------------------------------------------
# The sampler/trainer importance-sampling correction (TRL's `vllm_importance_sampling_*`)
#
# TRL computes the weights and the `sampling/*` metrics inline in `_generate_and_score_completions`
# when `use_vllm`: that method runs for real here, with its two model calls stubbed on the
# instance: `_generate` returns the batch's tokens with "vLLM" logprobs, and
# `_get_per_token_logps_and_entropies` returns the batch's old logprobs as the trainer's. Then
# `_compute_loss` applies the weights. grpo_lab's `sampler_importance_weights` and `grpo_loss`
# get the same tensors.

IS_TOL = 1e-6  # the bar for the correction: weights, loss, metrics
# Gradients are float32 sums over every token of the batch, in a different order on each side:
# with beta > 0 they agree to ~2e-6 of their largest entry on some CPUs (2.9e-6 at 1.44 on one
# AVX-512 host, under 1e-6 on others). The loss is held to IS_TOL.
IS_GRAD_TOL = 1e-5
IS_SETTINGS = {  # id: (mode, clip_max, clip_min)
    "token_truncate": ("token_truncate", 2.0, None),
    "token_mask": ("token_mask", 2.0, None),
    "sequence_truncate": ("sequence_truncate", 2.0, None),
    "sequence_mask": ("sequence_mask", 2.0, None),
    "token_truncate-min": ("token_truncate", 2.0, 0.5),
    "token_mask-min": ("token_mask", 2.0, 0.5),
    "sequence_truncate-min": ("sequence_truncate", 2.0, 0.5),
    "sequence_mask-min": ("sequence_mask", 2.0, 0.5),
    "token_mask-min-only": ("token_mask", None, 0.5),
    "sequence_mask-TRL-defaults": ("sequence_mask", 3.0, None),
}
IS_ATTRS = ("use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "beta")
NAN_TOKEN = (5, 0)  # (row, token) whose sampler logprob is unavailable (vLLM sends None)


@pytest.fixture(scope="module")
def sampler_logps(batch):
    """"vLLM" logprobs: the old (trainer's) ones moved by ~0.6 nat per token, so token ratios span
    ~0.3-3 and sequence ratios more; one NaN token; 0 on padding, as TRL pads them. Rows 0 (one
    token) and 9 (four) are 1 nat per token less likely under the sampler: sequence ratios ~2.9
    and ~70, so that the caps bite on sequences with a nonzero advantage, not only on the last
    group's (advantage 0, where no weight changes the loss)."""
    generator = torch.Generator().manual_seed(3)
    noise = 0.6 * torch.randn(batch["old_logps"].shape, generator=generator)
    noise[[0, 9]] -= 1.0
    logps = (batch["old_logps"] + noise) * batch["completion_mask"]
    logps[NAN_TOKEN] = float("nan")
    return logps


@contextmanager
def trl_with_vllm_correction(trainer, batch, sampler, mode, clip_max, clip_min):
    """TRL's trainer as with vLLM and the correction on, its sampling and scoring stubbed."""
    real = batch["completion_mask"].bool()
    prompt_lists = [ids[m.bool()].tolist()
                    for ids, m in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)]
    completion_lists = [ids[m].tolist()
                        for ids, m in zip(batch["completion_ids"], real, strict=True)]
    sampler_lists = [[None if math.isnan(x) else x for x in row[m].tolist()]
                     for row, m in zip(sampler, real, strict=True)]
    texts = trainer.processing_class.batch_decode(completion_lists, skip_special_tokens=True)

    def generate(prompts):
        return prompt_lists, completion_lists, None, texts, sampler_lists, {}, None, None

    def per_token_logps_and_entropies(*args, **kwargs):
        return batch["old_logps"].clone(), None, None

    settings = dict(use_vllm=True, vllm_importance_sampling_correction=True,
                    vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=clip_max,
                    vllm_importance_sampling_clip_min=clip_min, beta=0.0)
    saved = {name: getattr(trainer, name) for name in IS_ATTRS}
    for name, value in settings.items():
        setattr(trainer, name, value)
    trainer._generate = generate  # instance attributes shadow the methods
    trainer._get_per_token_logps_and_entropies = per_token_logps_and_entropies
    try:
        yield trainer
    finally:
        del trainer._generate, trainer._get_per_token_logps_and_entropies
        for name, value in saved.items():
            setattr(trainer, name, value)


def trl_correction(trainer, batch, sampler, mode, clip_max, clip_min):
    """TRL's importance weights and `sampling/*` metrics for `sampler` vs the batch's old logps."""
    rows = [{"prompt": "1+1=", "answer": "002"} for _ in range(B)]  # rewards are not compared here
    with trl_with_vllm_correction(trainer, batch, sampler, mode, clip_max, clip_min), \
            torch.no_grad():
        out = trainer._generate_and_score_completions(rows)
    # The stubs were used: TRL's tensors are the batch's.
    assert torch.equal(out["completion_ids"], batch["completion_ids"])
    assert torch.equal(out["old_per_token_logps"], batch["old_logps"])
    names = [f"sampling/sampling_logp_difference/{s}" for s in ("mean", "max")] + \
            [f"sampling/importance_sampling_ratio/{s}" for s in ("min", "mean", "max")]
    return out["importance_sampling_ratio"], {name: last_metric(trainer, name) for name in names}


def our_correction(batch, sampler, mode, clip_max, clip_min):
    weights = sampler_importance_weights(batch["old_logps"], sampler, batch["completion_mask"],
                                         mode=mode, clip_max=clip_max, clip_min=clip_min)
    metrics = sampler_correction_metrics(batch["old_logps"], sampler, weights,
                                         batch["completion_mask"], mode)
    return weights, metrics


@pytest.mark.parametrize("setting", IS_SETTINGS, ids=list(IS_SETTINGS))
def test_sampler_importance_weights_match_trl(trainer, batch, sampler_logps, setting):
    mode, clip_max, clip_min = IS_SETTINGS[setting]
    trl_weights, trl_metrics = trl_correction(trainer, batch, sampler_logps, mode, clip_max,
                                              clip_min)
    weights, metrics = our_correction(batch, sampler_logps, mode, clip_max, clip_min)
    assert weights.shape == trl_weights.shape == ((B, 1) if mode.startswith("sequence") else
                                                  batch["old_logps"].shape)
    torch.testing.assert_close(weights, trl_weights, atol=IS_TOL, rtol=0)
    assert metrics == pytest.approx(trl_metrics, abs=IS_TOL)
    # Not vacuous: the bounds bite on this batch (some weights clipped or zeroed, others kept).
    raw = torch.exp(sampler_log_ratio(batch["old_logps"], sampler_logps, batch["completion_mask"]))
    if mode.startswith("sequence"):
        raw = raw.prod(-1, keepdim=True)
    real = torch.ones_like(raw, dtype=torch.bool) if mode.startswith("sequence") else \
        batch["completion_mask"].bool()
    outside = torch.zeros_like(real)
    if clip_max is not None:
        outside |= raw > clip_max
    if clip_min is not None:
        outside |= raw < clip_min
    assert (outside & real).any() and (~outside & real).any()
    assert not torch.isnan(weights).any()
    if not mode.startswith("sequence"):  # no sampler logprob: no correction (weight 1), as TRL
        assert weights[NAN_TOKEN] == 1


@pytest.mark.parametrize("loss_type", core.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, BETA])
@pytest.mark.parametrize("setting", ["token_truncate", "token_mask-min", "sequence_truncate-min",
                                     "sequence_mask"])
def test_corrected_loss_matches_trl(trainer, model, batch, sampler_logps, loss_type, beta, setting):
    """TRL's `_compute_loss` with its own weights == grpo_lab's `grpo_loss(importance_weights=)`
    with grpo_lab's: loss, gradients and the clip/KL metrics."""
    mode, clip_max, clip_min = IS_SETTINGS[setting]
    trl_weights, _ = trl_correction(trainer, batch, sampler_logps, mode, clip_max, clip_min)
    weights, _ = our_correction(batch, sampler_logps, mode, clip_max, clip_min)
    eps = dict(epsilon_low=0.2, epsilon_high=0.28)
    inputs = dict(trl_inputs(batch, off_policy=True, beta=beta),
                  importance_sampling_ratio=trl_weights)
    with trl_vllm_flags(trainer), configured(trainer, loss_type=loss_type, beta=beta, **eps):
        trl_loss = trainer._compute_loss(model, inputs)
        logps = core.policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                     batch["completion_ids"], batch["completion_mask"], TEMPERATURE)
        ours, metrics = core.grpo_loss(
            logps, batch["old_logps"], batch["advantages"], batch["completion_mask"],
            loss_type=loss_type, beta=beta, ref_logps=batch["ref_logps"] if beta else None,
            max_completion_length=MAX_COMPLETION_LENGTH, importance_weights=weights, **eps)
        uncorrected, _ = core.grpo_loss(
            logps, batch["old_logps"], batch["advantages"], batch["completion_mask"],
            loss_type=loss_type, beta=beta, ref_logps=batch["ref_logps"] if beta else None,
            max_completion_length=MAX_COMPLETION_LENGTH, **eps)
        assert abs(trl_loss.item() - ours.item()) <= IS_TOL, (trl_loss.item(), ours.item())
        assert abs(trl_loss.item() - uncorrected.item()) > 100 * IS_TOL  # the weights matter
        trl_grads, our_grads = gradients(model, trl_loss), gradients(model, ours)
        for name in our_grads:  # float32 sums: within IS_GRAD_TOL of the largest entry
            scale = max(1.0, trl_grads[name].abs().max().item())
            torch.testing.assert_close(trl_grads[name], our_grads[name],
                                       atol=IS_GRAD_TOL * scale, rtol=0)
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert last_metric(trainer, name) == pytest.approx(metrics[name], abs=IS_TOL)
        if beta:
            assert last_metric(trainer, "kl") == pytest.approx(metrics["kl"], abs=IS_TOL)


@contextmanager
def trl_vllm_flags(trainer):
    """What `_compute_loss` reads to apply `inputs["importance_sampling_ratio"]`."""
    saved = trainer.use_vllm, trainer.vllm_importance_sampling_correction
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    try:
        yield trainer
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = saved


IS_ALTERATIONS = {  # name: (TRL's setting, grpo_lab's mode, clip_max, clip_min)
    "cap 2->3 (token_truncate)": ("token_truncate", ("token_truncate", 3.0, None)),
    "cap 2->3 (sequence_mask)": ("sequence_mask", ("sequence_mask", 3.0, None)),
    "clip_min dropped (token_mask)": ("token_mask-min", ("token_mask", 2.0, None)),
    "clip_min dropped (sequence_truncate)": ("sequence_truncate-min",
                                             ("sequence_truncate", 2.0, None)),
    "truncate->mask (token)": ("token_truncate", ("token_mask", 2.0, None)),
    "mask->truncate (sequence)": ("sequence_mask", ("sequence_truncate", 2.0, None)),
    "token->sequence (truncate)": ("token_truncate", ("sequence_truncate", 2.0, None)),
    "sequence->token (mask)": ("sequence_mask", ("token_mask", 2.0, None)),
}


@pytest.mark.parametrize("alteration", IS_ALTERATIONS, ids=list(IS_ALTERATIONS))
def test_altered_correction_does_not_match(trainer, model, batch, sampler_logps, alteration):
    """A wrong cap, bound or mode on grpo_lab's side changes the weights and the loss."""
    setting, (mode, clip_max, clip_min) = IS_ALTERATIONS[alteration]
    trl_weights, _ = trl_correction(trainer, batch, sampler_logps, *IS_SETTINGS[setting])
    weights, _ = our_correction(batch, sampler_logps, mode, clip_max, clip_min)
    inputs = dict(trl_inputs(batch, off_policy=True, beta=0.0),
                  importance_sampling_ratio=trl_weights)
    with trl_vllm_flags(trainer), configured(trainer, loss_type="grpo", beta=0.0), torch.no_grad():
        trl_loss = trainer._compute_loss(model, inputs)
        logps = core.policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                     batch["completion_ids"], batch["completion_mask"], TEMPERATURE)
        altered, _ = core.grpo_loss(logps, batch["old_logps"], batch["advantages"],
                                    batch["completion_mask"], epsilon_low=0.2, epsilon_high=0.28,
                                    importance_weights=weights)
    assert not torch.allclose(weights.expand_as(batch["old_logps"]),
                              trl_weights.expand_as(batch["old_logps"]), atol=1e-3)
    assert abs(trl_loss.item() - altered.item()) > 100 * IS_TOL, (alteration, trl_loss.item())


def test_trl_correction_config_names_and_defaults():
    """grpo_lab's options are TRL 1.16's GRPOConfig fields, with TRL's defaults."""
    # The fields' defaults, not an instance: building a TRLConfig resets accelerate's state,
    # which the module's trainer needs.
    trl = {name: f.default for name, f in TRLConfig.__dataclass_fields__.items()}
    ours = GRPOConfig()
    for name in ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                 "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
        assert getattr(ours, name) == trl[name], name
    assert (ours.vllm_importance_sampling_mode, ours.vllm_importance_sampling_clip_max) == \
        ("sequence_mask", 3.0)


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
    torch.testing.assert_close(out["advantages"], ours, atol=TOL, rtol=0)
    assert last_metric(trainer, "reward") == pytest.approx(rewards.mean().item(), abs=TOL)


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
        current = core.policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                       batch["completion_ids"], batch["completion_mask"],
                                       TEMPERATURE)
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
    assert abs(trl_loss - ours).item() > 100 * TOL  # off-policy: different values
    assert abs(trl_loss - corrected).item() <= TOL  # grpo_lab's option is TRL's term
    # At ratio 1: the same value ...
    assert abs(trl_on_policy - ours_on_policy).item() <= TOL
    # ... and not the same gradient, unless grpo_lab weighs by the ratio too.
    trl_grads = gradients(model, trl_on_policy)
    our_grads = gradients(model, ours_on_policy)
    corrected_grads = gradients(model, corrected_on_policy)
    gap = max((trl_grads[n] - our_grads[n]).abs().max().item() for n in our_grads)
    assert gap > 100 * TOL, gap
    for name in corrected_grads:
        torch.testing.assert_close(trl_grads[name], corrected_grads[name], atol=TOL, rtol=1e-4)
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
            ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
            mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
            trl_logps, _, _ = trainer._get_per_token_logps_and_entropies(
                model, ids, mask, batch["completion_ids"].shape[1])
            ours = core.policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                        batch["completion_ids"], batch["completion_mask"],
                                        TEMPERATURE)
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
    torch.testing.assert_close(trl_logps[real], ours[real], atol=TOL, rtol=0)


def test_difference_dr_grpo_constant(trainer, model, batch):
    """4. Without `max_completion_length`, grpo_loss's dr_grpo divides by the batch's width."""
    assert batch["completion_ids"].shape[1] == LONGEST_COMPLETION < MAX_COMPLETION_LENGTH
    eps = dict(epsilon_low=0.2, epsilon_high=0.28)
    with configured(trainer, loss_type="dr_grpo", beta=0.0, **eps), torch.no_grad():
        trl_loss = trainer._compute_loss(model, trl_inputs(batch, off_policy=True, beta=0.0))
        default, _ = grpo_lab_loss(model, batch, off_policy=True, beta=0.0, loss_type="dr_grpo",
                                   max_completion_length=None, **eps)
    assert default.item() == pytest.approx(
        trl_loss.item() * MAX_COMPLETION_LENGTH / LONGEST_COMPLETION, abs=TOL)


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
    assert abs(trl_total - ours).item() <= TOL
    # Each micro-batch alone is not grpo_lab's loss of that half: TRL divides by 2 (and dapo by
    # the whole batch's tokens).
    half, _ = grpo_lab_loss(model, {k: v[halves[0]] for k, v in batch.items()}, off_policy=True,
                            beta=BETA, loss_type=loss_type, **eps)
    assert abs(trl_losses[0] - half).item() > 100 * TOL
    trl_grads, our_grads = gradients(model, trl_total), gradients(model, ours)
    for name in our_grads:
        torch.testing.assert_close(trl_grads[name], our_grads[name], atol=TOL, rtol=1e-4)


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
    assert trl.max_completion_length == 512 and ours.max_new_tokens is None  # task + 2
    assert trl.activation_checkpointing is True  # was `gradient_checkpointing`
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

