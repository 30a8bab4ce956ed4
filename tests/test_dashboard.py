"""The live dashboard, the pipeline plot and the recipe's diagnosis rule, on synthetic records."""

from __future__ import annotations

import io
import json
import threading
import time

import pytest

from grpo_lab.watch.dashboard import Dashboard
from grpo_lab.watch.doctor import diagnose
from grpo_lab.watch.metrics import MetricsLogger
from grpo_lab.watch.plots import plot_pipeline


def run_records(regime: str, steps: int = 30) -> list[dict]:
    """Metrics as AsyncGRPOTrainer logs them, in one of three regimes (queue max 8)."""
    records = []
    for step in range(1, steps + 1):
        r = {"step": step, "reward": 0.1 + 0.01 * step, "ratio": 1.0, "perf/weight_sync_s": 0.1,
             "sample/staleness_mean": 1.5, "sample/staleness_max": 3,
             "sample/rollout_queue_maxsize": 8, "rollout/generated_tok_s_busy": 900.0}
        if regime == "trainer":  # full queue, no wait, the worker blocked on a full buffer
            r.update({"sample/rollout_queue_size": 8, "perf/rollout_wait_s": 0.0,
                      "rollout/backpressure_total_s": 1.5,
                      "perf/fwd_bwd_s": 1.9, "perf/step_s": 2.0})
        elif regime == "generation":  # empty queue, growing wait, no backpressure
            wait = 0.5 + 0.05 * step
            r.update({"sample/rollout_queue_size": 0, "perf/rollout_wait_s": wait,
                      "rollout/backpressure_total_s": 0.0,
                      "perf/fwd_bwd_s": 0.5, "perf/step_s": 0.6 + wait})
        else:  # balanced: half full, neither side waits long
            r.update({"sample/rollout_queue_size": 4, "perf/rollout_wait_s": 0.02,
                      "rollout/backpressure_total_s": 0.03,
                      "perf/fwd_bwd_s": 0.9, "perf/step_s": 1.0})
        records.append(r)
    return records


@pytest.mark.parametrize("regime", ["trainer", "generation", "balanced"])
def test_diagnosis_names_the_slow_side(regime):
    bottleneck, verdict, numbers = diagnose(run_records(regime))
    assert bottleneck == regime
    expected = {"trainer": "trainer too slow", "generation": "generation too slow",
                "balanced": "neither side"}[regime]
    assert verdict.startswith(expected)
    assert numbers["steps"] == 20  # the window
    if regime == "trainer":
        assert numbers["queue_fill"] == 1.0 and numbers["rollout_wait_s"] == 0.0
        assert numbers["held_back_share"] == pytest.approx(0.75)
    if regime == "generation":
        assert numbers["queue_fill"] == 0.0 and numbers["wait_slope_s"] == pytest.approx(0.05)
        assert numbers["backpressure_s"] == 0.0


def test_admission_waits_count_as_backpressure():
    """A trainer-bound run whose worker waits for newer policies instead of a full buffer."""
    records = run_records("trainer")
    for r in records:
        r["rollout/version_wait_s"] = r["rollout/backpressure_total_s"]
        r["rollout/backpressure_total_s"] = 0.0
    assert diagnose(records).bottleneck == "trainer"


def test_diagnosis_without_pipeline_metrics():
    assert diagnose([{"step": 1, "reward": 0.2}]).bottleneck == "unknown"
    assert diagnose([]).numbers == {}


