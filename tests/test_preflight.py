"""Preflight (grpo_lab.launch.preflight): the two CPU jobs run end to end as local processes and in
the HF Jobs emulator (tests/hf_jobs_emulator.py), whose mount rules give the lag and the missing
rename; a port that serves without the token, or a mount that never shows a write, fails."""

from __future__ import annotations

import json

import pytest
from hf_jobs_emulator import HfJobsEmulator

from grpo_lab.cli import launch as launch_cli
from grpo_lab.cli.main import main as grpo_lab_main
from grpo_lab.launch.preflight import (
    REPLICA,
    TRAINER,
    preflight_plan,
    report_from_results,
    run_preflight,
)
from grpo_lab.launch.recipe_config import RecipeConfig

TOKEN = "hf_emulated_token"
BUCKET_ID = "me/preflight"
LAG_S = 1.5
"""The emulated mount's lag: a write shows in another job's mount once it is this old."""
LAG_SLACK_S = 5.0
"""Above the lag, job B's poll (0.1 s) and two processes' scheduling on a busy 2-core host."""


def emulated(tmp_path, **knobs) -> tuple[HfJobsEmulator, dict]:
    """An emulator and the run_preflight keywords that send the HF Jobs plan to it."""
    emulator = HfJobsEmulator(tmp_path / "hf", host_env={"OMP_NUM_THREADS": "1"},
                              jobs_proxy_token=TOKEN, **knobs)  # the jobs proxy checks the token
    config = RecipeConfig(backend="hf-jobs", bucket=f"hf://buckets/{BUCKET_ID}", run_name="pf",
                          mount_path=str(emulator.bucket_dir(BUCKET_ID)), free_ports=True)
    options = {"config": config, "api": emulator, "read_bucket": emulator.read_bucket_file,
               "poll_s": 0.2, "timeout_s": 120, "watch_timeout_s": 30.0, "holds_s": (0.5,),
               "launcher_options": {"upload": emulator.upload,
                                    "exposed_url": emulator.exposed_url,
                                    "environ": {"HF_TOKEN": TOKEN}}}
    return emulator, options


def test_preflight_runs_end_to_end_as_local_processes(tmp_path):
    report = run_preflight(RecipeConfig(bucket=str(tmp_path / "bucket"), run_name="pf"),
                           run_dir=tmp_path / "run")
    assert report.ok, report.describe()
    checks = {f.check: f for f in report.findings}
    assert report.findings[0].check == "directory rename"
    assert checks["response hold"].message == "a response held 1 s came back (the longest tried)"
    assert "HTTP 200" in checks["reached with the token"].message
    assert "HTTP 401" in checks["refused without a token"].message
    assert "HTTP 401" in checks["refused with a wrong token"].message
    assert 0 <= report.sync_lag_s < 30  # seen at all, within job B's watch
    # Both results are in the bucket, written whole; the launcher stopped job B
    results = sorted(p.name for p in (tmp_path / "bucket" / "pf").glob("preflight-*/*.json"))
    assert results == ["probe.json", "replica-probe.json", "trainer-probe.json"]
    assert (tmp_path / "run" / "logs" / f"{REPLICA}.log").is_file()


def test_preflight_in_the_hf_jobs_emulator_measures_the_mount_lag(tmp_path):
    emulator, options = emulated(tmp_path, mount_lag_s=LAG_S)
    with emulator:
        report = run_preflight(**options)
        names = sorted(job.name for job in emulator.jobs.values())
        assert not any(emulator.running(job_id) for job_id in emulator.jobs)  # B cancelled
    assert report.ok, report.describe()
    # the emulated jobs proxy consumes the header, and the preflight passes all the same
    assert "ok   token inside the job: the Authorization header did not reach" in \
        report.describe()
    assert LAG_S <= report.sync_lag_s < LAG_S + LAG_SLACK_S
    assert names == [f"pf-preflight-{REPLICA}", f"pf-preflight-{TRAINER}"]
    trainer = json.loads(next(emulator.bucket_dir(BUCKET_ID).glob("pf/preflight-*/"
                                                                   "trainer-probe.json")).read_text())
    assert trainer["beacon"]["published_by"] == "rename"


