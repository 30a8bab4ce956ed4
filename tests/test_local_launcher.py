"""The local launcher: real processes (small stand-in servers), process groups, health waits, no
orphans."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import textwrap

import pytest
from launcher_helpers import DUMMY, PY, assert_no_orphans, server_job, wait_dead

from grpo_lab.launch.local import LaunchError, LocalLauncher, main
from grpo_lab.launch.specs import BucketMount, JobSpec, RunPlan
from grpo_lab.util.processes import free_port, group_members, is_alive


@pytest.fixture
def kill_on_failure():
    """Processes a test started outside a launcher: killed by group whatever happens."""
    pgids: list[int] = []
    yield pgids
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_jobs_start_in_order_and_stop_with_their_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    a = server_job("a", pidfile=pidfile, lines=3)
    # b refuses to start unless a already answers: checks the dependency order
    b_port = free_port()
    check = (f"import urllib.request; urllib.request.urlopen({a.health_url!r}, timeout=2); "
             f"exec(open({str(tmp_path / 'dummy.py')!r}).read())")
    (tmp_path / "dummy.py").write_text(DUMMY)
    b = JobSpec(name="b", command=[PY, "-c", check, str(b_port), "-", "0"], depends_on=["a"],
                health_url=f"http://127.0.0.1:{b_port}/health", health_timeout_s=20)
    plan = RunPlan([a, b], name="t")
    assert [[j.name for j in wave] for wave in plan.waves()] == [["a"], ["b"]]
    with LocalLauncher(plan, tmp_path / "run", grace_s=1.0) as run:
        status = run.status()
        assert status["a"].startswith("running") and status["b"].startswith("running")
        grandchild = int(pidfile.read_text())
        assert is_alive(grandchild)
        assert run.logs("a", tail=2) == "log line 1\nlog line 2"
        assert json.loads((tmp_path / "run" / "plan.json").read_text())["name"] == "t"
    # the grandchild ignores SIGTERM: only the SIGKILL after the grace period ends it
    assert_no_orphans(run, [grandchild])
    assert run.status() == {"a": "stopped", "b": "stopped"}


def test_a_job_that_never_becomes_healthy_fails_with_its_log_tail(tmp_path):
    first = server_job("first")
    silent = server_job("silent", port=0, lines=100, health_timeout_s=1.0)
    silent.health_url = f"http://127.0.0.1:{free_port()}/health"  # nobody listens there
    launcher = LocalLauncher(RunPlan([first, silent]), tmp_path, grace_s=1.0)
    with pytest.raises(LaunchError) as err:
        launcher.start()
    message = str(err.value)
    assert "'silent'" in message and "not healthy after 1 s" in message
    assert re.search(r"\blog line 99\b", message) and re.search(r"\blog line 60\b", message)
    assert not re.search(r"\blog line 59\b", message)  # the last 40 lines only
    assert_no_orphans(launcher)  # `first` was healthy, and is stopped too


def test_a_job_that_crashes_fails_with_its_exit_code_and_log(tmp_path):
    crash = JobSpec(name="crash", command=[PY, "-c", "print('boom: bad flag'); exit(3)"],
                    health_url=f"http://127.0.0.1:{free_port()}/health", health_timeout_s=20)
    launcher = LocalLauncher(RunPlan([server_job("ok"), crash]), tmp_path, grace_s=1.0)
    with pytest.raises(LaunchError, match=r"(?s)'crash' exited with code 3.*boom: bad flag"):
        launcher.start()
    assert_no_orphans(launcher)
    assert launcher.status()["crash"] == "failed (code 3)"


def test_no_orphans_when_the_body_raises(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    with pytest.raises(RuntimeError, match="the notebook cell failed"):
        plan = RunPlan([server_job("a", pidfile=pidfile)])
        with LocalLauncher(plan, tmp_path, grace_s=1.0) as run:
            raise RuntimeError("the notebook cell failed")
    assert_no_orphans(run, [int(pidfile.read_text())])


def test_wait_returns_the_exit_code_and_notices_a_dying_dependency(tmp_path):
    done = JobSpec(name="done", command=[PY, "-c", "import time; time.sleep(0.3)"],
                   depends_on=["a"])
    with LocalLauncher(RunPlan([server_job("a"), done]), tmp_path / "1", grace_s=1.0) as run:
        assert run.wait("done", timeout_s=20) == 0
        assert run.status()["done"] == "exited (0)"
    sleeper = JobSpec(name="trainer", command=[PY, "-c", "import time; time.sleep(60)"])
    plan = RunPlan([server_job("replica"), sleeper])
    with LocalLauncher(plan, tmp_path / "2", grace_s=1.0) as run:
        os.killpg(run.procs["replica"].pid, signal.SIGKILL)
        died = "'replica' exited with code -9 while waiting for 'trainer'"
        with pytest.raises(LaunchError, match=died):
            run.wait("trainer", timeout_s=20)
    assert_no_orphans(run)


def test_preempt_and_restart_kills_the_whole_job_and_starts_it_again(tmp_path):
    """A preemption: SIGKILL to the job's process group (its own children too), then the same
    command again, healthy before it returns; the stop at the end takes the new process too."""
    pidfile = tmp_path / "grandchild.pid"
    with LocalLauncher(RunPlan([server_job("a", pidfile=pidfile)]), tmp_path, grace_s=1.0) as run:
        first, first_child = run.procs["a"], int(pidfile.read_text())
        assert run.preempt_and_restart("a") == -signal.SIGKILL
        assert wait_dead([first.pid, first_child])
        assert run.procs["a"] is not first and run.running("a")
        assert int(pidfile.read_text()) != first_child  # the new process wrote its own
    assert_no_orphans(run, [int(pidfile.read_text())])

def test_missing_secret_or_unmountable_bucket_starts_nothing(tmp_path):
    job = server_job("a", secrets=["GRPO_LAB_TEST_SECRET"])
    launcher = LocalLauncher(RunPlan([job]), tmp_path, environ={})
    with pytest.raises(LaunchError, match="GRPO_LAB_TEST_SECRET"):
        launcher.start()
    assert launcher.procs == {}
    mounted = server_job("b", volumes=[BucketMount(str(tmp_path / "bucket"), "/lora")])
    launcher = LocalLauncher(RunPlan([mounted]), tmp_path)
    with pytest.raises(LaunchError, match="cannot mount"):
        launcher.start()
    assert launcher.procs == {}


LAUNCHER_SCRIPT = textwrap.dedent("""
    import sys, threading, time
    from grpo_lab.launch.specs import JobSpec, RunPlan
    from grpo_lab.launch.local import LocalLauncher
    job = JobSpec(name="a",
                  command=[sys.executable, "-c", sys.argv[2], sys.argv[3], sys.argv[4], "0"],
                  health_url=f"http://127.0.0.1:{sys.argv[3]}/health", health_timeout_s=20)
    keep = []
    def start():
        keep.append(LocalLauncher(RunPlan([job]), sys.argv[5], grace_s=1.0).start())
    if sys.argv[1] == "killed":   # main thread, then SIGKILLed: PR_SET_PDEATHSIG
        start()
        print(keep[0].procs["a"].pid, flush=True)
        time.sleep(60)
    else:                         # another thread (no PDEATHSIG), then a normal exit: finalizer
        thread = threading.Thread(target=start)
        thread.start(); thread.join()
        print(keep[0].procs["a"].pid, flush=True)