def test_update_headless_prints_a_throttled_status_line():
    out = io.StringIO()
    stats = {"routed": [31928, 32800], "affinity": 54712, "spilled": 820, "unmatched": 9196}
    dash = Dashboard(notebook=False, stream=out, min_interval_s=60, stats=lambda: stats)
    for record in run_records("trainer"):
        dash.update(record)  # usable as a trainer callback
    assert dash.renders == 1 and len(dash.records) == 30  # the first step drew, the rest waited
    dash.flush()
    # the status lines, and once (between them) the run doctor's finding: the trainer too slow
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and lines[0].startswith("step 1 |")
    assert [f.code for f in dash.findings] == ["bottleneck_trainer"]
    assert out.getvalue().count("[doctor, note]") == 1
    last = lines[-1]
    for part in ("step 30", "reward 0.400", "ratio 1.0000", "staleness 1.5/3", "queue 8/8",
                 "wait 0.00s", "backpressure 1.50s", "trainer too slow",
                 "router affinity 54712 spilled 820 unmatched 9196 routed [31928, 32800]"):
        assert part in last, part

    def broken():
        raise ConnectionRefusedError

    dash = Dashboard(notebook=False, stream=out, stats=broken)
    dash.update(run_records("balanced")[0])
    last = out.getvalue().splitlines()[-1]
    assert last.endswith("router stats unavailable (ConnectionRefusedError)")


def test_notebook_panel_renders_a_png():
    dash = Dashboard(notebook=True, min_interval_s=0, max_busy=None,
                     stats=lambda: {"router": {"affinity": 5, "spilled": 1, "unmatched": 2}})
    for record in run_records("generation", steps=2):
        dash.update(record)  # unthrottled: each update redraws
    text, image = dash.widget.children
    assert dash.renders == 2 and bytes(image.value).startswith(b"\x89PNG")
    assert "generation too slow" in text.value
    titles = [ax.get_title() for ax in dash.figure(router={"affinity": 1}).axes]
    assert titles[:3] == ["reward", "ratio (pi_theta / pi_old)", "router"]


def test_follow_tails_a_metrics_file_written_while_it_reads(tmp_path):
    path = tmp_path / "metrics.jsonl"
    records = run_records("balanced", steps=12)
    finished = threading.Event()

    def writer():
        with path.open("w") as f:
            for record in records:
                text = json.dumps(record) + "\n"
                f.write(text[:10])  # half a line first: the reader must wait for the rest
                f.flush()
                time.sleep(0.005)
                f.write(text[10:])
                f.flush()
        finished.set()

    thread = threading.Thread(target=writer)
    thread.start()
    dash = Dashboard(notebook=False, stream=io.StringIO(), min_interval_s=0)
    count = dash.follow(tmp_path, until=finished.is_set, poll_s=0.01, timeout_s=30)
    thread.join()
    assert count == 12 and dash.records == records

    more = Dashboard(notebook=False, stream=io.StringIO())
    follower = more.follow(path, background=True, poll_s=0.01)
    with path.open("a") as f:
        f.write(json.dumps({"step": 13, "reward": 1.0}) + "\n")
    follower.stop()
    assert not follower.running() and more.records[-1] == {"step": 13, "reward": 1.0}
    assert len(more.records) == 13


def test_follow_survives_a_metrics_file_rewritten_shorter(tmp_path):
    """A resumed trainer trims metrics.jsonl to its checkpoint and writes on: the follower
    starts again from the top of the shorter file instead of reading across the rewrite."""
    path = tmp_path / "metrics.jsonl"

    def lines(steps, reward):
        return "".join(json.dumps({"step": i, "reward": reward}) + "\n" for i in steps)

    path.write_text(lines(range(1, 21), 0.1))
    polls = []

    def until():  # called once per poll, before the read
        polls.append(1)
        if len(polls) == 2:  # the kill and the resume: 3 steps kept, a 4th half written
            path.write_text(lines(range(1, 4), 0.1) + '{"step": 4, "rew')
        elif len(polls) == 3:
            with path.open("a") as f:
                f.write('ard": 0.3}\n')
        return len(polls) >= 4

    dash = Dashboard(notebook=False, stream=io.StringIO(), min_interval_s=0)
    assert dash.follow(path, until=until, poll_s=0, timeout_s=30) == 24
    assert [r["step"] for r in dash.records[-4:]] == [1, 2, 3, 4]
    assert dash.records[-1] == {"step": 4, "reward": 0.3}