def test_a_mount_without_rename_fails_first_and_the_recipe_never_starts(tmp_path, monkeypatch,
                                                                          capsys):
    emulator, options = emulated(tmp_path, mount_renames=False)
    config = options.pop("config")
    launched = []
    def run_in_emulator(config, **cli):  # the CLI's own keywords, then the emulator's
        options["launcher_options"].update(cli.pop("launcher_options"))
        return run_preflight(config, **cli, **options)

    monkeypatch.setattr(launch_cli, "run_preflight", run_in_emulator)
    monkeypatch.setattr(launch_cli, "launch_hf_jobs", lambda *a, **k: launched.append(a) or 0)
    with emulator:
        code = grpo_lab_main(["launch", "--backend", "hf-jobs", "--bucket", config.bucket,
                              "--mount-path", config.mount_path, "--run-name", "pf",
                              "--free-ports", "--replica-flavor", "cpu-basic",
                              "--trainer-flavor", "cpu-basic", "--preflight"])
        names = sorted(job.name for job in emulator.jobs.values())
    out, err = capsys.readouterr()
    assert code == 1 and launched == []  # the recipe's jobs were never submitted
    assert names == [f"pf-preflight-{REPLICA}", f"pf-preflight-{TRAINER}"]
    lines = out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("Preflight FAILED"))
    assert lines[first + 1].startswith("  FAIL directory rename: refused (OSError")
    assert "fix:" in lines[first + 2] and "recipe's jobs were not started" in err
    # The rest of the mount still works, and the beacon was written in place instead
    assert "ok   whole-file write" in out and "ok   mount visibility" in out


def _results(hold: dict | None = None, **reach) -> dict:
    works = {"ok": True, "error": None}
    answers = {"token": {"status": 200, "body": {"ok": True}},
               "no_token": {"status": 401}, "wrong_token": {"status": 401}, **reach}
    return {"mount": dict.fromkeys(("whole_file_write", "folder", "rename", "overwrite"), works),
            "reach": answers, **({"hold": hold} if hold else {})}


def test_a_port_that_serves_without_the_token_fails_the_report():
    seen = {"seen": True, "lag_s": 0.4}
    assert report_from_results(_results(), seen, 30).ok
    report = report_from_results(_results(no_token={"status": 200, "body": {"ok": True}},
                                          wrong_token={"status": 200, "body": {"ok": True}}),
                                 seen, 30)
    failed = [f.check for f in report.findings if not f.ok]
    assert failed == ["refused without a token", "refused with a wrong token"]
    assert all("--api-key" in f.fix for f in report.findings if not f.ok)
    refused = report_from_results(_results(token={"status": 401}), seen, 30)
    assert [f.check for f in refused.findings if not f.ok] == ["reached with the token"]


def test_the_report_does_not_depend_on_the_header_reaching_the_container():
    """On HF Jobs the jobs proxy checks the token; whether it forwards the header is a note."""
    seen = {"seen": True, "lag_s": 0.4}
    for forwarded in (True, False):
        report = report_from_results(
            _results(token={"status": 200, "body": {"ok": True, "bearer_seen": forwarded}}),
            seen, 30)
        assert report.ok
        note = [f.message for f in report.findings if f.check == "token inside the job"]
        assert note and ("did not reach" in note[0]) is not forwarded
    # job B checks the token itself only where nothing is in front of it: the local backend
    for backend, checks in (("local", True), ("hf-jobs", False)):
        pre = preflight_plan(RecipeConfig(backend=backend, bucket="hf://buckets/me/b"
                                          if backend == "hf-jobs" else None))
        replica = " ".join(pre.plan.jobs[0].command)
        assert ("--check-token" in replica) is checks, replica


def test_a_write_never_seen_or_a_missing_result_fails_the_report():
    report = report_from_results(_results(), {"seen": False, "lag_s": None}, 30)
    assert not report.ok and report.sync_lag_s is None
    assert [f.check for f in report.findings if not f.ok] == ["mount visibility"]
    missing = report_from_results(None, None, 30)
    assert [f.check for f in missing.findings] == ["trainer-probe", "replica-probe"]
    assert not missing.ok


@pytest.mark.parametrize("backend", ["local", "hf-jobs"])
def test_the_preflight_plan_is_two_cpu_jobs_on_the_bucket_read_write(backend):
    pre = preflight_plan(RecipeConfig(backend=backend, bucket="hf://buckets/me/b"
                                      if backend == "hf-jobs" else None, run_name="r"))
    assert pre.plan.names == [REPLICA, TRAINER]
    for job in pre.plan.jobs:
        assert job.flavor in ("local", "cpu-basic") and not job.volumes[0].read_only
        assert pre.token_env in job.secrets
    assert pre.plan[TRAINER].placeholders() == {REPLICA}
    if backend == "hf-jobs":  # the probes travel through the bucket, as the wheel does
        assert pre.plan.uploads[0][1] == f"{pre.folder}/probes.py"


