"""grpo_lab_course.pipeline_runs: one row per run, the table and the plot, and bad input (no
servers: notebook 08 runs the real thing against live replicas)."""

from __future__ import annotations

import pytest

from grpo_lab.watch.doctor import diagnose
from grpo_lab_course.pipeline_runs import KnobRun, plot_runs, run_with_knobs, runs_table, summarize


def _records(steps: int, *, wait: float, held: float, queue: int, fwd_bwd: float = 0.2,
             sync: float = 0.03, stale: float = 1.0) -> list[dict]:
    return [{"step": s, "perf/step_s": fwd_bwd + wait + sync, "perf/fwd_bwd_s": fwd_bwd,
             "perf/rollout_wait_s": wait, "rollout/backpressure_total_s": 0.0,
             "rollout/version_wait_s": held, "sample/rollout_queue_size": queue,
             "sample/rollout_queue_maxsize": 16, "sample/staleness_mean": stale,
             "sample/staleness_max": 1, "perf/weight_sync_s": sync,
             "batch/microbatches_per_step": 3}
            for s in range(1, steps + 1)]


def _run(name: str, records: list[dict], window: int = 8) -> KnobRun:
    knobs = {"replicas": 1, "max_inflight": None, "request_shape": "group", "token_budget": None,
             "weight_sync_steps": 1, "max_staleness": 1}
    return KnobRun(name, knobs, records, diagnose(records, window=window), 1.0, 16)


def test_summarize_averages_over_the_diagnosed_window_only():
    # The first steps fill the pipeline (long waits); the window leaves them out.
    records = _records(4, wait=5.0, held=0.0, queue=0) + [
        {**r, "step": r["step"] + 4} for r in _records(8, wait=0.0, held=0.2, queue=16)]
    row = summarize(_run("fast-generation", records))
    assert row["rollout_wait_s"] == 0.0 and row["queue"] == 16
    assert row["held_back_share"] == pytest.approx(0.2 / 0.23)
    assert row["bottleneck"] == "trainer"
    assert row["run"] == "fast-generation" and row["replicas"] == 1


def test_a_starving_trainer_reads_as_generation_bound():
    row = summarize(_run("slow-generation", _records(12, wait=0.15, held=0.0, queue=0)))
    assert row["bottleneck"] == "generation"
    assert row["wait_share"] == pytest.approx(0.15 / 0.38)


def test_table_and_plot_show_every_run():
    runs = [_run("a-trainer", _records(8, wait=0.0, held=0.2, queue=16)),
            _run("b-generation", _records(8, wait=0.2, held=0.0, queue=0))]
    table = runs_table(runs).splitlines()
    assert len(table) == 3 and table[0].split()[0] == "run"
    assert table[1].split()[-1] == "trainer" and table[2].split()[-1] == "generation"
    fig = plot_runs(runs)
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["a\ntrainer\n(trainer)", "b\ngeneration\n(generation)"]


@pytest.mark.parametrize("name, kwargs, message", [
    ("has space", {}, "run name"),
    ("ok", {"steps": 4, "window": 8}, "window"),
    ("ok", {"steps": 4, "window": 0}, "window"),
    ("ok", {"request_shape": "batch"}, "request_shape"),
])
def test_bad_input_is_refused_before_anything_starts(tmp_path, name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run_with_knobs(name, "http://127.0.0.1:9", tmp_path, **kwargs)
    assert not any(tmp_path.iterdir())
