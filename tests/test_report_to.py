"""`report_to`, as TRL's: the records of metrics.jsonl sent to trackio and TensorBoard as well.

A short `grpo-lab train` run is read back through trackio's own storage API and TensorBoard's
EventAccumulator (every step, the same values as metrics.jsonl); a `grpo-lab train-async` run
resumed with `--resume` appends to the same trackio run; `trackio show`'s dashboard, loaded in
headless Chromium, shows the run. trackio keeps its SQLite file under TRACKIO_DIR (a temporary
folder here; it reads the variable once, when imported: every run and read is a subprocess).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from grpo_lab.cli.main import build_parser
from grpo_lab.launch.recipe_plan import recipe_plan
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.config import GRPOConfig
from grpo_lab.util.files import read_jsonl
from grpo_lab.util.processes import free_port, stop_groups
from grpo_lab.watch.reporters import report_targets

trackio = pytest.importorskip("trackio",
                              reason="the `tracking` extra: pip install -e '.[tracking]'")

PROJECT = "report-to-test"
# Shrunken run: 2 prompts x G=2 per step, 8 held-out problems, evaluated at the ends only.
SMALL = ["--prompts-per-step", "2", "--num-generations", "2", "--eval-size", "8",
         "--eval-every", "0", "--progress", "false", "--log-completions-every", "0",
         "--project", PROJECT]
READ_LOGS = """
import json, sys
from trackio.sqlite_storage import SQLiteStorage
print(json.dumps({"runs": SQLiteStorage.get_runs(sys.argv[1]),
                  "logs": SQLiteStorage.get_logs(sys.argv[1], sys.argv[2])}))
"""
"""Reads a run back through trackio's storage API (trackio.sqlite_storage), in a process whose
TRACKIO_DIR is the test's."""


def tracked_env(trackio_dir: Path) -> dict:
    return {**os.environ, "TRACKIO_DIR": str(trackio_dir), "BROWSER": "true"}


def trackio_run(trackio_dir: Path, run: str) -> tuple[list[str], list[dict]]:
    """(the project's run names, the run's logs without trackio's timestamps)."""
    out = subprocess.run([sys.executable, "-c", READ_LOGS, PROJECT, run], capture_output=True,
                         text=True, timeout=120, env=tracked_env(trackio_dir), check=True)
    read = json.loads(out.stdout)
    return read["runs"], [{k: v for k, v in log.items() if k != "timestamp"}
                          for log in read["logs"]]


def train(out: Path, trackio_dir: Path, *flags: str, command: str = "train") -> None:
    result = subprocess.run([sys.executable, "-m", "grpo_lab.cli", command,
                             "--output-dir", str(out), *SMALL, *flags], capture_output=True,
                            text=True, timeout=300, env=tracked_env(trackio_dir))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]


# -- the settings ---------------------------------------------------------------------------------
@pytest.mark.parametrize("value, targets", [
    ("none", []), (None, []), ("trackio", ["trackio"]), ("trackio,tensorboard", ["trackio",
     "tensorboard"]), (["tensorboard"], ["tensorboard"]), ("['trackio']", ["trackio"]),
    ("all", ["trackio", "tensorboard"]), ("TrackIO, none", ["trackio"])])
def test_report_to_takes_one_or_several_names(value, targets):
    assert report_targets(value) == targets


def test_report_to_settings_fail_at_construction_and_name_the_run(tmp_path):
    with pytest.raises(ValueError, match="unknown report_to"):
        GRPOConfig(report_to="wandb")
    with pytest.raises(ValueError, match="set output_dir"):
        GRPOConfig(report_to="tensorboard")
    config = GRPOConfig(report_to="trackio,tensorboard", output_dir=str(tmp_path / "my-run"))
    assert config.report_to == ["trackio", "tensorboard"]
    assert (config.run_name, config.effective_run_name) == (None, "my-run")
    assert GRPOConfig.from_dict(config.to_dict()) == config
    assert GRPOConfig().report_to == [] and GRPOConfig().effective_run_name is None
    assert GRPOConfig(output_dir="x", run_name="mine").effective_run_name == "mine"


