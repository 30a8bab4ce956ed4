"""DAPO's dynamic sampling (grpo_lab.train.grpo_step): which groups a step trains on, what
it costs, and the sync trainer with it on."""

import random

import pytest
import torch

from grpo_lab.data.completions import Completions
from grpo_lab.data.tasks import Problem
from grpo_lab.rollout.groups import SampledGroups
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.grpo_step import sample_with_signal
from grpo_lab.train.rollout_batch import zero_std_groups
from grpo_lab.train.trainer import GRPOTrainer

G = 3


def fake_sample(problems):
    """G completions per problem named after it; rewards all equal when the answer is "same"."""
    texts = [f"{p.prompt}/{j}" for p in problems for j in range(G)]
    rewards = torch.tensor([float(j == 0 or p.answer == "same") for p in problems
                            for j in range(G)])
    out = Completions([[1]] * len(texts), [[5, 2]] * len(texts), [[-0.1, -0.2]] * len(texts),
                      texts, ["stop"] * len(texts))
    return SampledGroups(list(problems), out, rewards, {"exact_match": rewards.clone()})


def rounds_of(first, *later):
    """The first round's problems and a `draw(n)` that takes the next n answers of `later`;
    problems are named r<round>p<index>, and `draw.counts` keeps each n asked for."""
    stream = iter(later)

    def draw(n):
        draw.counts.append(n)
        return [Problem(f"r{len(draw.counts)}p{i}", next(stream)) for i in range(n)]

    draw.counts = []
    return [Problem(f"r0p{i}", a) for i, a in enumerate(first)], draw


def test_zero_std_groups_flags_groups_whose_rewards_are_all_equal():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.2, 0.2, 0.2])
    assert zero_std_groups(rewards, 3).tolist() == [True, False, True]


def test_a_batch_with_signal_everywhere_costs_one_round():
    first, draw = rounds_of(["diff", "diff"])
    chosen, metrics = sample_with_signal(fake_sample, draw, first, G, max_rounds=3)
    assert [p.prompt for p in chosen.problems] == ["r0p0", "r0p1"]
    assert metrics == {"dynamic_sampling/rounds": 1, "dynamic_sampling/generated_groups": 2,
                       "dynamic_sampling/zero_std_groups": 0, "dynamic_sampling/dropped_groups": 0}


def test_zero_signal_groups_are_replaced_by_later_rounds_and_the_surplus_dropped():
    first, draw = rounds_of(["same", "diff", "same", "same"],
                            "diff", "same", "same", "same", "same", "diff", "diff", "diff")
    chosen, metrics = sample_with_signal(fake_sample, draw, first, G, max_rounds=5)
    # 1 kept in 4: the 3 missing call for 12 prompts, at most a step's 4; then 2 in 8: 8, so 4.
    assert draw.counts == [4, 4]
    # Kept in the order they came; round 2 had three with signal, one was needed: two dropped.
    assert [p.prompt for p in chosen.problems] == ["r0p1", "r1p0", "r2p1", "r2p2"]
    assert not zero_std_groups(chosen.rewards, G).any()
    # Each group's completions, rewards and reward parts are its own problem's.
    assert chosen.out.texts == [f"{p.prompt}/{j}" for p in chosen.problems for j in range(G)]
    assert chosen.rewards.tolist() == [1.0, 0.0, 0.0] * 4
    assert torch.equal(chosen.parts["exact_match"], chosen.rewards)
    assert metrics == {"dynamic_sampling/rounds": 3, "dynamic_sampling/generated_groups": 12,
                       "dynamic_sampling/zero_std_groups": 7, "dynamic_sampling/dropped_groups": 7}


def test_a_round_draws_the_missing_groups_over_the_share_kept_so_far():
    first, draw = rounds_of(["diff", "diff", "same", "diff"], "same", "diff")
    chosen, metrics = sample_with_signal(fake_sample, draw, first, G, max_rounds=5)
    assert draw.counts == [2]  # 1 missing, 3 of 4 kept so far: ceil(1 / 0.75) = 2
    assert [p.prompt for p in chosen.problems] == ["r0p0", "r0p1", "r0p3", "r1p1"]
    assert metrics == {"dynamic_sampling/rounds": 2, "dynamic_sampling/generated_groups": 6,
                       "dynamic_sampling/zero_std_groups": 2, "dynamic_sampling/dropped_groups": 2}