""")


@pytest.mark.parametrize("how", ["exits", "killed"])
def test_no_orphans_when_the_launching_process_goes_away(tmp_path, how, kill_on_failure):
    """A kernel restart: a normal interpreter exit runs the finalizer; a SIGKILLed kernel
    runs nothing, so the job's own PR_SET_PDEATHSIG ends it."""
    pidfile = tmp_path / "grandchild.pid"
    grandchild_file = pidfile if how == "exits" else "-"
    proc = subprocess.Popen([PY, "-c", LAUNCHER_SCRIPT, how, DUMMY, str(free_port()),
                             str(grandchild_file), str(tmp_path / "run")],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)
    kill_on_failure.append(proc.pid)
    try:
        job_pid = int(proc.stdout.readline())
        kill_on_failure.append(job_pid)  # its process group
        if how == "killed":
            assert is_alive(job_pid)
            proc.kill()
        proc.wait(timeout=30)
        # exits: the finalizer stops the whole group; killed: the kernel SIGTERMs the job
        # itself (its own children are its business then: vLLM's engine core watches its parent)
        assert wait_dead([job_pid], 10)
        if how == "exits":
            assert wait_dead([int(pidfile.read_text())], 2) and group_members(job_pid) == []
    finally:
        proc.stdout.close()


def test_wait_healthy_cli_fails_fast_without_a_server():
    url = f"http://127.0.0.1:{free_port()}/health"
    assert main(["wait-healthy", url, "--timeout-s", "0.3"]) == 1
