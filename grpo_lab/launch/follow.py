"""Follow a run on Hugging Face Jobs to its end, then cancel what still bills.

    follow_run(api, jobs)                 # the trainer's logs, each job's stage, then cancel
    cancel_run("recipe-20260101-120000")  # `grpo-lab launch --cancel RUN`, from any machine

Replicas serve until cancelled, so the follower cancels every job of the run when the trainer
ends, a replica ends first, or the user stops it (docs/recipe.md, "Following and stopping a run").
"""

from __future__ import annotations

import json
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..util.home import grpo_lab_home
from .hf_jobs import RUN_LABEL, HfJobsLauncher
from .local import LaunchError
from .recipe_config import check_run_name
from .specs import RunPlan

ENDED_STAGES = ("COMPLETED", "CANCELED", "ERROR", "DELETED")
"""huggingface_hub's TERMINAL_JOB_STAGES: a job in any other stage is scheduled or running, and
bills."""
ACTIVE_STAGES = ("SCHEDULING", "RUNNING")
"""The stages `list_jobs` is asked for when looking for what still bills."""
POLL_INTERVAL_S = 5.0
"""Seconds between two looks at every job's stage (`inspect_job`)."""
MAX_POLL_FAILURES = 5
"""Failed looks in a row after which the follower gives up and cancels the run."""
LOG_GRACE_S = 30.0
"""How long the trainer's last log lines may take to arrive once its job has ended."""


def jobs_api():
    """The Hub client every call goes through (tests replace this with a stand-in)."""
    from huggingface_hub import HfApi

    return HfApi()


def stage_of(info: Any) -> str:
    """`JobInfo.status.stage` as a plain string (`RUNNING`)."""
    stage = info.status.stage
    return getattr(stage, "value", stage)


def cancel_command(run: str, namespace: str | None = None) -> str:
    return f"grpo-lab launch --cancel {run}" + (f" --namespace {namespace}" if namespace else "")


# ---------------------------------------------------------------------------------------------
# The run record: what this machine submitted
# ---------------------------------------------------------------------------------------------

def run_record_path(run: str) -> Path:
    try:
        check_run_name(run)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    return grpo_lab_home() / "runs" / run / "hf_jobs.json"


def write_run_record(run: str, jobs: dict[str, Any], namespace: str) -> Path:
    """Write the submitted jobs' ids, pages and namespace; returns the file."""
    path = run_record_path(run)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"run": run, "namespace": namespace, "label": {RUN_LABEL: run},
              "jobs": {name: info.id for name, info in jobs.items()},
              "pages": {name: getattr(info, "url", None) for name, info in jobs.items()}}
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def read_run_record(run: str) -> dict | None:
    path = run_record_path(run)
    return json.loads(path.read_text()) if path.is_file() else None


# ---------------------------------------------------------------------------------------------
# Cancelling
# ---------------------------------------------------------------------------------------------

def cancel_jobs(api, job_ids: dict[str, str], namespace: str | None) -> dict[str, str]:
    """Cancel each job (name -> id); one that fails does not stop the others. Returns the
    failures, name -> error."""
    failed = {}
    for name, job_id in job_ids.items():
        try:
            api.cancel_job(job_id=job_id, namespace=namespace)
            print(f"cancelled {name} ({job_id})", flush=True)
        except Exception as exc:
            failed[name] = f"{type(exc).__name__}: {exc}"
            print(f"could not cancel {name} ({job_id}): {failed[name]}", file=sys.stderr,
                  flush=True)
    return failed


