"""The sync-against-async timeline (grpo_lab_course.timeline_plots) draws the logged step times."""

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from grpo_lab_course.timeline_plots import (
    buffer_versions,
    busy_share,
    plot_timeline,
    staleness_summary,
    step_spans,
)

SYNC = [{"step": s, "version": s + 1, "time_s": 1.0 * s, "perf/step_s": 1.0,
         "perf/rollout_wait_s": 0.4, "perf/generate_s": 0.4,
         "sample/staleness_mean": 0.0, "sample/staleness_max": 0} for s in (1, 2, 3)]
ASYNC = [{"step": s, "version": s + 1, "time_s": 0.6 * s, "perf/step_s": 0.6,
          "perf/rollout_wait_s": 0.05, "rollout/version_wait_s": 0.1,
          "rollout/backpressure_total_s": 0.05, "sample/staleness_mean": 0.5,
          "sample/staleness_max": 1} for s in (1, 2, 3)]


def test_a_synchronous_step_generates_then_trains():
    spans = [s for s in step_spans(SYNC) if s.step == 2 and s.kind != "idle"]
    generate, train = sorted(spans, key=lambda s: s.start)
    assert (generate.kind, generate.start, generate.seconds) == ("generate", 1.0, 0.4)
    assert train.kind == "train" and train.start == pytest.approx(1.4)
    assert train.seconds == pytest.approx(0.6)
    assert busy_share(SYNC) == pytest.approx({"generation": 0.4, "training": 0.6})


def test_an_asynchronous_step_overlaps_and_subtracts_the_held_back_time():
    spans = {(s.lane, s.kind): s for s in step_spans(ASYNC) if s.step == 3}
    assert spans[("generation", "generate")].seconds == pytest.approx(0.6 - 0.15)
    assert spans[("training", "train")].start == pytest.approx(1.2 + 0.05)
    share = busy_share(ASYNC)
    assert share["generation"] + share["training"] > 1  # the lanes overlap


def test_buffer_versions_and_the_figure_draw_the_records():
    assert buffer_versions(ASYNC)[1] == (1.2, 2, 1.5, 1)
    fig = plot_timeline({"sync": SYNC, "async": ASYNC}, steps=(2, 3))
    bars = [c for c in fig.axes[0].collections]
    assert len(bars) == 4  # two lanes per run
    drawn = sorted(round(float(np.ptp(p.vertices[:, 0])), 6) for p in bars[0].get_paths())
    logged = sorted(round(s.seconds, 6) for s in step_spans(SYNC[1:]) if s.lane == "training")
    assert drawn == logged  # the sync run's training lane: its logged spans, steps 2-3
    line = fig.axes[1].get_lines()[0]
    assert list(line.get_ydata()) == [r[1] for r in buffer_versions(ASYNC)]


def test_staleness_summary_reads_the_stale_steps():
    records = [{**r, "ratio": 1.0 + 0.001 * i, "kl": 1e-4 * i, "sample/dropped_stale_total": 0,
                "sample/staleness_mean": 0.5 * i} for i, r in enumerate(ASYNC)]
    s = staleness_summary(records)
    assert s["staleness_mean"] == pytest.approx(0.5) and s["staleness_max"] == 1
    assert s["kl_stale_mean"] == pytest.approx(1.5e-4)  # steps 2 and 3 only: step 1 was fresh
    assert s["ratio_deviation"] == pytest.approx(0.002) and s["dropped"] == 0
