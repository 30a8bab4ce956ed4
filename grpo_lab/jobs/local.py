"""The local launcher: start a `RunPlan` (grpo_lab.jobs.specs) as processes on this machine.

    with LocalLauncher(recipe_plan(), "runs/r1") as run:   # each job: its own process group
        run.wait("trainer")                                 # and log file, runs/r1/logs/<job>.log
    # leaving the block (normally, by an error, or Ctrl-C) stops every job it started

The same plan goes to Hugging Face Jobs through grpo_lab.jobs.hf_jobs; `grpo-lab launch`
(grpo_lab.cli.launch) picks the backend.

Local lifecycle, per job, in the plan's dependency order:
    1. start   Popen(start_new_session=True): the job leads a new process group, so stopping
               it also stops whatever it spawned (vLLM's engine core, a tokenizer pool, ...)
    2. health  GET its health URL until 200; if it exits first or the deadline passes, stop
               everything and raise `LaunchError` with the last 40 lines of its log
    3. stop    SIGTERM to the group, SIGKILL after `grace_s`: on leaving the `with` block, on an
               error, at interpreter exit (a weakref finalizer, which also runs at exit), and,
               when the launcher runs in the main thread, when this process dies: the job's own
               process has PR_SET_PDEATHSIG, so a notebook kernel that is killed rather than shut
               down still takes its jobs with it (their children are then their business)

`python -m grpo_lab.jobs.local wait-healthy URL` runs `wait_healthy` from a shell: the HF trainer
job (grpo_lab.jobs.plan) waits with it for the proxy before it starts the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable
from pathlib import Path

from .specs import URL_PLACEHOLDER, BucketMount, JobSpec, RunPlan

LOG_TAIL_LINES = 40


class LaunchError(RuntimeError):
    """A job did not start: exited early, never became healthy, or could not be submitted."""


def tail_lines(path: str | Path, n: int = LOG_TAIL_LINES) -> list[str]:
    """The last `n` lines of a (possibly large) text file, without reading all of it."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024 * max(1, n // 100 + 1)))
            return f.read().decode(errors="replace").splitlines()[-n:] if n > 0 else []
    except OSError:
        return []


