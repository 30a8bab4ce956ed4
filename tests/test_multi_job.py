"""The multi-job main job (`grpo-lab demo --jobs local`): a trainer, two replicas and the proxy
as separate processes, adapters through a local bucket folder; and a replica killed mid-run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from real_vllm import require_vllm

from grpo_lab.cli.multi_job import MULTI_JOB_DEFAULTS, run_multi_job_demo
from grpo_lab.train.async_config import AsyncGRPOConfig

pytestmark = pytest.mark.slow  # each test runs the whole demo as separate processes


def test_demo_jobs_local_gains_at_least_10_points(tmp_path):
    """The main job as a user runs it, with a goal as its exit status: +10 points, what every
    measured build of the tiny model reaches (+13.5 to +20.7; the demo itself aims at +20)."""
    run_dir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_lab.cli", "demo", "--jobs", "local", "--min-gain", "0.10",
         "--output-dir", str(run_dir), "--progress", "false"],
        capture_output=True, text=True, timeout=600, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["accuracy_gain"] >= 0.10 and "greedy accuracy gain >= +10 points" in proc.stdout
    steps = MULTI_JOB_DEFAULTS["steps"]
    assert summary["steps"] == steps
    assert summary["syncs"] == steps + 1  # version 0, then one per step
    assert summary["staleness_max"] <= 1
    assert 0.9 < summary["ratio_min"] <= summary["ratio_max"] < 1.1
    assert sum(summary["router"]["routed"]) >= steps * 16 and min(summary["router"]["routed"]) > 0
    # 4-token blocks make the 7-token prompts routable: some requests follow their prefix, and
    # the replicas read whole blocks from their prefix caches (issue 15's acceptance)
    assert summary["router"]["affinity"] > 0, summary["router"]
    assert summary["prefix_cache"]["cache_hits"] > 0, summary["prefix_cache"]
    train = run_dir / "bucket" / "train"
    for path in (run_dir / "pipeline.png", run_dir / "training.png", train / "metrics.jsonl",
                 train / "adapter" / "adapter_model.safetensors", run_dir / "logs" / "proxy.log"):
        assert path.exists(), path
    assert (train / "adapters" / f"policy-v{steps}" / "adapter_model.safetensors").exists()
    # the healthy main job: the trainer's run doctor names nothing (no false alarm), and then
    # `grpo-lab doctor` on its trainer's folder says so too
    assert summary["findings"] == [], summary["findings"]
    assert "no findings" in proc.stdout, proc.stdout[-2000:]
    doctor = subprocess.run([sys.executable, "-m", "grpo_lab.cli", "doctor", str(train)],
                            capture_output=True, text=True, timeout=120)
    assert doctor.returncode == 0 and doctor.stdout.strip().endswith("no findings"), doctor.stdout


def test_a_folder_that_holds_a_demo_run_is_refused_and_kept(tmp_path):
    """Its trainer would resume the old run's last checkpoint (perhaps of another build of the
    model) and report that run's accuracy as this one's: a clear error instead, nothing
    started, nothing touched."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "plan.json").write_text("{}")
    config = AsyncGRPOConfig(steps=2, output_dir=str(run), progress=False)
    with pytest.raises(ValueError, match="already holds a demo run"):
        run_multi_job_demo(config, timeout_s=30)
    assert sorted(p.name for p in run.iterdir()) == ["plan.json"]
    assert (run / "plan.json").read_text() == "{}"


def test_a_replica_killed_mid_run_is_taken_out_and_training_finishes(tmp_path):
    killed = {}

    def kill_replica_0(launcher, record):
        if record["step"] >= 12 and not killed:
            killed["step"] = record["step"]
            os.killpg(launcher.procs["replica-0"].pid, signal.SIGKILL)

    # Shrunken: 40 steps, 64 held-out problems.
    config = AsyncGRPOConfig(steps=40, eval_size=64, eval_every=0, max_staleness=1,
                             output_dir=str(tmp_path / "run"), progress=False)
    s = run_multi_job_demo(config, on_step=kill_replica_0, min_gain=0.0, timeout_s=300)
    assert killed and killed["step"] < 40
    assert s["steps"] == 40 and s["syncs"] == 41
    assert s["status"]["replica-0"] == "killed (signal 9)"
    assert s["status"]["trainer"] == "exited (0)"
    assert s["proxy"]["marked_down"] == 1 and len(s["proxy"]["down_reasons"]) == 1
    routed = s["router"]["routed"]
    assert routed[1] > routed[0] > 0  # the survivor served the rest
    # Every rollout accounted once: each trained step took 16 groups; what was generated but
    # not trained is in the buffer or was dropped; requests beyond that are the batch being
    # generated when the trainer stopped, requests sent again after a 5xx, and prompts the
    # proxy routed again itself after the dead replica refused the connection (`rerouted`).
    groups = s["groups"]
    assert groups["delivered"] == 40 * 16 and groups["lost_on_resume"] == 0
    assert groups["enqueued"] >= groups["delivered"] + groups["dropped_stale"]
    assert groups["enqueued"] - groups["delivered"] - groups["dropped_stale"] <= 16
    assert groups["enqueued"] <= sum(routed) <= (groups["enqueued"] + 16 + s["retried_requests"]
                                                 + s["proxy"]["rerouted"])


