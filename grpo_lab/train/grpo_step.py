"""One GRPO step, top to bottom (DeepSeekMath, Algorithm 1), as both trainers take it:

    sample      Stage 1  G completions per prompt, with the sampler's per-token logprobs
    score       Stage 2  every completion's reward (the weighted reward functions)
    to_batch    Stage 3  group-relative advantages; the step's padded tensors
    update      Stage 4  `num_iterations` clipped-surrogate updates over micro-batches:
                         the KL reference, pi_old from the first update's forward
                         (`ProximalLogprobs`, with the optional sampler correction), the
                         accumulated loss, the optimizer step, the step's metrics

grpo_lab.train.trainer.GRPOTrainer runs the four in a row. The asynchronous trainer's rollout
worker runs `score` after its generator; its trainer thread runs `to_batch` and `update` on the
groups it takes from the buffer. Each function takes the trainer (`trainer`) and reads its
`config`, models, optimizer and `processes` (the trainer processes under `accelerate launch`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch

from ..algo.grpo_loss import group_advantages
from ..algo.packing import accumulate_grpo_loss
from ..algo.sampler_correction import sampler_correction_metrics, sampler_importance_weights
from ..algo.shared_prompt import layout_micro_batches
from ..data.completions import Completions
from ..data.tasks import Problem
from ..model.generation import generate_completions
from ..rollout.groups import SampledGroups
from ..watch.flops import flops_per_token
from ..watch.step_metrics import layout_metrics
from .rollout_batch import RolloutBatch, zero_std_groups


def sample(trainer, problems: list[Problem]) -> SampledGroups:
    """Stages 1-2: G completions per problem from the policy itself, with their per-token
    logprobs, and their rewards."""
    trainer.model.eval()
    with autocast(trainer):
        out = generate_completions(
            trainer.model, trainer.tokenizer, [p.prompt for p in problems],
            max_new_tokens=trainer.max_completion_length,
            num_generations=trainer.config.num_generations,
            temperature=trainer.config.temperature, **trainer.prompt_format)
    trainer.model.train()
    rewards, parts = trainer.score(problems, out)
    return SampledGroups(problems, out, rewards, parts)


def score(trainer, problems: list[Problem], out: Completions
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Stage 2: (rewards, each reward function's scores), each (B,), for G completions per
    problem, prompt-major. Each reward function sees the answers, prompts and the dataset's other
    columns repeated G times."""
    G = trainer.config.num_generations
    answers = [p.answer for p in problems for _ in range(G)]
    prompts = [p.prompt for p in problems for _ in range(G)]
    columns = [p.columns for p in problems for _ in range(G)]
    return trainer.rewards.score(out.texts, answers, prompts,
                                 completion_ids=out.completion_ids, columns=columns)


def to_batch(trainer, sampled: SampledGroups) -> RolloutBatch:
    """Stage 3: group-relative advantages (each reward minus its group's mean, over the group's
    std when `scale_rewards`), and the step's padded tensors on the trainer's device."""
    advantages = group_advantages(sampled.rewards, trainer.config.num_generations,
                                  scale_by_std=trainer.config.scale_rewards)
    batch = RolloutBatch.from_completions(sampled.out, sampled.rewards, advantages,
                                          trainer.tokenizer.pad_token_id)
    return batch.to(trainer.device)


class ProximalLogprobs:
    """pi_old of one step's batch, collected micro-batch by micro-batch from the first update's
    forward (the `on_logprobs` hook of grpo_lab.algo.packing.accumulate_grpo_loss): before any
    update the policy *is* pi_old, so it costs no pass of its own. `logps` is (B, T), 0 where no
    micro-batch reaches.

    With `vllm_importance_sampling_correction` each micro-batch gets, before its loss, TRL's
    correction of the sampler/trainer mismatch: its ratio is taken against pi_old, and each
    token's surrogate is weighted by pi_old / pi_sampler, truncated or masked
    (`trainer.sampler_weights`). At staleness k the weights also carry the k versions' drift and
    the clip is around the current policy (AReaL's decoupled objective, Fu et al. 2025)."""

    def __init__(self, trainer, batch: RolloutBatch):
        self.trainer = trainer
        self.logps = torch.zeros_like(batch.old_logps)  # (B, T)

    def __call__(self, mb, logps: torch.Tensor) -> None:
        self.logps[torch.tensor(mb.indices), :logps.shape[1]] = logps
        if not self.trainer.config.vllm_importance_sampling_correction:
            return
        # mb.old_logps are the sampler's: (n, C) or (n, 1) weights pi_old / pi_sampler
        mb.importance_weights, _ = self.trainer.sampler_weights(logps, mb.old_logps,
                                                                mb.completion_mask)
        mb.old_logps = logps  # the ratio is against pi_old