def find_run_jobs(api, run: str, namespace: str | None = None) -> tuple[dict[str, str], str | None]:
    """The run's jobs that still bill (name -> id) and their namespace: listed on the Hub by the
    run's label; this machine's record gives the namespace, and its ids when listing fails."""
    record = read_run_record(run)
    namespace = namespace or (record or {}).get("namespace")
    try:
        listed = api.list_jobs(labels={RUN_LABEL: run}, status=list(ACTIVE_STAGES),
                               namespace=namespace)
        return {(job.labels or {}).get("name", job.id).removeprefix(f"{run}-"): job.id
                for job in listed}, namespace
    except Exception as exc:
        if record is None:
            raise LaunchError(f"could not list the jobs of run {run!r} ({exc}), and this "
                              f"machine has no record of it ({run_record_path(run)})") from exc
        print(f"could not list the jobs labelled {RUN_LABEL}={run} ({exc}); cancelling the "
              f"ones recorded in {run_record_path(run)}", file=sys.stderr)
        return dict(record["jobs"]), namespace


def cancel_run(run: str, *, namespace: str | None = None, api=None) -> int:
    """`grpo-lab launch --cancel RUN`: cancel every job of the run that still bills."""
    api = api or jobs_api()
    jobs, namespace = find_run_jobs(api, run, namespace)
    if not jobs:
        known = read_run_record(run) is not None
        print(f"run {run!r}: no job is scheduling or running" +
              ("" if known else f" (nor does this machine know the run: {run_record_path(run)})"))
        return 0 if known else 1
    print(f"run {run!r}: cancelling {', '.join(jobs)}", flush=True)
    failed = cancel_jobs(api, jobs, namespace)
    if failed:
        print(f"not cancelled: {', '.join(failed)}; retry with `{cancel_command(run, namespace)}` "
              "or `hf jobs cancel <id>`", file=sys.stderr)
    return 1 if failed else 0


# ---------------------------------------------------------------------------------------------
# Following
# ---------------------------------------------------------------------------------------------

_LOGS_ENDED = object()


def _stream_logs(api, job_id: str, namespace: str | None, lines: queue.Queue) -> None:
    """Thread body: put the job's log lines on `lines`, then _LOGS_ENDED or what was raised."""
    try:
        for line in api.fetch_job_logs(job_id=job_id, namespace=namespace, follow=True):
            lines.put(line)
        lines.put(_LOGS_ENDED)
    except BaseException as exc:  # re-raised by the follower in the main thread
        lines.put(exc)