def test_demo_summary_states_each_target_met_or_not():
    from grpo_lab.cli.multi_job import DEMO_TARGETS, demo_verdicts

    run = {"accuracy_gain": 0.25, "train_s": DEMO_TARGETS["train_s"] + 1, "startup_s": 3.0}
    gain, train, startup = demo_verdicts(run, min_gain=0.20)
    assert gain.endswith("(met)") and "+25.0" in gain
    assert train.endswith("(NOT met)") and startup.endswith("(met)")
    assert demo_verdicts({**run, "accuracy_gain": 0.19}, min_gain=0.20)[0].endswith("(NOT met)")
    # the time targets are the tiny model's demo's: another model's run is judged on its gain
    real = demo_verdicts({**run, "model": "smollm2-135m", "train_s": 388}, min_gain=0.20)
    assert real[0].endswith("(met)") and "no target" in real[1] and len(real) == 2


def test_demo_with_real_vllm_replicas_trains_through_the_proxy_and_the_bucket(tmp_path):
    """`grpo-lab demo --engine vllm`: the same jobs with real vLLM (its CPU build) as replicas.
    Every step's adapter goes through the bucket folder and the proxy's all-or-nothing load into
    both vLLM engines (pause, load, resume), and the trainer still gains. vLLM's CPU attention
    takes 16-token blocks only, so the tiny 7-token prompts fill none: its prefix-cache counters
    show the prompt tokens queried and no hits (benchmarks/routing_cache.py --engine vllm has the
    affinity figures on longer prompts)."""
    require_vllm()  # skips without vLLM; fails under GRPO_LAB_REQUIRE_VLLM=1
    run_dir = tmp_path / "demo-vllm"
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_lab.cli", "demo", "--engine", "vllm", "--min-gain", "0.10",
         "--output-dir", str(run_dir), "--progress", "false"],
        capture_output=True, text=True, timeout=900, env={**os.environ})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["engine"] == "vllm" and summary["accuracy_gain"] >= 0.10
    steps = MULTI_JOB_DEFAULTS["steps"]
    assert summary["steps"] == steps and summary["syncs"] == steps + 1
    assert min(summary["router"]["routed"]) > 0 and not any(summary["proxy"]["errors"].values())
    assert summary["prefix_cache"]["cache_queries"] >= steps * 16 * 7  # vLLM's own counters
    for i in range(2):  # the replicas were vLLM, and each loaded the last version
        log = (run_dir / "logs" / f"replica-{i}.log").read_text(errors="replace")
        assert "vLLM API server" in log or "vllm" in log.lower(), log[-2000:]
        assert f"Loaded new LoRA adapter: name 'policy-v{steps}'" in log, log[-3000:]


def test_a_flag_given_to_the_demo_wins_even_where_it_equals_the_config_default():
    """`grpo-lab demo --steps 200 --temperature 1.0` runs 200 steps at 1.0 (the demo's own
    defaults, 145 and 0.7, are for flags not given), and the trainer job's argv carries both."""
    from grpo_lab.cli.main import build_parser
    from grpo_lab.cli.multi_job import multi_job_config, trainer_flags

    args = build_parser().parse_args(["demo", "--steps", "200", "--temperature", "1.0"])
    config = multi_job_config(args)
    assert (config.steps, config.temperature) == (200, 1.0)
    assert config.learning_rate == MULTI_JOB_DEFAULTS["learning_rate"]  # not given: the demo's
    assert AsyncGRPOConfig().temperature == 1.0 != MULTI_JOB_DEFAULTS["temperature"]
    job = build_parser().parse_args(["train-async", *trainer_flags(config)])
    assert (job.steps, job.temperature, job.learning_rate) == (200, 1.0, 2e-3)
    plain = multi_job_config(build_parser().parse_args(["demo"]))
    assert (plain.steps, plain.temperature) == (145, 0.7)
