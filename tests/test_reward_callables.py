"""Rewards as researchers pass them (issue 33, item 4): functions with TRL's signature beside
built-in names, called with every keyword TRL offers, and saved in config.json by reference."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest

from grpo_lab.data.datasets import load_dataset_task
from grpo_lab.data.reward_set import NOT_IMPORTABLE, RewardSet
from grpo_lab.data.rewards import exact_match_reward, format_reward
from grpo_lab.data.tasks import Problem, with_few_shot
from grpo_lab.train.config import GRPOConfig
from grpo_lab.trl.async_trainer import WeightedReward


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
                                         r"completion_ids, answer\)"):
        rewards.score(["a"], ["a"])
    # With the column in the dataset, the same function works (columns are keywords).
    total, _ = rewards.score(["a"], ["a"], columns=[{"solution": "a"}])
    assert total.tolist() == [1.0]

    def broken(completions, **kwargs):  # a TypeError inside a reward is the reward's own bug
        return [len(c) + "x" for c in completions]

    with pytest.raises(TypeError, match="unsupported operand"):
        RewardSet.from_specs([broken]).score(["a"], ["a"])


def unit_reward(completions, **kwargs):
    """Written as grpo_lab's own error message advises: reads an extra dataset column."""
    return [float(c.strip() == f"{a}") if u == "plain" else 0.0
            for c, a, u in zip(completions, kwargs["answer"], kwargs["unit"])]


def test_evaluation_calls_its_reward_as_training_does(tmp_path, tiny_model_dir):
    """The held-out evaluation offers its reward every keyword and column training does: a
    TRL-style reward reading an extra column evaluates (it died with KeyError: 'unit')."""
    problems = [Problem("3+4=", "7", {"unit": "plain"}), Problem("1+1=", "2", {"unit": "x"})]
    rewards = RewardSet.parse([unit_reward, "format"])
    assert rewards.correctness_scores(["7", "2"], problems, [[5], [6]]) == [1.0, 0.0]
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "unit": "plain"}
            for a in range(10, 40) for b in range(10, 14)]
    data = tmp_path / "sums.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    from grpo_lab.train.trainer import GRPOTrainer

    trainer = GRPOTrainer(GRPOConfig(dataset=str(data), reward=unit_reward, eval_size=8,
                                     max_completion_length=8, progress=False))
    assert 0.0 <= trainer.evaluate() <= 1.0
    assert len(trainer.eval_answers[0]) == 8  # the greedy replies, kept by step


def test_a_reward_that_returns_the_wrong_thing_is_named():
    def none(completions, **kwargs):
        return None

    def as_dict(completions, **kwargs):
        return {"score": [1.0] * len(completions)}

    def words(completions, **kwargs):
        return ["good" for _ in completions]

    def nan(completions, **kwargs):
        return [float("nan"), 1.0]

    for fn, said in [(none, "returned NoneType None"), (as_dict, "returned dict"),
                     (words, "returned str 'good' for a completion")]:
        for call in (lambda r: r.score(["a", "b"], ["a", "b"]),
                     lambda r: r.correctness_scores(["a", "b"], [Problem("p", "a")] * 2)):
            with pytest.raises(ValueError, match=rf"reward '{fn.__name__}' {said}"):
                call(RewardSet.from_specs([fn]))
    with pytest.warns(RuntimeWarning, match=r"reward 'nan' returned NaN for 1 of 2 completions"):
        total, parts = RewardSet.from_specs([nan]).score(["a", "b"], ["a", "b"])
    assert total.tolist() == [0.0, 1.0]

    def short(completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match=r"reward 'short' returned 1 values for 2 completions"):
        RewardSet.from_specs([short]).score(["a", "b"], ["a", "b"])


def test_the_accuracy_counts_the_stated_reward_not_whichever_comes_first():
    """`eval_reward` names the correctness reward; a constant first reward no longer reads as
    100 % held-out accuracy when another one is stated."""
    def always_one(completions, **kwargs):
        return [1.0] * len(completions)

    rewards = RewardSet.parse([always_one, "exact_match"], eval_reward="exact_match")
    assert rewards.correctness_name == "exact_match"
    assert rewards.correctness_scores(["7", "8"], [Problem("3+4=", "7")] * 2) == [1.0, 0.0]
    assert RewardSet.parse([always_one, "exact_match"]).correctness_name == "always_one"
    with pytest.raises(ValueError, match=r"eval_reward 'correct' is not one of the rewards "
                                         r"\(format, exact_match\)"):
        GRPOConfig(reward="format,exact_match", eval_reward="correct")


def test_evaluation_can_be_turned_off(tiny_model_dir):
    from grpo_lab.train.trainer import GRPOTrainer

    trainer = GRPOTrainer(GRPOConfig(steps=2, eval_size=0, progress=False, log_every=100))
    records = trainer.train()
    assert trainer.accuracy_history == [] and not any("eval/accuracy" in r for r in records)
    with pytest.raises(ValueError, match=r"eval_size must be >= 0"):
        GRPOConfig(eval_size=-1)


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


def test_greedy_accuracy_checks_its_reward_as_training_does(tiny_model_and_tokenizer):
    from grpo_lab.data.tasks import make_task
    from grpo_lab.model.evaluation import greedy_accuracy

    model, tokenizer = tiny_model_and_tokenizer
    problems = make_task("addition", eval_size=4).eval_set()

    def as_dict(completions, answer, **kwargs):
        return {"score": [1.0] * len(completions)}

    with pytest.raises(ValueError, match="reward 'as_dict' returned dict"):
        greedy_accuracy(model, tokenizer, problems, max_new_tokens=4, reward_fn=as_dict)
    assert greedy_accuracy(model, tokenizer, problems, max_new_tokens=4,
                           reward_fn=lambda completions, answer: [None] * len(completions)) == 0


def test_the_reward_counted_as_accuracy_is_said_when_several_are_given(capsys):
    from grpo_lab.train.trainer import GRPOTrainer

    config = GRPOConfig(steps=1, prompts_per_step=2, num_generations=2, eval_size=4,
                        reward="exact_match,format", progress=False, log_completions_every=0)
    GRPOTrainer(config).train()
    said = capsys.readouterr().out
    assert "held-out accuracy counts reward 'exact_match', the first of 2" in said
    GRPOTrainer(dataclasses.replace(config, eval_reward="exact_match")).train()
    assert "held-out accuracy counts" not in capsys.readouterr().out