def _print_logs(lines: queue.Queue, name: str, wait_s: float) -> bool:
    """Print the log lines that arrive within wait_s; False once the stream has ended."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() <= deadline:  # a flood of lines must not hold off the stage checks
        try:
            item = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return True
        if item is _LOGS_ENDED:
            return False
        if isinstance(item, Exception):  # the stream broke; the stages still tell the end
            print(f"[{name} logs] stream lost ({item}); following the stages only", file=sys.stderr)
            return False
        if isinstance(item, BaseException):  # KeyboardInterrupt, SystemExit
            raise item
        print(f"{name} | {item.rstrip()}", flush=True)
    return True


def follow_run(api, run: str, jobs: dict[str, Any], *, namespace: str | None = None,
               trainer: str = "trainer", poll_interval_s: float | None = None,
               log_grace_s: float = LOG_GRACE_S) -> int:
    """Stream the trainer's logs, print each stage change, and cancel every job of `run` still
    billing when the run is over (see the module docstring). Returns 0 when the trainer COMPLETED,
    130 when interrupted, else 1."""
    poll_interval_s = POLL_INTERVAL_S if poll_interval_s is None else poll_interval_s
    ids = {name: info.id for name, info in jobs.items()}
    stages = {name: stage_of(info) for name, info in jobs.items()}
    namespace = namespace or jobs[trainer].owner.name
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_stream_logs, args=(api, ids[trainer], namespace, lines),
                     daemon=True, name=f"logs-{trainer}").start()
    print(f"following {trainer}'s logs and every job's stage; Ctrl-C cancels every job", flush=True)
    logs_open, failures, code, why = True, 0, 1, ""
    try:
        while True:
            if logs_open:
                logs_open = _print_logs(lines, trainer, poll_interval_s)
            else:
                time.sleep(poll_interval_s)
            # Look at every job's stage; print the changes
            try:
                infos = {name: api.inspect_job(job_id=job_id, namespace=namespace)
                         for name, job_id in ids.items()}
                failures = 0
            except Exception as exc:
                failures += 1
                print(f"could not read the stages ({failures}/{MAX_POLL_FAILURES}): {exc}",
                      file=sys.stderr)
                if failures >= MAX_POLL_FAILURES:
                    why = "the stages could not be read"
                    break
                continue
            now = {name: stage_of(info) for name, info in infos.items()}
            if now != stages:
                print("stages: " + ", ".join(f"{n} {s}" for n, s in now.items()), flush=True)
            stages = now
            # The run is over: the trainer ended, or a replica did before it
            if stages[trainer] in ENDED_STAGES:
                deadline = time.monotonic() + log_grace_s  # its last lines may still be on the way
                while logs_open and time.monotonic() < deadline:
                    logs_open = _print_logs(lines, trainer, deadline - time.monotonic())
                code = 0 if stages[trainer] == "COMPLETED" else 1
                message = infos[trainer].status.message
                why = f"{trainer} ended: {stages[trainer]}" + (f" ({message})" if message else "")
                break
            ended = [n for n in ids if n != trainer and stages[n] in ENDED_STAGES]
            if ended:
                why = ", ".join(f"{n} ended ({stages[n]})" for n in ended) + f" before {trainer}"
                break
    except KeyboardInterrupt:
        code, why = 130, "interrupted"
    except Exception as exc:  # whatever broke the follower, the jobs must not keep billing
        code, why = 1, f"following failed ({type(exc).__name__}: {exc})"
    billing = {n: ids[n] for n in ids if stages[n] not in ENDED_STAGES}
    print(f"{why}; cancelling {', '.join(billing) or 'nothing (every job has ended)'}", flush=True)
    try:
        failed = cancel_jobs(api, billing, namespace)
    except KeyboardInterrupt:  # a second Ctrl-C
        failed = {"some jobs": "interrupted while cancelling"}
        code = 130
    if failed:
        print(f"still billing, maybe: {', '.join(failed)}; retry with "
              f"`{cancel_command(run, namespace)}`", file=sys.stderr)
        code = code or 1
    return code


# ---------------------------------------------------------------------------------------------
# `grpo-lab launch --backend hf-jobs`
# ---------------------------------------------------------------------------------------------

def launch_hf_jobs(plan: RunPlan, *, namespace: str | None = None, detach: bool = False,
                   api=None) -> int:
    """Submit the plan, record it, print each job's page; then follow it, or (detach) return
    with the command that cancels it."""
    api = api or jobs_api()
    launcher = HfJobsLauncher(plan, namespace=namespace, run_job=api.run_job,
                              cancel_job=api.cancel_job, inspect_job=api.inspect_job)
    jobs = launcher.submit()
    namespace = namespace or next(iter(jobs.values())).owner.name
    for name, info in jobs.items():
        print(f"{name}: {getattr(info, 'url', info.id)} ({stage_of(info)})")
    print(f"replicas at: {', '.join(launcher.urls.values())}")
    try:
        print(f"job ids in {write_run_record(plan.name, jobs, namespace)}")
    except OSError as exc:  # `--cancel` still finds the jobs by their label
        print(f"could not write the run record: {exc}", file=sys.stderr)
    if detach:
        timeout = max((j.timeout for j in plan.jobs if j.timeout), default="their timeout")
        print(f"detached: the jobs bill until they end or time out ({timeout}); stop them all "
              f"with `{cancel_command(plan.name, namespace)}`")
        return 0

    def interrupt(signum, frame):  # `kill <pid>` of this command cancels too, like Ctrl-C
        raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():  # signals reach only that one
        return follow_run(api, plan.name, jobs, namespace=namespace)
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        return follow_run(api, plan.name, jobs, namespace=namespace)
    finally:
        signal.signal(signal.SIGTERM, previous)