def update(trainer, batch: RolloutBatch, *, before_each=None, **packing) -> dict[str, float]:
    """Stage 4: `num_iterations` clipped-surrogate updates on one batch, over micro-batches of at
    most `token_budget` forward tokens (one pass when None; `packing`: packed=True, row_tokens): the
    same loss and gradient either way. `before_each(mb)` runs before each training forward (the
    asynchronous trainer picks its thread count there). Returns the step's metrics, with the
    seconds of the optimizer steps as `perf/optimizer_s`."""
    cfg = trainer.config
    micro_batches = trainer.micro_batches(batch, cfg.token_budget, **packing)
    # The KL reference's logprobs (beta > 0), without gradients.
    ref_logps = reference_logprobs(trainer, micro_batches) if cfg.beta > 0 else None
    # pi_old: the first update's forward, before any change (and the correction with it).
    pi_old = ProximalLogprobs(trainer, batch)
    metrics: dict[str, float] = {}
    optimizer_s = 0.0
    for iteration in range(cfg.num_iterations):
        with autocast(trainer):  # one forward and backward over all micro-batches
            loss, metrics = accumulate_grpo_loss(
                trainer.train_model, micro_batches, temperature=cfg.temperature,
                loss_type=cfg.loss_type, epsilon_low=cfg.epsilon_low,
                epsilon_high=cfg.epsilon_high, beta=cfg.beta, ref_logps=ref_logps,
                max_completion_length=trainer.max_completion_length, before_each=before_each,
                on_logprobs=pi_old if iteration == 0 else None, processes=trainer.processes,
                use_bias_correction_kl=cfg.use_bias_correction_kl)
        start = time.perf_counter()
        metrics.update(loss=loss, grad_norm=trainer.apply_gradients())
        optimizer_s += time.perf_counter() - start
    # The sampler's metrics over the whole batch (this process's share, then every process's).
    sampler = trainer.sampler_metrics(batch, pi_old.logps)
    if sampler and trainer.processes.distributed:
        sampler = trainer.processes.combine_metrics(sampler, float(batch.completion_mask.sum()))
    if "kl" in sampler and "kl" in metrics:  # TRL-async's `kl` is the sampler's: beta's is ref_kl
        metrics["ref_kl"] = metrics.pop("kl")
    metrics.update(sampler)
    metrics["perf/optimizer_s"] = optimizer_s
    metrics["batch/microbatches_per_step"] = trainer.processes.passes(len(micro_batches))
    metrics.update(step_work(trainer, batch, micro_batches))  # every process's
    return metrics


# ---------------------------------------------------------------------- the update's parts

def micro_batches(trainer, batch: RolloutBatch, token_budget: int | None = None, **packing):
    """The batch laid out for forward passes: a row per group when the model shares each
    group's prompt (grpo_lab.algo.shared_prompt), else a row per sequence (or `packing`'s)."""
    cfg = trainer.config
    return layout_micro_batches(
        batch, token_budget, group_size=cfg.num_generations if trainer.share_prompts else None,
        max_row_tokens=cfg.shared_prompt_max_tokens, **packing)


def autocast(trainer):
    """bfloat16 autocast around forward passes when full fine-tuning keeps float32 master
    weights (`autocast_dtype`, as TRL's bf16=True); a no-op otherwise."""
    if trainer.autocast_dtype is None:
        return nullcontext()
    return torch.autocast(torch.device(trainer.device).type, dtype=trainer.autocast_dtype)


@contextmanager
def reference_model(trainer):
    """The model that scores the KL reference, without gradients: the frozen copy (full
    fine-tuning), or LoRA's base model with the adapter switched off."""
    with torch.no_grad():
        if trainer.ref_model is not None:
            yield trainer.ref_model
        else:
            with trainer.model.disable_adapter():
                yield trainer.model


def reference_logprobs(trainer, micro_batches: list) -> list[torch.Tensor]:
    """Each micro-batch's logprobs under the reference; under FSDP2 every process makes as many
    forward passes (each gathers the weights), repeating its first micro-batch if short."""
    processes, temperature = trainer.processes, trainer.config.temperature
    passes = processes.passes(len(micro_batches)) if processes.is_fsdp else 0
    with reference_model(trainer) as ref, autocast(trainer):
        logps = [mb.logprobs(ref, temperature) for mb in micro_batches]
        for _ in range(passes - len(micro_batches)):
            micro_batches[0].logprobs(ref, temperature)
    return logps