def test_launch_preflight_only_checks_locally_and_starts_nothing_else(tmp_path, capsys):
    code = grpo_lab_main(["launch", "--bucket", str(tmp_path / "bucket"), "--run-name", "pf",
                          "--run-dir", str(tmp_path / "run"), "--preflight-only"])
    out = capsys.readouterr().out
    assert code == 0 and "Preflight: every check passed" in out
    logs = sorted(p.name for p in (tmp_path / "run").rglob("*.log"))
    assert logs == [f"{REPLICA}.log", f"{TRAINER}.log"]  # no replica, proxy or trainer of the run


def test_the_measured_mount_lag_feeds_the_forecast(tmp_path, monkeypatch, capsys):
    """`launch --preflight-only` on GPU flavors prints the plan's forecast with the lag the
    preflight measured in place of the blog's 2-4 s."""
    emulator, options = emulated(tmp_path, mount_lag_s=LAG_S)
    config = options.pop("config")
    reports = []

    def run_in_emulator(config, **cli):
        options["launcher_options"].update(cli.pop("launcher_options"))
        reports.append(run_preflight(config, **cli, **options))
        return reports[-1]

    monkeypatch.setattr(launch_cli, "run_preflight", run_in_emulator)
    with emulator:
        code = grpo_lab_main(["launch", "--backend", "hf-jobs", "--bucket", config.bucket,
                              "--mount-path", config.mount_path, "--run-name", "pf",
                              "--free-ports", "--preset", "blog", "--preflight-only"])
    out = capsys.readouterr().out
    assert code == 0 and reports[0].ok, out
    lag = reports[0].sync_lag_s
    assert LAG_S <= lag < LAG_S + LAG_SLACK_S
    assert "# forecast (grpo-lab plan's simulator" in out
    assert f"mount lag {lag:.2f} s (measured by a preflight)" in out


def test_a_missing_or_read_only_mount_is_named_in_the_report(tmp_path):
    """A job whose bucket is not mounted, or mounted read-only where it must write, says so in
    its log and exits; the report quotes the log where the job left no result."""
    import os
    import subprocess
    import sys

    from hf_jobs_emulator import MOUNTS_ENV, HfJobsEmulator

    from grpo_lab.launch import preflight_probes

    probe = [sys.executable, preflight_probes.__file__, "trainer", "--url", "http://127.0.0.1:9",
             "--token-env", "T"]
    gone = subprocess.run([*probe, "--dir", "/grpo-lab-no-such-mount/pf/preflight"],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "T": "x"})
    assert gone.returncode == 3 and "/grpo-lab-no-such-mount does not exist: the bucket is not " \
        "mounted" in gone.stdout, gone.stdout + gone.stderr
    emulator = HfJobsEmulator(tmp_path / "hf")
    ro = tmp_path / "bucket"
    ro.mkdir()
    env = {**os.environ, "T": "x", MOUNTS_ENV: f"{ro}=ro",
           "PYTHONPATH": os.pathsep.join([str(emulator.site_dir),
                                          os.environ.get("PYTHONPATH", "")])}
    read_only = subprocess.run([*probe, "--dir", str(ro / "pf")], capture_output=True, text=True,
                               timeout=60, env=env)
    assert read_only.returncode == 3 and "mounted read-only" in read_only.stdout, \
        read_only.stdout + read_only.stderr
    report = report_from_results(None, None, 30, logs={TRAINER: read_only.stdout})
    missing = next(f for f in report.findings if f.check == "trainer-probe")
    assert "its log ends: [trainer-probe] cannot write in the bucket mount" in missing.message


def test_the_response_hold_names_the_limit_a_completion_must_meet():
    """Job A asks job B to hold its answer 30, 90, then 180 s; a path that cuts the 180 s one
    (a proxy's hold limit) is named with the limit it leaves a completion, and a path that cuts
    even the shortest fails the preflight."""
    cut = report_from_results(_results(hold={"longest_held_s": 90.0, "cut_at_s": 180.0}),
                              {"seen": True, "lag_s": 1.0}, 30)
    hold = next(f for f in cut.findings if f.check == "response hold")
    assert hold.ok and cut.ok and "a completion must return within ~90 s" in hold.message
    none = report_from_results(_results(hold={"longest_held_s": None, "cut_at_s": 30.0}),
                               {"seen": True, "lag_s": 1.0}, 30)
    assert not none.ok and [f.check for f in none.findings if not f.ok] == ["response hold"]