@pytest.mark.parametrize("command", ["train", "train-async", "train-trl-async", "demo", "launch"])
def test_every_training_command_takes_report_to(command):
    args = build_parser(command).parse_args(
        [command, "--report-to", "trackio,tensorboard", "--trackio-space-id", "me/dash"]
        + (["--server-url", "http://x"] if command.startswith("train-") else []))
    assert (args.report_to, args.trackio_space_id) == ("trackio,tensorboard", "me/dash")


def test_the_demos_jobs_pass_report_to_and_the_run_name_to_their_trainer():
    from grpo_lab.cli.flags import config_from_args
    from grpo_lab.cli.multi_job import trainer_flags

    config = AsyncGRPOConfig(report_to="trackio,tensorboard", output_dir="runs/x",
                             run_name="demo-jobs-1")
    args = build_parser("train-async").parse_args(
        ["train-async", "--server-url", "http://x", "--output-dir", "bucket/train",
         *trainer_flags(config)])
    trainer = config_from_args(args, AsyncGRPOConfig)
    assert (trainer.report_to, trainer.run_name) == (["trackio", "tensorboard"], "demo-jobs-1")


def test_the_plan_passes_report_to_and_the_space_to_the_trainer(tmp_path):
    local = recipe_plan(bucket=str(tmp_path), run_name="r", report_to="trackio")
    args = build_parser("train-async").parse_args(local["trainer"].command[3:])
    assert args.report_to == "trackio" and args.trackio_space_id is None
    assert AsyncGRPOConfig(output_dir=args.output_dir).effective_run_name == "r"  # the plan's
    hf = dict(backend="hf-jobs", bucket="hf://buckets/me/b", run_name="r", report_to="trackio")
    with pytest.raises(ValueError, match="trackio-space-id"):  # the job's disk goes with it
        recipe_plan(**hf)
    for trainer in ("grpo-lab", "trl"):
        script = recipe_plan(**hf, trackio_space_id="me/dash", trainer=trainer)["trainer"]
        line = script.command[-1].splitlines()[-1]  # exec <the trainer>
        assert "--report-to trackio --trackio-space-id me/dash" in line, line
        # the wheel with its tracking extra (and TRL's trainer with the trl extra too)
        extras = {"grpo-lab": "[tracking]'", "trl": "[trl,tracking]'"}[trainer]
        assert extras in script.command[-1], script.command[-1]
    assert "--report-to" not in " ".join(recipe_plan(bucket=str(tmp_path))["trainer"].command)


def test_trl_job_hands_report_to_to_trls_config(tmp_path):
    from grpo_lab.trl.async_job import TrlAsyncJobConfig
    from grpo_lab.trl.async_trainer import trl_config

    job = TrlAsyncJobConfig(server_url="http://127.0.0.1:9")
    config = AsyncGRPOConfig(report_to="trackio", output_dir=str(tmp_path / "run"),
                             trackio_space_id="me/dash")
    args = trl_config(config, job, tmp_path / "run" / "trl", "cpu", 12)
    assert args.report_to == ["trackio"] and args.run_name == "run"
    assert (args.project, args.trackio_space_id) == ("grpo-lab", "me/dash")
    assert trl_config(AsyncGRPOConfig(), job, tmp_path, "cpu", 12).report_to == []


