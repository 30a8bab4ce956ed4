"""What the TRL parity tests share (test_trl_parity_loss.py, test_trl_parity_sampler.py): one TRL
`GRPOTrainer` on the tiny model, one synthetic batch, a loss from each library, and the float32
tolerances of what they compare (tests/float_tolerance.py has the rule).

The trainer, model and batch are built by functions here; each test module wraps them in its
own module-scoped fixtures.
"""

from __future__ import annotations

import dataclasses
import random
from contextlib import contextmanager

import torch
from datasets import Dataset
from float_tolerance import f32_atol, logprob_atol, mean_atol
from peft import LoraConfig
from trl import GRPOConfig as TRLConfig
from trl import GRPOTrainer as TRLTrainer

from grpo_lab.algo import grpo_loss as core
from grpo_lab.algo import logprobs
from grpo_lab.data.rewards import exact_match_reward
from grpo_lab.data.tasks import AdditionTask
from grpo_lab.model.models import load_model_and_tokenizer
from grpo_lab.train.rollout_batch import pad_left, pad_right

G = 4  # completions per prompt
NUM_PROMPTS = 4
B = NUM_PROMPTS * G  # one generation batch = one TRL micro-batch
MAX_COMPLETION_LENGTH = 5  # the task's answer (3 chars) + 2, as grpo_lab's trainer sets it
LONGEST_COMPLETION = 4  # batch width < MAX_COMPLETION_LENGTH, so dr_grpo's constant matters
TEMPERATURE = 0.8  # != 1, so both sides must divide the logits by it
EPSILONS = [(0.2, 0.2), (0.2, 0.28)]  # (low, high): symmetric, and DAPO's clip-higher
BETA = 0.1
LORA = dict(r=1, lora_alpha=2, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
# A wrong result must miss by this many tolerances (the negative cases), a right one stay inside.
MISS = 100


CHECKPOINTING = ("activation_checkpointing"
                 if "activation_checkpointing" in {f.name for f in dataclasses.fields(TRLConfig)}
                 else "gradient_checkpointing")
"""The field's name in TRL's config: transformers 5.23 renamed `gradient_checkpointing`, and
grpo_lab's floor (5.5.3) has the old name only."""


def trl_args(output_dir, **overrides) -> TRLConfig:
    """TRL's GRPOConfig shrunk for the tiny model on a CPU (its defaults suit 7B models on GPUs)."""
    values = dict(
        output_dir=str(output_dir),
        use_cpu=True,  # TRL raises on a CPU-only machine without it
        bf16=False,  # use_cpu alone leaves bf16 on
        report_to="none",
        save_strategy="no",
        # TRL's default True only slows 1M params
        **{CHECKPOINTING: False},
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
# What the fixtures build: one TRL trainer, one synthetic batch


@contextmanager
def single_torch_thread():
    """One thread: the tiny model gains nothing from two, and two threads in each of two busy
    processes on a 2-core machine ran every call ~100x slower (shared/docs/tiny-model.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_trainer(model_dir, output_dir) -> TRLTrainer:
    """TRL's GRPOTrainer on a fresh copy of a model (the tiny one, or SmolLM2-135M-Instruct for
    the real vocabulary); TRL patches and wraps it."""
    model, tokenizer = load_model_and_tokenizer(model_dir)
    trainer = TRLTrainer(
        model=model,
        reward_funcs=exact_match_reward,
        args=trl_args(output_dir, loss_type="grpo", epsilon=0.2, epsilon_high=0.28,
                      use_bias_correction_kl=False),
        train_dataset=addition_dataset(32),
        processing_class=tokenizer,
        peft_config=LoraConfig(**LORA),
    )
    # TRL's training loop sets this before every optimizer step; with gradient_accumulation_steps=1
    # it is 1. `_compute_loss` divides by it.
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()  # "train" mode: TRL's normalisers for training, not evaluation
    return trainer


def randomised_lora(trainer, scale: float = 0.3):
    """The peft model, with LoRA B randomised (`scale` x a standard normal) so the adapter (and
    so the KL to the base) is not 0."""
    peft_model = trainer.model
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(scale * torch.randn(param.shape, generator=generator))
    return peft_model


def make_batch(trainer, model) -> dict:
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
        current = logprobs.policy_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                       completion_mask, TEMPERATURE)
        with model.disable_adapter():  # LoRA's reference: the base model, as in both trainers
            ref_logps = logprobs.policy_logprobs(model, prompt_ids, prompt_mask, completion_ids,
                                             completion_mask, TEMPERATURE)
    # "Old" logprobs as after a few updates: about +-0.4 (1 sigma) around the current ones, so both
    # clip branches fire. Zero on padding, as TRL pads them.
    old_logps = (current + 0.4 * torch.randn(current.shape, generator=generator)) * completion_mask
    # `current_logps` only sizes the tolerances (`loss_terms`); the losses compute their own.
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, rewards=rewards, advantages=advantages,
                old_logps=old_logps, ref_logps=ref_logps, current_logps=current)


# ---------------------------------------------------------------------------------------------
# One loss from each library


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


def trl_logprobs(trainer, model, batch) -> torch.Tensor:
    """TRL's per-token logprobs of the batch's completions (its fused LM head)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, mask,
                                                             batch["completion_ids"].shape[1])
    return logps


