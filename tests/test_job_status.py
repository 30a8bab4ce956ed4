"""grpo_lab_course.job_status: reading a run of separate jobs from outside (notebook 07)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import matplotlib
import pytest

from grpo_lab_course.job_status import (
    adapters,
    last_step,
    loaded_versions,
    parse_counters,
    plot_resume,
    replica_report,
    resume_series,
    sampler_kl,
)

matplotlib.use("Agg")

METRICS = """# HELP vllm:prompt_tokens_total Prompt tokens.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="tiny"} 70.0
vllm:prompt_tokens_total{model_name="policy-v3"} 30.0
# HELP vllm:prefix_cache_hits_total Hits.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{model_name="tiny"} 12.0
# HELP vllm:num_requests_running Running.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="tiny"} 2.0
"""


def test_counters_are_summed_over_labels_and_gauges_left_out():
    assert parse_counters(METRICS) == {"vllm:prompt_tokens_total": 100.0,
                                       "vllm:prefix_cache_hits_total": 12.0}


def test_last_step_skips_a_line_still_being_written(tmp_path):
    assert last_step(tmp_path) == 0  # no metrics.jsonl yet
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1, "loss": 0.1}\n{"step": 2}\n'
                                            '{"step": 3, "lo')
    assert last_step(tmp_path) == 2


def test_loaded_versions_reads_vllm_log_lines_once_each(tmp_path):
    log = tmp_path / "replica-0.log"
    log.write_text("INFO Loaded new LoRA adapter: name 'policy-v2', path '/b/policy-v2'\n"
                   "INFO something else\n"
                   "INFO Loaded new LoRA adapter: name 'policy-v0', path '/b/policy-v0'\n"
                   "INFO Loaded new LoRA adapter: name 'policy-v2', path '/b/policy-v2'\n"
                   "INFO Loaded new LoRA adapter: name 'other-v9', path '/b/other'\n")
    assert loaded_versions(log) == [0, 2]


RECORDS = [{"step": 0, "eval/accuracy": 0.3},
           {"step": 1, "version": 1, "kl": 1e-9, "ratio": 1.0, "sample/staleness_mean": 0.0},
           {"step": 2, "version": 2, "kl": 2e-4, "ratio": 0.999, "sample/staleness_mean": 1.0},
           {"step": 3, "version": 5, "kl": 4e-4, "ratio": 1.002, "sample/staleness_mean": 0.5}]


def test_sampler_kl_averages_the_stale_steps_only():
    kl = sampler_kl(RECORDS)
    assert kl["stale_steps"] == 2 and kl["kl_stale_mean"] == pytest.approx(3e-4)
    assert kl["kl_max"] == 4e-4 and kl["ratio_dev_max"] == pytest.approx(0.002)


def test_the_resume_figure_draws_the_records_versions_and_staleness():
    data = resume_series(RECORDS)
    assert data == {"step": [1, 2, 3], "version": [1, 2, 5], "staleness": [0.0, 1.0, 0.5]}
    fig = plot_resume(RECORDS, killed_at=3, resumed_from="step-000002", max_staleness=1)
    left, right = fig.axes
    assert list(left.lines[0].get_ydata()) == [0, 0, 2]  # version - step: 2 ahead after resuming
    assert list(right.lines[0].get_ydata()) == [0.0, 1.0, 0.5]
    assert any("trained twice" in t.get_text() for t in left.get_legend().get_texts())


class _Server(BaseHTTPRequestHandler):
    routes: dict[str, tuple[str, str]] = {}

    def do_GET(self):  # noqa: N802 (http.server's name)
        ctype, body = self.routes[self.path]
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def test_replica_report_asks_each_replica_and_the_proxy():
    models = {"data": [{"id": "tiny"}, {"id": "policy-v4"}, {"id": "policy-v5"}]}
    _Server.routes = {"/v1/models": ("application/json", json.dumps(models)),
                      "/metrics": ("text/plain", METRICS)}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Server)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert adapters(url) == ["policy-v4", "policy-v5"]  # the base model is not an adapter
        report = replica_report(url, [url, url])
    finally:
        server.shutdown()
    assert report["served"] == ["policy-v4", "policy-v5"]
    assert report["held"] == [report["served"]] * 2
    assert report["prompt_tokens"] == [100.0, 100.0] and report["cache_hits"] == 24.0
    assert report["requests"] == 0.0  # grpo-lab serve writes no request_success counter


def test_kill_at_sigkills_the_job_once_at_its_step():
    import subprocess
    import sys

    from grpo_lab.cli.multi_job import KillAt

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            start_new_session=True)  # its own process group, as a job's

    class Launcher:
        procs = {"replica-0": proc}

    kill = KillAt("replica-0", 3)
    try:
        kill(Launcher, {"step": 2})
        assert proc.poll() is None and kill.killed_at is None
        kill(Launcher, {"step": 4})
        assert proc.wait(timeout=10) == -9 and kill.killed_at == 4
        kill(Launcher, {"step": 5})  # once: the group is gone, no second kill
        assert kill.killed_at == 4
    finally:
        if proc.poll() is None:
            proc.kill()
