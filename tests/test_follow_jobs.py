"""Following and cancelling a run on Hugging Face Jobs (grpo_lab.launch.follow), against a stand-in
for HfApi's jobs methods: no network, no token, stages that progress on a script."""

from __future__ import annotations

import inspect
import json
from itertools import count

import pytest
from huggingface_hub import HfApi, JobInfo
from huggingface_hub._jobs_api import TERMINAL_JOB_STAGES

from grpo_lab.cli.main import main
from grpo_lab.launch import follow, hf_jobs
from grpo_lab.launch.follow import ENDED_STAGES, cancel_run, follow_run, run_record_path
from grpo_lab.launch.hf_jobs import RUN_LABEL, HfJobsLauncher, exposed_url
from grpo_lab.launch.recipe_config import RecipeConfig
from grpo_lab.launch.recipe_plan import recipe_plan

TOKEN = "hf_fake_token_for_tests"
BUCKET = "hf://buckets/me/grpo-lora"
FAST = {"poll_interval_s": 0.001, "log_grace_s": 5.0}  # polls every ms; nothing sleeps longer


class FakeHub:
    """HfApi's jobs methods, same keyword-only signatures. A job's stage follows its script
    (one entry per `inspect_job`, the last one kept); `cancel_job` makes it CANCELED; the
    trainer's logs come from a generator."""

    def __init__(self, scripts: dict[str, list[str]] | None = None, logs=None, cancel_fails=()):
        self.scripts = scripts or {}     # job name (without the run prefix) -> stages
        self.logs = logs or (lambda: iter(["step 1 reward=0.1", "step 2 reward=0.4"]))
        self.cancel_fails = set(cancel_fails)  # job names whose cancel raises
        self.jobs: dict[str, dict] = {}  # id -> {"name", "labels", "stages"}
        self.cancelled: list[str] = []   # job ids, in call order
        self.calls: list[dict] = []      # run_job keyword arguments
        self.ids = count(1)

    def _info(self, job_id: str) -> JobInfo:
        job, stage = self.jobs[job_id], self.jobs[job_id]["stages"][0]
        return JobInfo(id=job_id, owner={"id": "u1", "name": "me", "type": "user"},
                       labels=job["labels"], status={"stage": stage, "message": (
                           "exit code 1" if stage == "ERROR" else None)})

    def short_name(self, job_id: str) -> str:
        return self.jobs[job_id]["name"]

    def run_job(self, *, image, command, env=None, secrets=None, flavor=None, timeout=None,
                attempts=None, name=None, labels=None, volumes=None, expose=None,
                expose_public=None, ssh=False, network_group=None, network_aliases=None,
                resource_group_id=None, namespace=None, token=None):
        self.calls.append({"name": name, "labels": labels, "namespace": namespace})
        job_id = f"{next(self.ids):024x}"
        short = name.removeprefix(labels[RUN_LABEL] + "-")
        self.jobs[job_id] = {"name": short, "labels": {**labels, "name": name},
                             "stages": list(self.scripts.get(short, ["SCHEDULING", "RUNNING"]))}
        return self._info(job_id)

    def inspect_job(self, *, job_id, namespace=None, token=None):
        stages = self.jobs[job_id]["stages"]
        if len(stages) > 1:
            stages.pop(0)
        return self._info(job_id)

    def fetch_job_logs(self, *, job_id, namespace=None, follow=False, tail=None, token=None):
        assert follow and self.short_name(job_id) == "trainer"
        yield from self.logs()

    def cancel_job(self, *, job_id, namespace=None, token=None):
        if self.short_name(job_id) in self.cancel_fails:
            raise RuntimeError("503 Service Unavailable")
        self.cancelled.append(job_id)
        self.jobs[job_id]["stages"] = ["CANCELED"]

    def list_jobs(self, *, status=None, labels=None, timeout=None, namespace=None, token=None):
        for job_id in self.jobs:
            info = self._info(job_id)
            if all(info.labels.get(k) == v for k, v in (labels or {}).items()) and \
                    (status is None or info.status.stage in status):
                yield info

    def ids_of(self, run: str, *names: str) -> list[str]:
        return [i for i, j in self.jobs.items()
                if j["labels"][RUN_LABEL] == run and (not names or j["name"] in names)]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh GRPO_LAB_HOME (where run records go), an HF token, and fast polls."""
    monkeypatch.setenv("GRPO_LAB_HOME", str(tmp_path))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    monkeypatch.setattr(follow, "POLL_INTERVAL_S", 0.001)
    return tmp_path


def submitted(hub: FakeHub, run: str = "r1") -> dict:
    """The jobs of a recipe plan submitted to the stand-in (grpo_lab installed by `true`)."""
    plan = recipe_plan(backend="hf-jobs", bucket=BUCKET, run_name=run, install="true")
    return HfJobsLauncher(plan, run_job=hub.run_job, environ={"HF_TOKEN": TOKEN}).submit()


def launch(hub: FakeHub, monkeypatch, *args: str, health=None) -> int:
    """`grpo-lab launch ARGS` against the stand-in; the replicas' /health answers at once (or
    as `health(url, **kwargs)` says: the stand-in's jobs serve nothing)."""
    monkeypatch.setattr(follow, "jobs_api", lambda: hub)
    monkeypatch.setattr(hf_jobs, "wait_healthy", health or (lambda url, timeout_s, **kw: None))
    return main(["launch", *args])