def apply_gradients(trainer) -> float:
    """Clip the gradients, set this step's learning rate, take the optimizer step; returns the
    gradient norm before clipping. The schedule is a function of `step_count`, so a resumed run
    needs no scheduler state."""
    params = [p for p in trainer.train_model.parameters() if p.requires_grad]
    grad_norm = trainer.processes.clip_grad_norm_(params, trainer.config.max_grad_norm)
    for group in trainer.optimizer.param_groups:
        group["lr"] = trainer.config.learning_rate_at(trainer.step_count)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)


def sampler_weights(config, old_logps: torch.Tensor, sampler_logps: torch.Tensor,
                    mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The importance weights pi_old / pi_sampler of the configured mode and cap, (B, T) or
    (B, 1), and TRL's `sampling/*` metrics of them (grpo_lab.algo.sampler_correction)."""
    mode = config.vllm_importance_sampling_mode
    weights = sampler_importance_weights(
        old_logps, sampler_logps, mask, mode=mode,
        clip_max=config.vllm_importance_sampling_clip_max,
        clip_min=config.vllm_importance_sampling_clip_min)
    return weights, sampler_correction_metrics(old_logps, sampler_logps, weights, mask, mode)


def step_work(trainer, batch: RolloutBatch, micro_batches: list) -> dict[str, float]:
    """The step's layout metrics (grpo_lab.watch.step_metrics, a collective), keeping the model
    FLOPs of its passes for the trainer's `throughput`: every training pass (num_iterations) over
    the unpadded tokens, and the reference's no-grad forward (beta > 0), a third of one."""
    cfg = trainer.config
    metrics, (tokens, sequences) = layout_metrics(batch, micro_batches, cfg.token_budget,
                                                  trainer.processes)
    per_token = flops_per_token(trainer.model.config, tokens // max(sequences, 1))
    passes = cfg.num_iterations + (1 / 3 if cfg.beta > 0 else 0)
    trainer._step_flops = per_token * tokens * passes if per_token else None
    return metrics


# ------------------------------------------------------------ DAPO's dynamic sampling
# DAPO's dynamic sampling (Yu et al. 2025, section 3.2): train only on groups that carry a signal.
#
# A group whose G rewards are all equal has advantage 0 on every completion: it adds nothing to
# the gradient but takes a place in the batch. Rounds of fresh prompts are generated until
# `prompts_per_step` groups with a signal are held, or `dynamic_sampling_max_rounds` is reached;
# the extra generation is logged as `dynamic_sampling/*` (docs/internals.md, "Dynamic sampling").


def sample_with_signal(
    sample: Callable[[list[Problem]], SampledGroups],
    draw: Callable[[int], list[Problem]],
    problems: list[Problem],
    group_size: int,
    max_rounds: int,
) -> tuple[SampledGroups, dict[str, float]]:
    """`len(problems)` groups, those whose rewards differ first; returns them and the metrics.

    `sample` generates and scores G completions per problem (Stages 1-2), `draw(n)` gives n fresh
    problems for the next round, `problems` are the first round's.
    """
    want = len(problems)
    kept: list[SampledGroups] = []
    rounds = generated = zero_std = have = 0
    while True:
        batch = sample(problems)
        flat = zero_std_groups(batch.rewards, group_size).tolist()  # (len(problems),)
        rounds, generated, zero_std = rounds + 1, generated + len(flat), zero_std + sum(flat)
        kept.append(batch.groups([k for k, no_signal in enumerate(flat) if not no_signal]))
        have += len(kept[-1].problems)
        if have >= want or rounds >= max_rounds:
            break
        # Enough to fill the batch if the next groups are kept as often as these were.
        problems = draw(min(want, math.ceil((want - have) * generated / have)) if have else want)
    chosen = SampledGroups.concat(kept).groups(list(range(min(have, want))))
    filled = want - len(chosen.problems)  # the cap was hit: the last round's zero-signal groups
    if filled:
        chosen = SampledGroups.concat(
            [chosen, batch.groups([k for k, no_signal in enumerate(flat) if no_signal][:filled])])
    return chosen, {
        "dynamic_sampling/rounds": rounds,
        "dynamic_sampling/generated_groups": generated,
        "dynamic_sampling/zero_std_groups": zero_std,
        "dynamic_sampling/dropped_groups": zero_std - filled,
    }
