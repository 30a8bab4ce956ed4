"""Reward design, sample completions, and the device/dtype choice (issue 13, items 3-5)."""

import json
import textwrap

import pytest
import torch

from grpo_lab.data.reward_set import RewardSet
from grpo_lab.data.rewards import format_reward
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.trainer import GRPOTrainer
from grpo_lab.util.devices import resolve_device, resolve_dtype

SMALL = dict(steps=2, prompts_per_step=3, num_generations=4, eval_size=8, eval_every=0,
             progress=False, log_every=100)


def test_format_reward_checks_the_form_not_the_value():
    texts = ["3 + 4 = 7\n#### 8", r"so \boxed{7}", "7", "####", "#### "]
    assert format_reward(texts) == [1.0, 1.0, 0.0, 0.0, 0.0]


def test_weighted_sum_and_per_reward_scores():
    rewards = RewardSet.parse("math_answer,format", "1,0.25")
    completions = ["#### 7", "#### 8", "7", "nothing"]
    total, parts = rewards.score(completions, ["7"] * 4)
    assert parts["math_answer"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert parts["format"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert total.tolist() == pytest.approx([1.25, 0.25, 1.0, 0.0])
    metrics = RewardSet.metrics(parts)
    assert metrics["rewards/math_answer/mean"] == 0.5 and metrics["rewards/format/mean"] == 0.5
    assert rewards.correctness_name == "math_answer"  # the first, unless eval_reward says


def test_a_reward_from_the_users_module_and_none_values(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def shortness(completions, prompts, answer, **kwargs):
            return [None if c == "skip" else -len(c) / 10 for c in completions]
    """))
    monkeypatch.chdir(tmp_path)
    rewards = RewardSet.parse("exact_match,my_rewards:shortness", "1,1")
    total, parts = rewards.score(["12", "skip", "1"], ["12", "12", "12"], prompts=["a"] * 3)
    assert torch.isnan(parts["my_rewards:shortness"][1])  # None: does not apply here
    assert total.tolist() == pytest.approx([1 - 0.2, 0.0, -0.1])  # ... and counts 0 in the sum
    assert RewardSet.metrics(parts)["rewards/my_rewards:shortness/mean"] == pytest.approx(-0.15)


@pytest.mark.parametrize("reward, weights, message", [
    ("nope", None, "unknown reward 'nope'"),
    ("no_such_module:f", None, "cannot import module 'no_such_module'"),
    ("json:no_such_function", None, "json has no function 'no_such_function'"),
    ("math_answer,format", "1", "has 1 weights for 2 rewards"),
    ("math_answer,format", "1,x", "numbers separated by commas"),
    ("format,format", None, "names a reward twice"),
    ("", None, "at least one reward"),
])
def test_bad_reward_settings_fail_at_construction_with_a_clear_message(reward, weights, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(reward=reward, reward_weights=weights)


def test_a_reward_that_returns_the_wrong_count_is_named():
    rewards = RewardSet([("short")], [lambda completions, **kw: [1.0]], [1.0])
    with pytest.raises(ValueError, match="reward 'short' returned 1 values for 2 completions"):
        rewards.score(["a", "b"], ["a", "b"])


def test_auto_device_and_dtype_on_this_machine():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == expected
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype 'int8'"):
        resolve_dtype("int8", "cpu")
    with pytest.raises(ValueError, match="not a torch device"):
        resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="sees no CUDA GPU"):
            resolve_device("cuda")


def test_bfloat16_weights_train_with_float32_logprobs(tiny_model_dir):
    trainer = GRPOTrainer(GRPOConfig(**SMALL, model=str(tiny_model_dir), dtype="bfloat16"))
    assert next(trainer.model.parameters()).dtype == torch.bfloat16
    record = trainer.step()
    assert record["ratio"] == pytest.approx(1.0, abs=1e-2)  # same weights sampled and scored


def test_trainers_log_each_reward_and_sample_completions(tiny_model_dir, tmp_path, capsys):
    cfg = GRPOConfig(**SMALL, model=str(tiny_model_dir), reward="exact_match,format",
                     reward_weights="1,0.5", log_completions_every=2, num_completions_to_print=2,
                     output_dir=str(tmp_path))
    trainer = GRPOTrainer(cfg)
    records = [trainer.step() for _ in range(2)]
    for r in records:  # the logged reward is the weighted sum of the per-reward means
        assert r["reward"] == pytest.approx(r["rewards/exact_match/mean"]
                                            + 0.5 * r["rewards/format/mean"])
    lines = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [2, 2]  # step 2 only, two prompts
    for x in lines:
        assert len(x["completions"]) == 4 and x["prompt"].endswith("=") and x["answer"]
        rewards = [c["reward"] for c in x["completions"]]
        assert rewards == sorted(rewards, reverse=True)
        assert set(x["completions"][0]["rewards"]) == {"exact_match", "format"}
    printed = capsys.readouterr().out
    assert "--- step 2 | prompt:" in printed and "best  (" in printed


def test_gradient_checkpointing_gives_the_same_update(tiny_model_dir):
    grads = []
    for checkpointing in (False, True):
        trainer = GRPOTrainer(GRPOConfig(**SMALL, model=str(tiny_model_dir), seed=3,
                                         gradient_checkpointing=checkpointing))
        base = trainer.model.get_base_model()
        assert getattr(base, "is_activation_checkpointing", base.is_gradient_checkpointing) \
            is checkpointing
        batch, _, _ = trainer.make_batch(trainer.task.sample_batch(trainer.rng, 3))
        grads.append(trainer.optimize(batch)["grad_norm"])
    assert grads[0] > 0 and grads[1] == pytest.approx(grads[0], rel=1e-4)