def test_the_stand_in_has_hfapi_signatures():
    for method in ("run_job", "inspect_job", "fetch_job_logs", "cancel_job", "list_jobs"):
        ours = list(inspect.signature(getattr(FakeHub, method)).parameters)
        theirs = list(inspect.signature(getattr(HfApi, method)).parameters)
        # the installed release's parameters, in its order; the stand-in also takes those that
        # releases newer than grpo_lab's floor (huggingface_hub 1.24) added
        assert [p for p in ours if p in theirs] == theirs, method
    assert set(ENDED_STAGES) == {s.value for s in TERMINAL_JOB_STAGES}


def test_follow_streams_the_trainer_logs_and_cancels_the_replicas_when_it_completes(
        home, monkeypatch, capsys):
    hub = FakeHub({"trainer": ["SCHEDULING", "RUNNING", "RUNNING", "COMPLETED"]})
    assert launch(hub, monkeypatch, "--backend", "hf-jobs", "--bucket", BUCKET,
                  "--run-name", "r1", "--install", "true") == 0
    out = capsys.readouterr().out
    for job_id in hub.jobs:
        assert f"https://huggingface.co/jobs/me/{job_id}" in out
    assert out.index("trainer | step 1 reward=0.1") < out.index("trainer | step 2 reward=0.4") \
        < out.index("trainer ended: COMPLETED")
    assert "stages: replica-0 RUNNING, replica-1 RUNNING, trainer RUNNING" in out
    assert hub.cancelled == hub.ids_of("r1", "replica-0", "replica-1")  # the trainer had ended
    assert all(call["labels"] == {RUN_LABEL: "r1"} for call in hub.calls)
    record = json.loads(run_record_path("r1").read_text())
    assert record["namespace"] == "me" and list(record["jobs"].values()) == hub.ids_of("r1")


def test_a_trainer_error_cancels_every_job_still_billing(capsys):
    hub = FakeHub({"trainer": ["RUNNING", "ERROR"], "replica-1": ["SCHEDULING"]})
    assert follow_run(hub, "r1", submitted(hub), **FAST) == 1
    assert hub.cancelled == hub.ids_of("r1", "replica-0", "replica-1")
    assert "trainer ended: ERROR (exit code 1); cancelling replica-0, replica-1" in \
        capsys.readouterr().out


def test_ctrl_c_while_the_logs_stream_cancels_every_job(capsys):
    def logs():
        yield "step 1 reward=0.1"
        raise KeyboardInterrupt
    hub = FakeHub({"trainer": ["RUNNING"]}, logs=logs)
    assert follow_run(hub, "r1", submitted(hub), **FAST) == 130
    assert sorted(hub.cancelled) == hub.ids_of("r1")
    assert "interrupted; cancelling replica-0, replica-1, trainer" in capsys.readouterr().out


def test_a_replica_that_ends_before_the_trainer_stops_the_run(capsys):
    hub = FakeHub({"trainer": ["RUNNING"], "replica-1": ["RUNNING", "RUNNING", "ERROR"]},
                  logs=lambda: iter([]))
    assert follow_run(hub, "r1", submitted(hub), **FAST) == 1
    assert sorted(hub.cancelled) == hub.ids_of("r1", "replica-0", "trainer")
    assert "replica-1 ended (ERROR) before trainer" in capsys.readouterr().out


def test_stages_that_cannot_be_read_stop_the_run(monkeypatch):
    hub = FakeHub({"trainer": ["RUNNING"]}, logs=lambda: iter([]))
    jobs = submitted(hub)
    reads = count(1)

    def unreachable(*, job_id, namespace=None, token=None):
        next(reads)
        raise ConnectionError("Hub unreachable")
    monkeypatch.setattr(hub, "inspect_job", unreachable)
    assert follow_run(hub, "r1", jobs, **FAST) == 1
    assert next(reads) == follow.MAX_POLL_FAILURES + 1  # gave up after that many in a row
    assert sorted(hub.cancelled) == hub.ids_of("r1")


def test_detach_returns_without_cancelling_and_prints_the_cancel_command(home, monkeypatch, capsys):
    hub = FakeHub()
    assert launch(hub, monkeypatch, "--backend", "hf-jobs", "--bucket", BUCKET, "--run-name",
                  "r1", "--install", "true", "--detach") == 0
    assert len(hub.jobs) == 3 and hub.cancelled == []
    assert all(len(j["stages"]) == 2 for j in hub.jobs.values())  # never inspected
    assert "`grpo-lab launch --cancel r1 --namespace me`" in capsys.readouterr().out