def our_logprobs(model, batch) -> torch.Tensor:
    return logprobs.policy_logprobs(model, batch["prompt_ids"], batch["prompt_mask"],
                                batch["completion_ids"], batch["completion_mask"], TEMPERATURE)


def grpo_lab_loss(model, batch, *, off_policy: bool, beta: float, loss_type: str,
                  epsilon_low: float, epsilon_high: float,
                  max_completion_length=MAX_COMPLETION_LENGTH,
                  use_bias_correction_kl: bool = False):
    logps = our_logprobs(model, batch)
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
# Tolerances (tests/float_tolerance.py): sizes and counts of what each comparison sums


def real_tokens(batch) -> int:
    """Completion tokens: the terms of a loss or metric averaged over tokens."""
    return int(batch["completion_mask"].sum())


def positions(batch) -> int:
    """Real prompt and completion positions: the terms every LoRA gradient entry sums."""
    return int(batch["prompt_mask"].sum() + batch["completion_mask"].sum())


def token_ratios(batch, off_policy: bool) -> torch.Tensor:
    """pi_theta / pi_old per token, (B, T) (1 at ratio 1)."""
    if not off_policy:
        return torch.ones_like(batch["current_logps"])
    return (batch["current_logps"] - batch["old_logps"]).exp()


def kl_terms(batch, *, off_policy: bool = False, bias_correction: bool = False) -> torch.Tensor:
    """The per-token k3 KL to the reference on the real tokens, times the ratio with TRL's bias
    correction: the terms the `kl` metric averages."""
    real = batch["completion_mask"].bool()
    k3 = core.k3_kl(batch["current_logps"], batch["ref_logps"])
    return (k3 * token_ratios(batch, off_policy and bias_correction))[real]


def loss_terms(batch, *, off_policy: bool, beta: float, weights=None,
               bias_correction: bool = False) -> torch.Tensor:
    """The size of the per-token terms a GRPO loss averages, on the real tokens: |advantage| x
    ratio (x importance weight), plus beta x k3 (x ratio). Not the loss itself: advantages
    average 0 in each group, so a loss can be ~0 and still carry its terms' rounding."""
    mask = batch["completion_mask"]
    weight = 1.0 if weights is None else weights.expand_as(mask)
    terms = batch["advantages"].abs().unsqueeze(1) * token_ratios(batch, off_policy) * weight
    terms = terms[mask.bool()]
    if beta:
        terms = terms + beta * kl_terms(batch, off_policy=off_policy,
                                        bias_correction=bias_correction)
    return terms


def loss_atol(batch, *, off_policy: bool, beta: float, weights=None,
              bias_correction: bool = False) -> float:
    """A GRPO loss on `batch` from two code paths (TRL's and grpo_lab's)."""
    return mean_atol(loss_terms(batch, off_policy=off_policy, beta=beta, weights=weights,
                                bias_correction=bias_correction))


def kl_atol(batch, *, off_policy: bool = False, bias_correction: bool = False) -> float:
    """The `kl` metric from two code paths."""
    return mean_atol(kl_terms(batch, off_policy=off_policy, bias_correction=bias_correction))


def fraction_atol(batch) -> float:
    """A clip fraction (count / tokens, at most 1): far below one token's 1 / tokens."""
    return f32_atol(1.0, real_tokens(batch))


def batch_logprob_atol(batch, vocab_size: int, hidden_size: int | None = None) -> float:
    """Per-token logprobs of the batch's completions, by TRL's forward and grpo_lab's."""
    return logprob_atol(batch["current_logps"][batch["completion_mask"].bool()], vocab_size,
                        hidden_size=hidden_size)
