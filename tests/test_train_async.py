"""`grpo-lab train-async`, the trainer job, as a real subprocess against a real server process:
its run folder, the recipe's trainer command, and resuming after a SIGKILL."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from grpo_lab.cli.flags import config_from_args
from grpo_lab.cli.main import build_parser
from grpo_lab.launch.recipe_plan import recipe_plan
from grpo_lab.train.async_job import TrainAsyncJobConfig
from grpo_lab.util.files import read_jsonl

# Shrunken run: 4 prompts x G=4 per step, 32 held-out problems, no mid-run evaluation.
SMALL = ["--prompts-per-step", "4", "--num-generations", "4", "--eval-size", "32",
         "--eval-every", "0", "--max-staleness", "1", "--progress", "false", "--log-every", "5"]


@pytest.fixture
def server(server_process):
    return server_process(enable_lora=True, max_lora_rank=1, max_loras=4,
                          logprobs_mode="processed_logprobs")


def trainer_command(url: str, out: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "grpo_lab.cli", "train-async", "--server-url", url,
            "--output-dir", str(out), "--steps", str(steps), *SMALL, *extra]


def assert_bucket_clean(bucket: Path) -> None:
    """No hidden temp dir anywhere; every published adapter and checkpoint is complete."""
    assert not [p for p in bucket.rglob(".*tmp-*")], list(bucket.rglob(".*tmp-*"))
    for adapter in bucket.glob("policy-v*"):
        files = {p.name for p in adapter.iterdir()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    for ckpt in (bucket / "checkpoints").glob("step-*"):
        files = {p.name for p in ckpt.iterdir()}
        assert {"adapter", "optimizer.pt", "state.json", "rng.pt"} <= files


def test_train_async_writes_metrics_syncs_adapters_and_accuracy(server, tmp_path):
    out = tmp_path / "run"
    result = subprocess.run(trainer_command(server.url, out, 4, "--checkpoint-every", "2"),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["version"] == 4 and summary["syncs"] == 5
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    # greedy accuracy on the 32 held-out problems: before the first step, after the last one
    evaluated = [(r["step"], r["eval/accuracy"]) for r in records if "eval/accuracy" in r]
    assert evaluated == [(0, summary["accuracy_before"]), (4, summary["accuracy_after"])]
    for _, accuracy in evaluated:  # a count of right answers out of 32
        assert 0 <= accuracy <= 1 and accuracy * 32 == round(accuracy * 32), accuracy
    for key in ("perf/weight_sync_s", "sample/staleness_mean", "sample/staleness_max",
                "sample/rollout_queue_size", "perf/rollout_wait_s", "reward", "ratio",
                "rollout/vllm_retry_total"):
        assert key in records[-1], key
    for r in records[1:]:  # MFU in percent, as TRL logs it (grpo_lab.watch.flops)
        assert 0 < r["perf/mfu_wall_clock"] <= r["perf/mfu_fwd_bwd"], r
    assert [s["version"] for s in read_jsonl(out / "syncs.jsonl")] == [0, 1, 2, 3, 4]
    assert (out / "adapter" / "adapter_model.safetensors").exists()
    assert (out / "adapters" / "policy-v4").is_dir()
    assert sorted(p.name for p in (out / "adapters" / "checkpoints").iterdir()) == \
        ["step-000002", "step-000004"]
    assert_bucket_clean(out / "adapters")
    # The server holds this run's newest max_staleness + 1 versions.
    import urllib.request

    with urllib.request.urlopen(server.url + "/v1/models", timeout=10) as reply:
        names = [m["id"] for m in json.load(reply)["data"]]
    assert {"policy-v3", "policy-v4"} <= set(names)
    # A second fresh start into the same bucket is refused (it would reuse version names).
    again = subprocess.run(trainer_command(server.url, out, 4), capture_output=True, text=True,
                           timeout=240)
    assert again.returncode == 2 and "--resume" in again.stderr


def test_recipe_plan_trainer_command_is_a_valid_train_async_call(tmp_path):
    plan = recipe_plan(bucket=str(tmp_path / "bucket"), run_name="r1")
    command = plan["trainer"].command
    args = build_parser().parse_args(command[3:])
    assert args.command == "train-async" and args.resume
    assert args.server_url.startswith("http://127.0.0.1:")
    assert args.bucket == f"{tmp_path / 'bucket'}/r1/adapters" and args.max_staleness == 4


def test_request_shape_is_a_train_async_flag():
    base = ["train-async", "--server-url", "http://127.0.0.1:9"]
    args = build_parser().parse_args([*base, "--request-shape", "single"])
    assert config_from_args(args, TrainAsyncJobConfig).request_shape == "single"
    args = build_parser().parse_args(base)
    assert config_from_args(args, TrainAsyncJobConfig).request_shape == "group"  # n = G
    with pytest.raises(ValueError, match="request_shape"):
        config_from_args(build_parser().parse_args([*base, "--request-shape", "n1"]),
                         TrainAsyncJobConfig)


def test_the_groups_counts_read_the_buffers_counters():
    from grpo_lab.rollout.buffer import RolloutBuffer
    from grpo_lab.train.async_job import BUFFER_COUNTERS

    assert set(BUFFER_COUNTERS.values()) <= set(RolloutBuffer(2, 0).stats())


@pytest.mark.slow
def test_sigkill_mid_run_then_resume_finishes_without_version_gap(server, tmp_path):
    """As on HF Jobs (the run folder on a bucket mount): logs in a --local-dir, copied whole
    into the run folder; the restarted job, on a fresh machine, has an empty --local-dir."""
    out, steps = tmp_path / "run", 24
    first_local = tmp_path / "first-local"
    log = (tmp_path / "first.log").open("wb")
    proc = subprocess.Popen(trainer_command(server.url, out, steps, "--checkpoint-every", "3",
                                            "--local-dir", str(first_local)),
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:  # kill once a checkpoint exists and a few steps were done after it
            metrics = first_local / "metrics.jsonl"
            done = read_jsonl(metrics) if metrics.exists() else []
            if done and done[-1]["step"] >= 8:
                break
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the trainer made no progress"
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
    assert proc.returncode == -signal.SIGKILL
    killed_at = read_jsonl(first_local / "metrics.jsonl")[-1]["step"]
    assert killed_at < steps
    published = read_jsonl(out / "metrics.jsonl")  # as of the last checkpoint
    assert published[-1]["step"] % 3 == 0 and published[-1]["step"] <= killed_at

    result = subprocess.run(trainer_command(server.url, out, steps, "--checkpoint-every", "3",
                                            "--resume", "--local-dir", str(tmp_path / "new")),
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == steps and summary["resumed_from"].startswith("step-")
    resumed_at = int(summary["resumed_from"].split("-")[1])
    assert resumed_at % 3 == 0 and 6 <= resumed_at <= killed_at
    # Every step logged exactly once, in order; accuracy before comes from the first attempt.
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(steps + 1))
    assert summary["accuracy_before"] == records[0]["eval/accuracy"]
    # Versions 0..N published exactly once each: no gap, no reused name.
    versions = [s["version"] for s in read_jsonl(out / "syncs.jsonl")]
    assert versions == list(range(len(versions))) and versions[-1] == summary["version"]
    assert summary["version"] >= steps  # one sync per step, plus the resume's re-registration
    assert_bucket_clean(out / "adapters")
    groups = summary["groups"]  # counters carried over by the checkpoint: each group once
    assert groups["delivered"] == steps * 4
    assert groups["enqueued"] >= groups["delivered"] + groups["dropped_stale"]


def test_resume_without_a_checkpoint_restarts_at_step_0_after_the_published_versions(server,
                                                                                      tmp_path):
    """Killed before its first checkpoint: the same command (with --resume) starts over, and
    the versions go on after those already in the bucket (no reused name)."""
    out = tmp_path / "run"
    first = subprocess.run(trainer_command(server.url, out, 2, "--checkpoint-every", "0"),
                           capture_output=True, text=True, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    again = subprocess.run(trainer_command(server.url, out, 3, "--checkpoint-every", "0",
                                           "--resume"), capture_output=True, text=True, timeout=240)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["resumed_from"] is None and summary["version"] == 6
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [0, 1, 2, 3]
    assert [s["version"] for s in read_jsonl(out / "syncs.jsonl")] == list(range(7))
    assert_bucket_clean(out / "adapters")