def test_at_the_round_cap_the_last_rounds_zero_signal_groups_fill_the_batch():
    first, draw = rounds_of(["same", "diff", "same"], "same", "same", "same")
    chosen, metrics = sample_with_signal(fake_sample, draw, first, G, max_rounds=2)
    assert draw.counts == [3]
    assert [p.prompt for p in chosen.problems] == ["r0p1", "r1p0", "r1p1"]
    assert zero_std_groups(chosen.rewards, G).tolist() == [False, True, True]
    assert metrics == {"dynamic_sampling/rounds": 2, "dynamic_sampling/generated_groups": 6,
                       "dynamic_sampling/zero_std_groups": 5, "dynamic_sampling/dropped_groups": 3}


def test_the_options_are_validated_and_the_async_trainers_refuse_it():
    with pytest.raises(ValueError, match="dynamic_sampling_max_rounds must be >= 1"):
        GRPOConfig(dynamic_sampling=True, dynamic_sampling_max_rounds=0)
    with pytest.raises(ValueError, match="synchronous GRPOTrainer only"):
        AsyncGRPOConfig(dynamic_sampling=True)


SMALL = dict(steps=1, prompts_per_step=4, num_generations=4, eval_every=0, eval_size=4,
             progress=False, log_completions_every=0, max_completion_length=5)


# Exact match on prompts whose answer is even; 0 for every completion of the others: a group
# without signal by construction, whatever the model samples on this machine.
EVEN_ANSWERS_ONLY = """
from grpo_lab.data.rewards import exact_match_reward


def reward(completions, answer, **kwargs):
    matches = exact_match_reward(completions, answer)
    return [m if int(a) % 2 == 0 else 0.0 for m, a in zip(matches, answer)]
"""


def test_the_trainer_trains_only_on_groups_with_signal(tiny_model_dir, tmp_path, monkeypatch):
    """Groups without signal are replaced by later rounds' and the step logs what that cost, each
    name in the glossary. Not left to chance (the tiny model, right about a third of the time,
    leaves all 4 groups of 4 with signal in ~40 % of steps): the reward scores only prompts with
    an even answer, and 3 of the seed's first 4 have odd ones (prompts come from Python's seeded
    `random`, the same on every machine); the model's exact matches give the even ones signal."""
    from grpo_lab.data.tasks import AdditionTask
    from grpo_lab.watch.metric_names import unknown_metrics

    (tmp_path / "even_answers_only.py").write_text(EVEN_ANSWERS_ONLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    first = AdditionTask(eval_size=4).sample_batch(random.Random(1), SMALL["prompts_per_step"])
    odd = sum(int(p.answer) % 2 for p in first)
    assert odd == 3, [p.answer for p in first]  # what the trainer's first round draws (seed 1)
    settings = dict(model=str(tiny_model_dir), reward="even_answers_only:reward", seed=1, **SMALL)
    trainer = GRPOTrainer(GRPOConfig(dynamic_sampling=True, dynamic_sampling_max_rounds=20,
                                     **settings))
    plain = GRPOTrainer(GRPOConfig(**settings))
    before = plain.step()
    record = trainer.step()
    assert before["frac_reward_zero_std"] >= odd / 4  # without it, the same first prompts
    assert record["frac_reward_zero_std"] == 0
    rounds = record["dynamic_sampling/rounds"]
    assert 2 <= rounds < 20
    assert 4 < record["dynamic_sampling/generated_groups"] <= 4 * rounds
    assert record["dynamic_sampling/dropped_groups"] == record["dynamic_sampling/zero_std_groups"]
    assert record["dynamic_sampling/zero_std_groups"] >= 4 * before["frac_reward_zero_std"]
    assert unknown_metrics(record) == []


def test_a_constant_reward_hits_the_cap_and_still_trains_a_full_batch(tiny_model_dir, tmp_path,
                                                                        monkeypatch):
    (tmp_path / "always_one.py").write_text(
        "def reward(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = GRPOConfig(model=str(tiny_model_dir), dynamic_sampling=True,
                     dynamic_sampling_max_rounds=3, reward="always_one:reward", **SMALL)
    record = GRPOTrainer(cfg).step()
    assert record["dynamic_sampling/rounds"] == 3
    assert record["dynamic_sampling/generated_groups"] == 12
    assert record["dynamic_sampling/zero_std_groups"] == 12
    assert record["dynamic_sampling/dropped_groups"] == 8  # 4 filled the batch
    assert record["frac_reward_zero_std"] == 1.0 and record["reward"] == 1.0
