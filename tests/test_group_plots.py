"""grpo_lab_course.group_plots: the figures draw the group they are given."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import pytest
import torch

from grpo_lab.algo.grpo_loss import group_advantages
from grpo_lab_course.group_plots import (
    RIGHT,
    WRONG,
    SampledGroups,
    plot_before_after,
    plot_group,
    plot_token_weights,
    split_groups,
)


def test_split_groups_is_prompt_major_and_refuses_a_remainder():
    assert split_groups(range(6), 3) == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError):
        split_groups(range(5), 2)


def test_group_bars_are_the_advantages_coloured_by_reward():
    texts, rewards = ["052", "52", "053", "052"], [1.0, 0.0, 0.0, 1.0]
    fig = plot_group("07+45=", texts, rewards, answer="052")
    ax = fig.axes[0]
    heights = [bar.get_height() for bar in ax.patches]
    expected = group_advantages(torch.tensor(rewards), 4).tolist()
    assert heights == pytest.approx(expected, abs=1e-6)
    colors = [matplotlib.colors.to_hex(bar.get_facecolor()) for bar in ax.patches]
    assert colors == [RIGHT.lower(), WRONG.lower(), WRONG.lower(), RIGHT.lower()]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels[1] == "'52'\nr = 0" and "2 of 4 right" in ax.get_title()
    plt.close(fig)


def test_before_after_grids_hold_the_rewards_and_completions():
    before = SampledGroups(["07+45=", "12+34="], ["052", "046"],
                           [["052", "53"], ["046", "047"]], [[1.0, 0.0], [1.0, 0.0]])
    after = before._replace(texts=[["052", "052"], ["046", "046"]], rewards=[[1.0, 1.0]] * 2)
    fig = plot_before_after(before, after)
    for ax, groups in zip(fig.axes, (before, after)):
        assert ax.images[0].get_array().tolist() == groups.rewards
        assert [t.get_text() for t in ax.texts] == [t for row in groups.texts for t in row]
    assert "2 of 4 right" in fig.axes[0].get_title() and "4 of 4" in fig.axes[1].get_title()
    with pytest.raises(ValueError):
        plot_before_after(before, after._replace(prompts=["01+01=", "12+34="]))
    plt.close(fig)


def test_token_weight_bars_are_advantage_times_weight():
    lengths, advantages = [4, 12], [0.7, -0.7]
    weights = {"grpo": [1 / 8, 1 / 24], "dapo": [1 / 16, 1 / 16]}
    fig = plot_token_weights(lengths, advantages, weights, ["a", "b"], max_len=12)
    bars = [bar.get_height() for bar in fig.axes[1].patches]
    assert bars == pytest.approx([0.7 / 8, -0.7 / 24, 0.7 / 16, -0.7 / 16])
    plt.close(fig)


def test_sample_groups_scores_its_texts_and_a_seed_leaves_the_global_stream(
        tiny_model_and_tokenizer):
    from grpo_lab.data.rewards import exact_match_reward
    from grpo_lab.data.tasks import make_task
    from grpo_lab_course.group_plots import sample_groups

    model, tokenizer = tiny_model_and_tokenizer
    problems = make_task("addition").eval_set()[:2]
    torch.manual_seed(0)
    state = torch.random.get_rng_state()
    first = sample_groups(model, tokenizer, problems, 3, max_new_tokens=5, seed=1)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's stream untouched
    again = sample_groups(model, tokenizer, problems, 3, max_new_tokens=5, seed=1)
    assert first == again
    assert first.prompts == [p.prompt for p in problems] and len(first.texts[1]) == 3
    for texts, rewards, answer in zip(first.texts, first.rewards, first.answers):
        assert rewards == [float(r) for r in exact_match_reward(texts, answer=[answer] * 3)]


def test_print_groups_writes_one_line_per_prompt(capsys):
    from grpo_lab_course.group_plots import print_groups
    print_groups(SampledGroups(["1+1=", "2+2="], ["02", "04"], [["02", "3"], ["04", "04"]],
                               [[1.0, 0.0], [1.0, 1.0]]))
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["1+1=02  samples=['02', '3']  rewards=[1.0, 0.0]",
                     "2+2=04  samples=['04', '04']  rewards=[1.0, 1.0]"]


def test_clip_runs_checks_the_surrogate_then_trains_both():
    from types import SimpleNamespace

    from grpo_lab_course.group_plots import compare_clip_runs
    example = (-torch.rand(2, 3), -torch.rand(2, 3), torch.tensor([1.0, -1.0]))

    def unclipped(lp, old, a):
        return -torch.exp(lp - old) * a[:, None]

    made = []

    def make_trainer(surrogate):
        made.append(surrogate)
        kl = 0.1 * len(made)
        return SimpleNamespace(train=lambda: [{"step": 0, "kl": 9.0}, {"step": 1, "kl": kl}],
                               accuracy_history=[(0, 0.0), (1, 0.5)])
    runs = compare_clip_runs(make_trainer, unclipped, example)
    assert made[1] is unclipped and runs["unclipped"]["kl"] == pytest.approx(0.2)
    assert runs["clipped"] == {"kl": pytest.approx(0.1), "accuracy": 0.5}
    with pytest.raises(AssertionError):
        compare_clip_runs(make_trainer, lambda lp, old, a: -torch.exp(lp - old), example)