def is_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie (os.kill(pid, 0) also succeeds on zombies)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)  # no /proc (not Linux): the best we can do
            return True
        except (ProcessLookupError, PermissionError):
            return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, read from /proc."""
    members = []
    for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else []:
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):  # fields: state ppid pgrp
            members.append(int(entry.name))
    return members


def wait_healthy(url: str, timeout_s: float, *, alive: Callable[[], bool] | None = None,
                 poll_s: float = 0.2) -> None:
    """Poll `url` until it answers 200. Raises TimeoutError at the deadline, or ChildProcessError
    as soon as `alive()` says the process behind it has exited."""
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while True:
        if alive is not None and not alive():
            raise ChildProcessError(f"exited before {url} answered ({last})")
        try:
            with urllib.request.urlopen(url, timeout=min(5.0, max(0.5, timeout_s))) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            last = type(exc).__name__
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{url} not healthy after {timeout_s:g} s ({last})")
        time.sleep(min(poll_s, left))


def fill_urls(text: str, urls: dict[str, str]) -> str:
    """`{url:<job>}` placeholders in `text` -> the URLs in `urls` (job name -> URL)."""
    return URL_PLACEHOLDER.sub(lambda m: urls[m.group(1)], text)


# Runs in the child before the job's command: ask the kernel to SIGTERM this process when the
# thread that started it dies, then become the job (exec keeps the pid and the setting).
_PDEATHSIG_SHIM = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # 1 = PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"  # the launcher died before prctl
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def _stop_all(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM every group, wait until the groups are empty or `grace_s` passed, SIGKILL the rest.

    A module function, not a method: the weakref finalizer must not hold the launcher alive.
    """
    live = [p for p in procs if p.poll() is None or group_members(p.pid)]
    for proc in reversed(live):  # the trainer first, the replicas last
        _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    try:
        while time.monotonic() < deadline:
            for proc in live:
                proc.poll()  # reap the leader, so it does not count as a member
            if not any(p.returncode is None or group_members(p.pid) for p in live):
                break
            time.sleep(0.05)
    finally:  # also when Ctrl-C interrupts the grace period
        for proc in live:
            _signal_group(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0  # SIGKILL is queued, not instant: see them gone
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            while group_members(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.01)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LocalLauncher:
    """Each job of `plan` as its own process group, logging to `<run_dir>/logs/<job>.log`.

    Use as a context manager; `start()` / `stop()` do the same by hand. Secrets are copied from
    this process's environment into the job's (a missing one is an error before anything starts).
    """

    def __init__(self, plan: RunPlan, run_dir: str | Path, *, grace_s: float = 10.0,
                 poll_s: float = 0.2, environ: dict[str, str] | None = None):
        self.plan, self.run_dir = plan, Path(run_dir).absolute()
        self.grace_s, self.poll_s = grace_s, poll_s
        self.environ = dict(os.environ if environ is None else environ)
        self.procs: dict[str, subprocess.Popen] = {}
        self._started: list[subprocess.Popen] = []  # shared with the finalizer: not `self`
        self._stopped: set[str] | None = None  # jobs still running when stop() began
        self._finalizer = weakref.finalize(self, _stop_all, self._started, grace_s)

    # -- lifecycle ---------------------------------------------------------------------------
    def __enter__(self) -> LocalLauncher:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LocalLauncher:
        """Start every job, wave by wave, each wave healthy before the next one starts."""
        if self.procs or self._stopped is not None:
            raise LaunchError("a launcher starts once; make a new one for another run")
        missing = sorted({s for j in self.plan.jobs for s in j.secrets if s not in self.environ})
        if missing:
            raise LaunchError(f"secrets not set in the environment: {', '.join(missing)}")
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        (self.run_dir / "plan.json").write_text(json.dumps(self.plan.to_dict(), indent=2))
        try:
            for wave in self.plan.waves():
                for job in wave:
                    self._start_job(job)
                for job in wave:
                    self._wait_healthy(job)
        except BaseException:  # including Ctrl-C while waiting: leave nothing behind
            self.stop()
            raise
        return self

    def _start_job(self, job: JobSpec) -> None:
        for volume in job.volumes:
            self._check_volume(job, volume)
        env = {**self.environ, **job.env}
        urls = {j.name: f"http://127.0.0.1:{j.ports[0]}" for j in self.plan.jobs if j.ports}
        command = [fill_urls(arg, urls) for arg in job.command]
        if threading.current_thread() is threading.main_thread() and sys.platform == "linux":
            command = [sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid()), *command]
        log = open(self.log_path(job.name), "ab")
        try:
            proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, env=env, cwd=self.run_dir,
                                    start_new_session=True)
        except OSError as exc:
            raise LaunchError(f"job {job.name!r} could not start: {exc}") from exc
        finally:
            log.close()  # the child holds its own copy
        self.procs[job.name] = proc
        self._started.append(proc)

    @staticmethod
    def _check_volume(job: JobSpec, volume: BucketMount) -> None:
        if volume.on_hub or Path(volume.source).absolute() != Path(volume.mount_path):
            raise LaunchError(f"job {job.name!r}: the local backend cannot mount "
                              f"{volume.source!r} at {volume.mount_path!r}; use a local "
                              "directory mounted at its own absolute path")
        Path(volume.source).mkdir(parents=True, exist_ok=True)

    def _wait_healthy(self, job: JobSpec) -> None:
        proc = self.procs[job.name]
        if job.health_url is None:
            return
        try:
            wait_healthy(job.health_url, job.health_timeout_s, poll_s=self.poll_s,
                         alive=lambda: proc.poll() is None)
        except ChildProcessError:
            raise LaunchError(self._failure(job.name, f"exited with code {proc.returncode} "
                                            "before it became healthy")) from None
        except TimeoutError as exc:
            raise LaunchError(self._failure(job.name, str(exc))) from None

    def _failure(self, name: str, what: str) -> str:
        tail = "\n".join(f"    {line}" for line in self.logs(name, LOG_TAIL_LINES).splitlines())
        return (f"job {name!r} {what}\n  last {LOG_TAIL_LINES} lines of "
                f"{self.log_path(name)}:\n{tail or '    (empty)'}")

    def stop(self) -> None:
        """Stop every started job (idempotent)."""
        if self._stopped is None:
            self._stopped = {name for name, proc in self.procs.items() if proc.poll() is None}
            self._finalizer()  # runs _stop_all once, then detaches

    # -- looking at a run ----------------------------------------------------------------------
    def log_path(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"

    def logs(self, name: str, tail: int = LOG_TAIL_LINES) -> str:
        """The last `tail` lines of a job's log."""
        self.plan[name]  # KeyError for an unknown job
        return "\n".join(tail_lines(self.log_path(name), tail))

    def running(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.poll() is None

    def status(self) -> dict[str, str]:
        """`not started`, `running (pid N)`, `exited (0)`, `failed (code N)`, `killed (signal N)`
        or `stopped` (by the launcher)."""
        out = {}
        for job in self.plan.jobs:
            proc = self.procs.get(job.name)
            if proc is None:
                out[job.name] = "not started"
            elif proc.poll() is None:
                out[job.name] = f"running (pid {proc.pid})"
            elif job.name in (self._stopped or ()):
                out[job.name] = "stopped"
            elif proc.returncode < 0:
                out[job.name] = f"killed (signal {-proc.returncode})"
            else:
                out[job.name] = "exited (0)" if proc.returncode == 0 else f"failed (code {proc.returncode})"
        return out

    def wait(self, name: str, timeout_s: float | None = None) -> int:
        """Wait for job `name` to exit and return its code. Raises LaunchError if another job
        dies first (e.g. a replica crashes under the trainer), TimeoutError at the deadline."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        proc = self.procs[name]
        while proc.poll() is None:
            for other, p in self.procs.items():
                if other != name and p.poll() is not None:
                    raise LaunchError(self._failure(other, f"exited with code {p.returncode} "
                                                    f"while waiting for {name!r}"))
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {name!r} still running after {timeout_s:g} s")
            time.sleep(self.poll_s)
        return proc.returncode


def local_commands(plan: RunPlan, run_dir: str | Path) -> str:
    """What `LocalLauncher` will run, as shell lines (for --dry-run)."""
    lines = [f"# {plan.name}: {len(plan.jobs)} local processes, logs in {Path(run_dir) / 'logs'}"]
    for job in plan.jobs:
        env = " ".join(shlex.quote(f"{k}={v}") for k, v in job.env.items())
        lines.append(f"# {job.name}" + (f" (ready when {job.health_url} answers 200)" if job.health_url else ""))
        lines.append(f"{env} {shlex.join(job.command)}".strip())
    return "\n".join(lines)


def _main(argv: list[str] | None = None) -> int:
    """`python -m grpo_lab.jobs.local wait-healthy URL`: used inside the HF trainer job."""
    parser = argparse.ArgumentParser(prog="python -m grpo_lab.jobs.local")
    sub = parser.add_subparsers(dest="command", required=True)
    wait = sub.add_parser("wait-healthy", help="poll URL until it answers 200")
    wait.add_argument("url")
    wait.add_argument("--timeout-s", type=float, default=600.0)
    wait.add_argument("--pid", type=int, default=None, help="fail as soon as this process exits")
    args = parser.parse_args(argv)
    alive = (lambda: is_alive(args.pid)) if args.pid else None
    try:
        wait_healthy(args.url, args.timeout_s, alive=alive, poll_s=2.0)
    except (TimeoutError, ChildProcessError) as exc:
        print(f"wait-healthy: {exc}", file=sys.stderr)
        return 1
    print(f"wait-healthy: {args.url} is healthy", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
