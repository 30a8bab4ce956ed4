"""One GRPO step for both trainers (grpo_lab.train.grpo_step): the synchronous and the
asynchronous trainer, given the same weights and the same batch, take the same update through
the one pi_old path, and the stage-3 advantages do not depend on how a step's groups were
sampled (one call, or one group at a time from the buffer)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from grpo_lab.model.models import load_model_and_tokenizer
from grpo_lab.rollout.groups import SampledGroups
from grpo_lab.train import grpo_step
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.async_trainer import AsyncGRPOTrainer
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.trainer import GRPOTrainer

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(steps=1, prompts_per_step=3, num_generations=4, eval_size=4, eval_every=0,
             progress=False, log_every=100, num_iterations=2, seed=5)


def trainers(model_dir, **settings):
    sync = GRPOTrainer(GRPOConfig(model=str(model_dir), **SMALL, **settings))
    model, tokenizer = load_model_and_tokenizer(model_dir)
    asynchronous = AsyncGRPOTrainer(
        AsyncGRPOConfig(**SMALL, **settings, asynchronous=False, trainer_threads=1,
                        generator_threads=1), model=model, tokenizer=tokenizer)
    return sync, asynchronous


@pytest.mark.timeout(300)
@pytest.mark.parametrize("settings", [
    dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="token_truncate",
         vllm_importance_sampling_clip_max=1.05, token_budget=48),
    dict(vllm_importance_sampling_correction=True, vllm_importance_sampling_mode="sequence_mask",
         vllm_importance_sampling_clip_max=1.05, beta=0.1),
    dict(vllm_importance_sampling_correction=False, token_budget=48),
], ids=["token_truncate", "sequence_mask+beta", "off"])
def test_both_trainers_take_the_same_update_of_one_batch(tiny_model_dir, settings):
    sync, asynchronous = trainers(tiny_model_dir, **settings)
    for a, b in zip(sync.model.parameters(), asynchronous.model.parameters()):
        assert torch.equal(a, b)  # the same weights to start from
    batch, _, _ = sync.make_batch(sync.task.sample_batch(sync.rng, SMALL["prompts_per_step"]))
    # A sampler in another precision: its logprobs 0.1 nat off, down in even rows, up in odd.
    shift = torch.tensor([-0.1 if i % 2 == 0 else 0.1 for i in range(len(batch.rewards))])
    batch = dataclasses.replace(batch, old_logps=batch.old_logps
                                + shift.unsqueeze(1) * batch.completion_mask)
    copy = dataclasses.replace(batch)  # each trainer gets its own micro-batches of one batch
    sync_metrics, async_metrics = sync.optimize(batch), asynchronous.optimize(copy)

    for a, b in zip(sync.model.parameters(), asynchronous.model.parameters()):
        assert torch.equal(a, b)
    if settings["vllm_importance_sampling_correction"]:
        # the weights bite: some are below 1 (capped or masked)
        assert sync_metrics["sampling/importance_sampling_ratio/min"] < 1.0
    # The same numbers; the asynchronous trainer adds TRL-async's `kl` (the sampler's), and
    # beta's reference KL is then its `ref_kl`.
    renamed = {("ref_kl" if k == "kl" else k): v for k, v in sync_metrics.items()}
    for key, value in renamed.items():
        if not key.startswith("perf/"):
            assert async_metrics[key] == value, key
    assert async_metrics["kl"] > 1e-3


@pytest.mark.timeout(300)
def test_advantages_of_a_step_do_not_depend_on_how_its_groups_came(tiny_model_dir):
    trainer = GRPOTrainer(GRPOConfig(model=str(tiny_model_dir), **SMALL))
    sampled = trainer.sample(trainer.task.sample_batch(trainer.rng, SMALL["prompts_per_step"]))
    whole = grpo_step.to_batch(trainer, sampled)
    one_by_one = grpo_step.to_batch(trainer, SampledGroups.concat(sampled.per_problem()))
    for field in dataclasses.fields(whole):
        assert torch.equal(getattr(whole, field.name), getattr(one_by_one, field.name))
    assert whole.advantages.abs().sum() > 0  # some group has a signal (the seed is chosen)