def test_cancel_run_cancels_exactly_that_runs_jobs(home, monkeypatch, capsys):
    hub = FakeHub({"replica-1": ["COMPLETED"]})  # an ended job is left alone
    for run in ("r1", "r2"):
        launch(hub, monkeypatch, "--backend", "hf-jobs", "--bucket", BUCKET, "--run-name", run,
               "--install", "true", "--detach")
    assert launch(hub, monkeypatch, "--cancel", "r1") == 0
    assert sorted(hub.cancelled) == hub.ids_of("r1", "replica-0", "trainer")
    # from another machine (no record here): found by the run's label
    run_record_path("r2").unlink()
    assert cancel_run("r2", api=hub) == 0
    assert sorted(hub.cancelled) == sorted(hub.ids_of("r1", "replica-0", "trainer")
                                           + hub.ids_of("r2", "replica-0", "trainer"))
    # nothing left to cancel; a run nobody knows is an error
    assert cancel_run("r1", api=hub) == 0 and cancel_run("r3", api=hub) == 1
    assert launch(hub, monkeypatch, "--cancel", "../r1") == 1
    assert "labels take letters, digits" in capsys.readouterr().err


def test_a_failed_cancel_does_not_stop_the_others(home, monkeypatch, capsys):
    hub = FakeHub(cancel_fails={"replica-0"})
    launch(hub, monkeypatch, "--backend", "hf-jobs", "--bucket", BUCKET, "--run-name", "r1",
           "--install", "true", "--detach")

    def no_listing(**kwargs):
        raise ConnectionError("Hub unreachable")
    monkeypatch.setattr(hub, "list_jobs", no_listing)  # the record's ids are cancelled instead
    assert launch(hub, monkeypatch, "--cancel", "r1") == 1
    assert hub.cancelled == hub.ids_of("r1", "replica-1", "trainer")
    err = capsys.readouterr().err
    replica_0 = hub.ids_of("r1", "replica-0")[0]
    assert f"could not cancel replica-0 ({replica_0}): RuntimeError: 503" in err
    assert "not cancelled: replica-0" in err


def test_a_run_name_the_hub_would_refuse_is_named_before_anything_is_submitted(tmp_path,
                                                                               capsys):
    with pytest.raises(ValueError, match=r"'Blog\.v1 run'.*use e\.g\. 'Blog-v1-run'"):
        RecipeConfig(run_name="Blog.v1 run")
    assert RecipeConfig(run_name="blog_v1-2").run_name == "blog_v1-2"
    # the command line says so, and fails, before a plan is made
    try:
        code = main(["launch", "--dry-run", "--bucket", str(tmp_path), "--run-name", "a.b"])
    except SystemExit as stopped:
        code = stopped.code
    assert code != 0 and "use e.g. 'a-b'" in capsys.readouterr().err


def test_the_trainer_is_submitted_only_once_every_replica_answers(home, monkeypatch, capsys):
    """The trainer job (the dearest) is not billed while the replicas start: the launcher waits
    for each replica's /health at its exposed URL, with the HF token, before submitting it."""
    hub, asked = FakeHub({"trainer": ["SCHEDULING", "RUNNING", "COMPLETED"]}), []

    def health(url, timeout_s, **kwargs):
        assert "r1-trainer" not in [c["name"] for c in hub.calls], "trainer submitted first"
        asked.append((url, kwargs["headers"]))

    assert launch(hub, monkeypatch, "--backend", "hf-jobs", "--bucket", BUCKET, "--run-name",
                  "r1", "--install", "true", health=health) == 0
    replicas = hub.ids_of("r1", "replica-0", "replica-1")
    assert [url for url, _ in asked] == [f"{exposed_url(i, 8000)}/health" for i in replicas]
    assert all(headers == {"Authorization": f"Bearer {TOKEN}"} for _, headers in asked)
    assert [c["name"] for c in hub.calls] == ["r1-replica-0", "r1-replica-1", "r1-trainer"]
    assert "replica-1 answers" in capsys.readouterr().out


def test_a_replica_that_fails_while_starting_stops_the_launch_before_the_trainer(
        home, monkeypatch, capsys):
    """A replica that ends while the launcher waits for it: no trainer job is submitted, the
    replicas are cancelled, and the error names the replica and where its logs are."""
    hub = FakeHub({"replica-0": ["SCHEDULING", "ERROR"]})
    monkeypatch.setattr(follow, "jobs_api", lambda: hub)
    assert main(["launch", "--backend", "hf-jobs", "--bucket", BUCKET, "--run-name", "r1",
                 "--install", "true"]) == 1
    assert [c["name"] for c in hub.calls] == ["r1-replica-0", "r1-replica-1"]
    assert sorted(hub.cancelled) == sorted(hub.ids_of("r1", "replica-0", "replica-1"))
    err = capsys.readouterr().err
    assert "replica-0 ended before it served" in err and "hf jobs logs" in err
