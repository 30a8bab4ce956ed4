"""Rewards as researchers pass them (issue 33, item 4): functions with TRL's signature beside
built-in names, called with every keyword TRL offers, and saved in config.json by reference."""

from __future__ import annotations

import json
import textwrap

import pytest

from grpo_lab.core.config import GRPOConfig
from grpo_lab.core.datasets import load_dataset_task
from grpo_lab.core.reward_set import NOT_IMPORTABLE, RewardSet
from grpo_lab.core.rewards import exact_match_reward, format_reward
from grpo_lab.core.tasks import Problem, with_few_shot
from grpo_lab.rollout.trl_data import WeightedReward


def trl_length_reward(prompts, completions, completion_ids, **kwargs):
    """TRL's signature: everything by keyword; reads a dataset column from kwargs."""
    return [len(ids) / 10 + kwargs["bonus"][i] for i, ids in enumerate(completion_ids)]


def prompt_echo(prompts, completions, **kwargs):
    return [float(c.startswith(p)) for p, c in zip(prompts, completions)]


def test_a_trl_signature_reward_gets_prompts_ids_answer_and_dataset_columns():
    seen = {}

    def spy(**kwargs):
        seen.update(kwargs)
        return [0.0] * len(kwargs["completions"])

    rewards = RewardSet.from_specs([trl_length_reward, spy])
    assert rewards.names == ["trl_length_reward", "spy"]  # a function is named by __name__
    total, parts = rewards.score(["052", "05"], ["052", "052"], ["07+45="] * 2,
                                 completion_ids=[[1, 2, 3], [1, 2]],
                                 columns=[{"bonus": 1.0, "level": 3}] * 2)
    assert parts["trl_length_reward"].tolist() == pytest.approx([1.3, 1.2])
    assert total.tolist() == pytest.approx([1.3, 1.2])
    assert set(seen) == {"prompts", "completions", "completion_ids", "answer", "bonus", "level"}
    assert seen["prompts"] == ["07+45="] * 2 and seen["answer"] == ["052", "052"]
    assert seen["level"] == [3, 3]  # one value per completion, as TRL repeats its columns


def test_a_mixed_list_of_names_and_functions_with_weights():
    rewards = RewardSet.from_specs(["exact_match", prompt_echo, "format"], [1.0, 0.5, 0.25])
    assert rewards.names == ["exact_match", "prompt_echo", "format"]
    assert rewards.functions == [exact_match_reward, prompt_echo, format_reward]
    total, parts = rewards.score(["1+1=2", "#### 3"], ["1+1=2", "3"], ["1+1=", "1+2="])
    assert parts["prompt_echo"].tolist() == [1.0, 0.0]
    assert total.tolist() == pytest.approx([1 + 0.5, 0.25])
    # `parse` takes what the config's `reward` holds: a string, a function, or a list.
    assert RewardSet.parse(prompt_echo).names == ["prompt_echo"]
    assert RewardSet.parse(["format", prompt_echo], "1,2").weights == [1.0, 2.0]
    with pytest.raises(ValueError, match="names a reward twice"):
        RewardSet.from_specs([prompt_echo, prompt_echo])
    with pytest.raises(ValueError, match="has 1 weights for 2 rewards"):
        RewardSet.from_specs(["format", prompt_echo], [1.0])


def test_a_reward_whose_signature_does_not_fit_gets_a_clear_error():
    def needs_solution(completions, solution, **kwargs):  # a column the data may not have
        return [float(c == s) for c, s in zip(completions, solution)]

    rewards = RewardSet.from_specs([needs_solution])
    with pytest.raises(ValueError, match=r"reward 'needs_solution' cannot be called with the "
                                         r"keywords it is offered \(prompts, completions, "
                                         r"answer\)"):
        rewards.score(["a"], ["a"])
    # With the column in the dataset, the same function works (columns are keywords).
    total, _ = rewards.score(["a"], ["a"], columns=[{"solution": "a"}])
    assert total.tolist() == [1.0]

    def broken(completions, **kwargs):  # a TypeError inside a reward is the reward's own bug
        return [len(c) + "x" for c in completions]

    with pytest.raises(TypeError, match="unsupported operand"):
        RewardSet.from_specs([broken]).score(["a"], ["a"])


def test_evaluation_calls_a_trl_signature_first_reward_by_keyword():
    def correct(prompts, completions, answer, **kwargs):
        return [None if c == "skip" else float(c == a) for c, a in zip(completions, answer)]

    fn = RewardSet.from_specs([correct, "format"]).correctness
    # grpo_lab.core.evaluation calls `reward_fn(texts, answer=...)`; None reads as unsolved.
    assert fn(["3", "4", "skip"], answer=["3", "3", "3"]) == [1.0, 0.0, 0.0]
    only_keywords = RewardSet.from_specs([lambda **kw: [1.0] * len(kw["completions"])])
    assert only_keywords.correctness(["a"], answer=["a"]) == [1.0]
    builtin = RewardSet.parse("math_answer,format")
    assert builtin.correctness is builtin.functions[0]  # completions first: called as before


def test_trl_job_rewards_pass_completions_by_keyword():
    weighted = WeightedReward("prompt_echo", prompt_echo, 2.0)
    assert weighted(completions=["ab", "b"], prompts=["a", "a"], trainer_state=None) == [2.0, 0.0]


def test_config_takes_functions_and_saves_them_by_reference(tmp_path, monkeypatch):
    (tmp_path / "my_trl_rewards.py").write_text(textwrap.dedent("""
        def short(completions, **kwargs):
            return [-len(c) / 10 for c in completions]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    from my_trl_rewards import short

    config = GRPOConfig(reward=[short, "format"], reward_weights=[1.0, 0.5])
    config.save(tmp_path / "config.json")
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["reward"] == ["my_trl_rewards:short", "format"]
    assert saved["reward_weights"] == [1.0, 0.5]
    loaded = GRPOConfig.from_dict(saved)
    rewards = RewardSet.parse(loaded.reward, loaded.reward_weights)
    assert rewards.functions == [short, format_reward] and rewards.weights == [1.0, 0.5]
    assert GRPOConfig(reward=exact_match_reward).to_dict()["reward"] == "exact_match"

    # A lambda (or a notebook's function) cannot be imported back: its name and a note.
    config = GRPOConfig(reward=lambda completions, **kw: [0.0] * len(completions))
    assert config.to_dict()["reward"] == "<lambda>" + NOT_IMPORTABLE
    with pytest.raises(ValueError, match="pass the function itself"):
        GRPOConfig.from_dict(config.to_dict())
    with pytest.raises(ValueError, match="give a name, `module:function` or a function"):
        GRPOConfig(reward=[3])


def test_dataset_problems_carry_their_other_columns(tmp_path):
    rows = [{"question": f"{a}+1=", "answer": str(a + 1), "level": a % 3, "source": "toy"}
            for a in range(20)]
    path = tmp_path / "toy.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = load_dataset_task(path, eval_size=4)
    problem = task.train_set()[0]
    assert set(problem.columns) == {"answer", "level", "source"}  # all but the prompt's
    assert problem == Problem(problem.prompt, problem.answer)  # a problem is prompt + answer
    prefixed = with_few_shot(task, 1).sample(__import__("random").Random(0))
    assert set(prefixed.columns) == {"answer", "level", "source"}
    total, _ = RewardSet.from_specs([lambda completions, level, **kw: level]).score(
        ["x"], [problem.answer], columns=[problem.columns])
    assert total.tolist() == [float(problem.columns["level"])]
