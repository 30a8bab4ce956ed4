"""grpo_lab_course.goals.GOAL_MARGINS: each numeric goal's distance to its threshold, as
benchmarks/outcomes_across_machines.py records it."""

from grpo_lab_course.goals import GOAL_MARGINS, NOTEBOOK_GOALS, goal_margins


def test_margins_are_relative_and_signed_by_direction():
    at_least = {"accuracy_before": 0.3, "accuracy_after": 0.45}  # +15 points against >= 10
    margins = goal_margins("01_grpo_from_scratch", at_least)
    assert abs(margins["accuracy gain >= 10 points"] - 0.5) < 1e-9
    missed = goal_margins("01_grpo_from_scratch", {"accuracy_before": 0.3,
                                                   "accuracy_after": 0.35})
    assert missed["accuracy gain >= 10 points"] < 0  # a missed goal has a negative margin
    at_most = goal_margins("05b_three_policies", {"staleness_cost": 0.03})
    assert abs(at_most["no cost of staleness beyond 6 points"] - 0.5) < 1e-9


def test_a_margin_whose_values_are_missing_is_none_not_an_error():
    margins = goal_margins("01_grpo_from_scratch", {})
    assert set(margins) == set(GOAL_MARGINS["01_grpo_from_scratch"])
    assert all(v is None for v in margins.values())


def test_every_notebook_with_margins_has_goals():
    assert set(GOAL_MARGINS) <= set(NOTEBOOK_GOALS)
