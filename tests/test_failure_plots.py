"""grpo_lab_course.failure_plots (notebook 10's readings and drawings of runs) and the rule
checks of grpo_lab.watch.doctor that notebook 08's exercise uses; no notebook runs."""

import math
from types import SimpleNamespace

import matplotlib
import pytest
import torch

matplotlib.use("Agg")

from grpo_lab_course import failure_plots as fp  # noqa: E402


def records(rewards, clipped, **extra):
    """Step records after an evaluation record, as GRPOTrainer.train() returns them."""
    rows = [{"step": 0, "eval/accuracy": 0.25}]
    rows += [{"step": i + 1, "reward": r, "completions/clipped_ratio": c,
              "entropy": 0.3, "frac_reward_zero_std": 0.5, **{k: v[i] for k, v in extra.items()}}
             for i, (r, c) in enumerate(zip(rewards, clipped))]
    return rows + [{"step": len(rewards), "eval/accuracy": 0.5}]


def test_readings_skip_evaluations():
    run = records([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0, 0, 0, 1, 1, 1])
    assert fp.late(run, "reward") == pytest.approx(0.4)  # steps 2-6
    assert fp.late(run, "reward", n=1) == pytest.approx(0.6)
    assert fp.run_mean(run, "completions/clipped_ratio") == pytest.approx(0.5)
    assert fp.first_step_over(run, "reward", 0.35) == 4
    assert fp.first_step_over(run, "reward", 0.9) is None
    assert "0.25 -> 0.50" in fp.run_line("x", run)
    with pytest.raises(KeyError):
        fp.late(run, "no such metric")


def test_plot_failures_draws_each_runs_records():
    healthy = records([0.3, 0.4, 0.5], [0.0, 0.0, 0.1])
    broken = records([0.3, 0.2, 0.2], [0.5, 1.0, 1.0])
    fig = fp.plot_failures({"healthy": healthy, "broken": broken},
                           references={"reward": (0.2, "format only")})
    assert [ax.get_title() for ax in fig.axes] == list(fp.SIGNS)
    reward_lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in reward_lines[:2]] == ["healthy", "broken"]
    assert list(reward_lines[1].get_ydata()) == [0.3, 0.2, 0.2]
    assert list(reward_lines[1].get_xdata()) == [1, 2, 3]
    assert list(fig.axes[2].get_lines()[1].get_ydata()) == [0.5, 1.0, 1.0]
    assert list(reward_lines[2].get_ydata()) == [0.2, 0.2]  # the reference line


def test_dynamic_sampling_cost():
    run = records([0.5, 0.5], [0, 0], **{"dynamic_sampling/generated_groups": [12, 20],
                                         "dynamic_sampling/zero_std_groups": [4, 12]})
    cost = fp.dynamic_sampling_cost(run, prompts_per_step=8)
    assert cost["cost"] == pytest.approx(2.0)
    assert cost["zero_std_generated"] == pytest.approx(0.5)
    assert cost["zero_std_trained"] == pytest.approx(0.5)


def test_adam_keeps_moving_for_tens_of_steps_at_beta2_095():
    sizes = fp.adam_drift(0.95)
    assert sizes[0] == pytest.approx(0.9 / math.sqrt(0.95), rel=0.01)
    assert fp.half_life(0.95) == pytest.approx(8.7, abs=0.1)
    assert sizes[19] > 0.1 and sizes[49] < 0.1  # still a tenth after 20 steps, gone after 50
    fig = fp.plot_adam_drift((0.95,), after=30)
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == fp.adam_drift(0.95, after=30)


def test_entropy_agrees_rejects_a_missing_temperature():
    def right(logits, mask, temperature=1.0):
        logps = torch.log_softmax(logits / temperature, dim=-1)
        entropy = -(logps.exp() * logps).sum(-1)
        return float((entropy * mask).sum() / mask.sum())

    assert fp.entropy_agrees(right)
    assert not fp.entropy_agrees(lambda logits, mask, temperature=1.0: right(logits, mask))


def test_token_push_is_1_over_BL_for_grpo_and_constant_for_dr_grpo():
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]])
    batch = SimpleNamespace(old_logps=-torch.rand(3, 4), completion_mask=mask,
                            advantages=torch.tensor([1.0, -0.5, 2.0]))
    lengths = mask.sum(1)
    assert torch.allclose(fp.token_push(batch, "grpo", 4), 1 / (3 * lengths), rtol=1e-5)
    assert torch.allclose(fp.token_push(batch, "dr_grpo", 4), torch.full((3,), 1 / 12),
                          rtol=1e-5)
