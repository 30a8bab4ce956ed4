"""grpo_lab_course.sim_runs: simulated runs read by notebook 08's tools, the blog's figures
against the simulator's, and the plan's memory figure (notebook 11). Short runs: seconds."""

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from grpo_lab.plan.run_forecast import model_shape, replica_gib  # noqa: E402
from grpo_lab.plan.sim_blog import BLOG_RUNS, blog_costs, blog_setting
from grpo_lab_course.pipeline_runs import plot_runs, runs_table, summarize  # noqa: E402
from grpo_lab_course.sim_runs import (  # noqa: E402
    BLOG_RUN_NAMES,
    PUBLISHED_AS,
    comparison_table,
    max_sequences,
    plan_record,
    plot_memory,
    plot_predicted_vs_published,
    predicted_vs_published,
    run_record,
    simulated_run,
)

STEPS = 60


@pytest.fixture(scope="module")
def runs():
    costs = blog_costs()
    return {run: simulated_run(BLOG_RUN_NAMES[run], blog_setting(run), costs, steps=STEPS)
            for run in (1, 2, 5)}


def test_a_simulated_run_reads_like_a_live_one(runs):
    run1 = runs[1]
    assert len(run1.records) == STEPS and run1.diagnosis.numbers["steps"] == STEPS - STEPS // 5
    assert run1.diagnosis.bottleneck == "trainer"  # the blog's run 1: a full queue, no wait
    assert run1.seconds == pytest.approx(run1.records[-1]["time_s"])
    row = summarize(run1)
    assert row["replicas"] == 2 and row["max_inflight"] == 128 and row["token_budget"] is None
    assert row["step_s"] > row["fwd_bwd_s"] > 0
    assert "r2-packing" in runs_table(list(runs.values()))
    assert repr(run1).startswith("KnobRun('r1-baseline'")
    assert len(plot_runs(list(runs.values())).axes) == 3


def test_packing_cuts_the_step_and_the_exercise_knob_cuts_the_wall_clock(runs):
    from dataclasses import replace

    assert runs[2].summary()["step_s_p50"] < 0.35 * runs[1].summary()["step_s_p50"]
    fewer = simulated_run("x", replace(blog_setting(5), weight_sync_steps=8), steps=STEPS)
    assert fewer.seconds < 0.9 * runs[5].seconds
    record = run_record(fewer)
    assert record["weight_sync_steps"] == 8 and record["wall_clock_s"] == fewer.seconds
    assert run_record(None) is None


def test_predicted_against_published_rows(runs):
    rows = predicted_vs_published(runs)
    expected = [(run, f) for run in runs for f in BLOG_RUNS[run] if f in PUBLISHED_AS]
    assert [(r["run"], r["figure"]) for r in rows] == expected
    step = next(r for r in rows if r["run"] == 1 and r["figure"] == "micro_batches")
    assert step["predicted"] == 64 and step["ratio"] == 1 and step["within_goal"]
    verdict = next(r for r in rows if r["run"] == 1 and r["figure"] == "bottleneck")
    assert verdict["ratio"] is None and verdict["within_goal"]
    wait = next(r for r in rows if r["run"] == 1 and r["figure"] == "rollout_wait_s")
    assert wait["within_goal"]  # 0 s against 0.02 s: both near zero
    text = comparison_table(rows)
    assert text.splitlines()[0].split()[:3] == ["run", "figure", "published"]
    assert len(text.splitlines()) == len(rows) + 1
    fig = plot_predicted_vs_published(rows)
    assert len(fig.axes[0].get_yticklabels()) == sum(r["ratio"] is not None for r in rows)


def test_max_sequences_is_the_last_count_that_fits():
    shape = model_shape("qwen2.5-math-1.5b")
    n = max_sequences(shape, 131.3, 4096)
    assert replica_gib(shape, n, 4096) <= 0.85 * 131.3 < replica_gib(shape, n + 1, 4096)
    assert max_sequences(shape, 2.0, 4096) == 0  # the weights alone do not fit


class _Forecast:  # the RunForecast fields plan_record and plot_memory read
    model, parameters, replicas = "qwen2.5-0.5b", 494_032_768, 1
    replica_flavor, trainer_flavor = "a100-large", "h200x2"
    step_s, wall_clock_s, cost_usd, bottleneck = 4.0, 3600.0, 9.0, "trainer"
    trainer_memory_gib, trainer_limit_gib = 60.0, 111.6
    replica_memory_gib, replica_limit_gib = 20.0, 63.3
    setting = blog_setting(5)


def test_plan_record_and_memory_figure():
    record = plan_record(_Forecast())
    assert record["replica_gpus"] == 1 and record["trainer_gpus"] == 2
    assert record["memory_fits"] and record["token_budget"] == 16384
    over = _Forecast()
    over.replica_memory_gib = 70.0
    assert not plan_record(over)["memory_fits"]
    fig = plot_memory({"a": _Forecast(), "b": over})
    assert len(fig.axes) == 2