# -- a run read back ------------------------------------------------------------------------------
def test_a_run_reads_back_from_trackio_and_tensorboard_as_in_metrics_jsonl(tiny_model_dir,
                                                                            tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out, trackio_dir = tmp_path / "sync-run", tmp_path / "trackio"
    train(out, trackio_dir, "--model", str(tiny_model_dir), "--steps", "3",
          "--report-to", "trackio,tensorboard")
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    runs, logs = trackio_run(trackio_dir, "sync-run")  # named after the output folder
    assert runs == ["sync-run"]
    assert logs == records  # every step, every value, as metrics.jsonl has them
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    for key in ("reward", "loss", "eval/accuracy", "perf/step_s"):
        expected = [(r["step"], r[key]) for r in records if key in r]
        got = [(e.step, e.value) for e in events.Scalars(key)]
        assert got == [(s, pytest.approx(v, rel=1e-6)) for s, v in expected], key  # float32
    assert set(events.Tags()["scalars"]) == {k for r in records for k in r if k != "step"}


def test_a_reused_output_dir_is_a_new_trackio_run_and_new_tensorboard_curves(tiny_model_dir,
                                                                           tmp_path):
    out, trackio_dir = tmp_path / "again", tmp_path / "trackio"
    for _ in range(2):
        train(out, trackio_dir, "--model", str(tiny_model_dir), "--steps", "1",
              "--report-to", "trackio,tensorboard")
    runs, logs = trackio_run(trackio_dir, "again-2")
    assert runs == ["again", "again-2"]  # not two runs of one name
    assert logs == read_jsonl(out / "metrics.jsonl")  # the second run only
    assert (out / "earlier-runs" / "1" / "tensorboard").is_dir()


@pytest.fixture
def server(server_process):
    return server_process(enable_lora=True, max_lora_rank=1, max_loras=4,
                          logprobs_mode="processed_logprobs")


def test_a_resumed_train_async_run_appends_to_the_same_trackio_run(server, tmp_path):
    out, trackio_dir = tmp_path / "async-run", tmp_path / "trackio"
    flags = ("--server-url", server.url, "--checkpoint-every", "2", "--max-staleness", "1",
             "--report-to", "trackio,tensorboard")
    train(out, trackio_dir, "--steps", "2", *flags, command="train-async")
    _, first = trackio_run(trackio_dir, "async-run")
    assert [log["step"] for log in first] == [0, 1, 2]
    # Resumed with its logs appended in a --local-dir (as on a bucket mount): seeded from the
    # run folder, tensorboard/ included, and copied back whole.
    train(out, trackio_dir, "--steps", "4", "--resume", "--local-dir", str(tmp_path / "local"),
          *flags, command="train-async")
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    runs, logs = trackio_run(trackio_dir, "async-run")
    assert runs == ["async-run"] and logs[:3] == first  # one run, continued
    assert logs == records
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))  # both attempts' event files
    events.Reload()
    assert [e.step for e in events.Scalars("reward")] == [1, 2, 3, 4]


# -- the dashboard --------------------------------------------------------------------------------
SERVE_S, PAGE_S = 90, 60
"""Bounds: `trackio show` answering; the page showing the run."""


@pytest.mark.slow
def test_trackio_show_serves_the_run_to_headless_chromium(tiny_model_dir, tmp_path):
    from test_dashboard_browser import require_browser

    sync_playwright, chromium = require_browser()
    out, trackio_dir = tmp_path / "shown-run", tmp_path / "trackio"
    train(out, trackio_dir, "--model", str(tiny_model_dir), "--steps", "2", "--report-to",
          "trackio")
    port = free_port()
    log_path = tmp_path / "trackio-show.log"
    # Loopback only (trackio's default host); BROWSER=true: it opens no browser of its own.
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trackio.cli", "show", "--project", PROJECT],
            env={**tracked_env(trackio_dir), "GRADIO_SERVER_PORT": str(port)},
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + SERVE_S
        while True:
            assert proc.poll() is None, f"trackio show exited:\n{log_path.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(url, timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                assert time.monotonic() < deadline, (
                    f"trackio show did not answer in {SERVE_S} s:\n{log_path.read_text()}")
                time.sleep(0.5)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, headless=True)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.set_default_timeout(PAGE_S * 1000)
            try:
                page.goto(f"{url}?project={PROJECT}")
                # The project's one run in the sidebar, and a chart per metric of the records.
                page.wait_for_function(
                    "() => { const t = document.body.innerText;"
                    " return t.includes('Runs (1)') && t.includes('shown-run')"
                    " && t.includes('mean_length') && t.includes('reward_std'); }")
                text = page.inner_text("body")
            except Exception as exc:  # the bounded wait ran out: show what the browser showed
                shot = tmp_path / "failed.png"
                page.screenshot(path=str(shot), full_page=True)
                raise AssertionError(f"{type(exc).__name__}: {exc}\nscreenshot: {shot}; "
                                     f"log: {log_path}") from exc
            finally:
                browser.close()
    finally:
        stop_groups([proc], grace_s=15)
    assert proc.poll() is not None
    for name in ("reward", "loss", "ratio", "accuracy", "step_s"):  # eval/accuracy, perf/step_s
        assert name in text.split(), name