def test_plot_pipeline_reads_a_run_folder(tmp_path):
    import matplotlib.pyplot as plt

    logger = MetricsLogger(tmp_path / "metrics.jsonl")
    for record in run_records("generation"):
        logger.log(record)
    fig = plot_pipeline(tmp_path)
    try:
        assert [ax.get_title() for ax in fig.axes] == [
            "step time (s)", "rollout wait vs backpressure (s)", "rollout queue size vs max",
            "staleness (versions)", "weight sync (s)", "generated tokens / s"]
        labels = {ax.get_title(): [line.get_label() for line in ax.lines] for ax in fig.axes}
        assert labels["rollout queue size vs max"] == ["rollout_queue_size",
                                                       "rollout_queue_maxsize"]
        assert labels["staleness (versions)"] == ["staleness_mean", "staleness_max"]
        assert fig._suptitle.get_text().startswith("generation too slow")
    finally:
        plt.close(fig)


def test_pipeline_plot_shows_the_version_gate_wait():
    """Generation held back by the version gate (admission within max_staleness), not by a full
    buffer: the diagnosis says so, and the wait plot must show it (it read 0 all run)."""
    import matplotlib.pyplot as plt

    records = run_records("trainer")
    for r in records:
        r["rollout/version_wait_s"], r["rollout/backpressure_total_s"] = (
            r["rollout/backpressure_total_s"], 0.0)
    fig = plot_pipeline(records)
    try:
        waits = next(ax for ax in fig.axes if ax.get_title() == "rollout wait vs backpressure (s)")
        lines = {line.get_label(): list(line.get_ydata()) for line in waits.lines}
        assert list(lines) == ["rollout_wait_s", "backpressure_total_s", "version_wait_s"]
        assert lines["version_wait_s"] == [1.5] * 30 and lines["backpressure_total_s"] == [0.0] * 30
        assert "held back 1.50 s/step" in fig._suptitle.get_text()
    finally:
        plt.close(fig)


def sync_records(steps: int = 12) -> list[dict]:
    """Metrics as the synchronous GRPOTrainer logs them: no queue, staleness or weight sync."""
    return [{"step": s, "reward": 0.2 + 0.02 * s, "ratio": 1.0 + (-1) ** s * 1.2e-7,
             "loss": -6e-8, "grad_norm": 0.3, "perf/generate_s": 0.05, "perf/fwd_bwd_s": 0.04,
             "perf/step_s": 0.09} for s in range(1, steps + 1)]


def test_a_synchronous_run_shows_only_the_plots_that_have_data():
    dash = Dashboard(notebook=True, min_interval_s=3600)
    for record in sync_records():
        dash.update(record)  # the first step draws
    dash.flush()  # and the last
    assert dash.panels == ["reward", "ratio (pi_theta / pi_old)", "step time (s)"]
    assert dash.caption() == (
        "plots: reward, ratio (pi_theta / pi_old), step time (s); no data for: rollout wait vs "
        "backpressure (s), rollout queue size vs max, staleness (versions), weight sync (s), "
        "generated tokens / s")
    fig = dash.figure()
    assert all(ax.lines for ax in fig.axes)  # no empty axes
    assert fig.get_figheight() < 4  # one row
    # The status line leaves out the pipeline numbers a synchronous run does not log.
    text, _ = dash.widget.children
    assert text.value.startswith(
        "<code>step 12 | reward 0.440 | ratio 1.0000 | step time 0.09s</code><br><small")
    # With the proxy's stats: the router joins the first row; unavailable stats say so.
    assert [ax.get_title() for ax in dash.figure(router="router stats unavailable")
            .axes] == ["reward", "ratio (pi_theta / pi_old)", "router: no stats", "step time (s)"]


@pytest.mark.parametrize("n, shape", [(1, (1, 1)), (3, (1, 3)), (4, (1, 4)), (5, (2, 3)),
                                      (6, (2, 3)), (7, (2, 4)), (8, (2, 4)), (9, (3, 3))])
def test_grid_leaves_at_most_the_fewest_empty_cells(n, shape):
    from grpo_lab.watch.plots import grid_shape

    assert grid_shape(n) == shape


def test_an_asynchronous_run_fills_every_cell():
    stats = {"affinity": 5, "spilled": 1, "unmatched": 2, "routed": [4, 4]}
    for router, n, columns in ((stats, 9, 3), (None, 8, 4)):
        fig = Dashboard(notebook=False).figure(run_records("balanced"), router)
        assert len(fig.axes) == n
        assert {ax.get_subplotspec().get_gridspec().ncols for ax in fig.axes} == {columns}
        assert all(ax.lines or ax.patches for ax in fig.axes)


def _boxes(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    return renderer


def test_ratio_axis_reads_plain_decimals_and_nothing_overlaps():
    """The ratio stays within 1e-7 of 1 in a synchronous run: its axis used to read `1e-7+1`,
    its title ran into the figure's title, and tick labels into the next row's titles."""
    records = run_records("balanced")
    for r in records:
        r["ratio"] = 1.0 + (-1) ** r["step"] * 1.2e-7
    fig = Dashboard(notebook=False, title="a title").figure(records, {"affinity": 1})
    renderer = _boxes(fig)
    ratio = fig.axes[1]
    assert ratio.get_title() == "ratio (pi_theta / pi_old)"
    assert ratio.yaxis.get_offset_text().get_text() == ""  # no `1e-7+1`
    assert ratio.yaxis.get_major_formatter()(1.00000012) == "1.0000"
    labels = [t.get_text() for t in ratio.get_yticklabels() if t.get_text()]
    assert len(set(labels)) == len(labels) >= 3 and all(len(t.split(".")[1]) == 4 for t in labels)
    low, high = ratio.get_ylim()
    assert low <= 0.995 and high >= 1.005

    titles = [ax.title.get_window_extent(renderer) for ax in fig.axes]
    suptitle = fig._suptitle.get_window_extent(renderer)
    assert not any(box.overlaps(suptitle) for box in titles)
    ticks = [label.get_window_extent(renderer) for ax in fig.axes
             for label in ax.get_xticklabels() + [ax.xaxis.label] if label.get_text()]
    assert ticks and not any(t.overlaps(b) for t in ticks for b in titles)


def _metrics_server(text: str):
    """A loopback HTTP server answering GET /metrics with `text` (a replica's Prometheus page)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = text.encode() if self.path == "/metrics" else b""
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_replica_cache_stats_sums_the_replicas_prometheus_counters():
    from grpo_lab.watch.live_stats import replica_cache_stats, router_counters

    page = ("# TYPE vllm:prefix_cache_queries counter\n"
            'vllm:prefix_cache_queries_total{{engine="0",model_name="m"}} {q}\n'
            "# TYPE vllm:prefix_cache_hits counter\n"
            'vllm:prefix_cache_hits_total{{engine="0",model_name="m"}} {h}\n'
            "# TYPE vllm:prompt_tokens counter\n"
            'vllm:prompt_tokens_total{{engine="0",model_name="m"}} 999\n')
    servers = [_metrics_server(page.format(q=100, h=80)), _metrics_server(page.format(q=60, h=0))]
    try:
        urls = [f"http://127.0.0.1:{s.server_address[1]}" for s in servers]
        stats = replica_cache_stats(urls)
        assert stats == {"cache_queries": 160.0, "cache_hits": 80.0, "cache_hit_rate": 0.5,
                         "unreachable": []}
        dead = "http://127.0.0.1:9"  # nothing listens there: a replica that died
        assert replica_cache_stats([dead, urls[0]], timeout_s=1) == {
            "cache_queries": 100.0, "cache_hits": 80.0, "cache_hit_rate": 0.8,
            "unreachable": [dead]}
        assert replica_cache_stats(urls[1:])["cache_hit_rate"] == 0.0
        line = Dashboard.line([{"step": 1, "reward": 0.5}],
                              router_counters({"router": {"affinity": 3}, **stats}))
        assert "router affinity 3 cache_hit_rate 0.5" in line
    finally:
        for s in servers:
            s.shutdown()
