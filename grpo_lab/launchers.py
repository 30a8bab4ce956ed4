"""Launchers: start a `RunPlan` (grpo_lab.jobs) as processes here, or as Hugging Face Jobs.

    with LocalLauncher(recipe_plan(), "runs/r1") as run:   # each job: its own process group
        run.wait("trainer")                                 # and log file, runs/r1/logs/<job>.log
    # leaving the block (normally, by an error, or Ctrl-C) stops every job it started

    HfJobsLauncher(recipe_plan(backend="hf-jobs", bucket="hf://buckets/me/lora")).submit()
    print(hf_jobs_commands(plan))                          # the same, as `hf jobs run` lines

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
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
from typing import Any

from .jobs import URL_PLACEHOLDER, BucketMount, JobSpec, RecipeConfig, RunPlan, recipe_plan

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
        command = [_fill_urls(arg, urls) for arg in job.command]
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


# ---------------------------------------------------------------------------------------------
# Hugging Face Jobs
# ---------------------------------------------------------------------------------------------

def exposed_url(job_id: str, port: int) -> str:
    """Where the jobs proxy exposes a job's port (requests need an HF token with read access)."""
    return f"https://{job_id}--{port}.hf.jobs"


def shell_var(job_name: str) -> str:
    """`replica-0` -> `REPLICA_0_ID`: the shell variable holding the job's id in dry-run lines."""
    return re.sub(r"[^A-Z0-9]", "_", job_name.upper()) + "_ID"


def hf_volume(mount: BucketMount):
    """The `huggingface_hub.Volume` for a bucket mount (`hf://buckets/<owner>/<bucket>[/sub]`)."""
    from huggingface_hub import Volume

    if not mount.on_hub:
        raise ValueError(f"HF Jobs mount Storage Buckets (hf://buckets/...), not {mount.source!r}")
    owner, bucket, *sub = mount.source.removeprefix("hf://buckets/").split("/", 2)
    return Volume(type="bucket", source=f"{owner}/{bucket}", mount_path=mount.mount_path,
                  read_only=mount.read_only, path=sub[0] if sub and sub[0] else None)


def _fill_urls(text: str, urls: dict[str, str]) -> str:
    return URL_PLACEHOLDER.sub(lambda m: urls[m.group(1)], text)


class HfJobsLauncher:
    """Submit each job of a plan as a Hugging Face Job, in order, through `run_job`.

    `run_job` and `cancel_job` default to huggingface_hub's (they need a token and the network);
    pass fakes to test. A job's `{url:<job>}` placeholders become the exposed URL of that job.
    Secret values are read from `environ` (default: os.environ, plus your saved HF token for
    HF_TOKEN) at submission; all must be present before the first job is submitted.
    """

    def __init__(self, plan: RunPlan, *, run_job: Callable[..., Any] | None = None,
                 cancel_job: Callable[..., Any] | None = None, namespace: str | None = None,
                 environ: dict[str, str] | None = None):
        self.plan, self.namespace = plan, namespace
        self._run_job, self._cancel_job = run_job, cancel_job
        self._environ = environ
        self.jobs: dict[str, Any] = {}  # name -> JobInfo
        self.urls: dict[str, str] = {}  # name -> exposed URL of its first port

    def _secret_values(self) -> dict[str, str]:
        environ = dict(os.environ if self._environ is None else self._environ)
        if "HF_TOKEN" not in environ and self._environ is None:
            from huggingface_hub import get_token  # the token saved by `hf auth login`

            token = get_token()
            if token:
                environ["HF_TOKEN"] = token
        names = sorted({s for j in self.plan.jobs for s in j.secrets})
        missing = [n for n in names if not environ.get(n)]
        if missing:
            raise LaunchError(f"secrets not set: {', '.join(missing)} (export them, or "
                              "`hf auth login` for HF_TOKEN)")
        return {n: environ[n] for n in names}

    def run_job_kwargs(self, job: JobSpec, secrets: dict[str, str]) -> dict[str, Any]:
        """The exact keyword arguments `run_job` gets for `job`."""
        kwargs = {
            "image": job.image,
            "command": [_fill_urls(arg, self.urls) for arg in job.command],
            "env": dict(job.env),
            "secrets": {name: secrets[name] for name in job.secrets},
            "flavor": job.flavor,
            "timeout": job.timeout,
            "name": f"{self.plan.name}-{job.name}",
            "volumes": [hf_volume(v) for v in job.volumes],
            "expose": list(job.ports) or None,
        }
        if self.namespace:
            kwargs["namespace"] = self.namespace
        return kwargs

    def submit(self) -> dict[str, Any]:
        """Submit every job; on a failure cancel the ones already submitted, then raise."""
        if self.plan.backend != "hf-jobs":
            raise LaunchError(f"this plan was built for the {self.plan.backend} backend")
        if self._run_job is None:
            from huggingface_hub import run_job

            self._run_job = run_job
        secrets = self._secret_values()
        try:
            for job in self.plan.jobs:
                info = self._run_job(**self.run_job_kwargs(job, secrets))
                self.jobs[job.name] = info
                if job.ports:
                    self.urls[job.name] = self._url(info, job.ports[0])
        except BaseException as exc:
            self.cancel()
            if isinstance(exc, Exception) and not isinstance(exc, LaunchError):
                raise LaunchError(f"submitting {self.plan.name}: {exc}") from exc
            raise
        return self.jobs

    @staticmethod
    def _url(info: Any, port: int) -> str:
        status = getattr(info, "status", None)
        for url in getattr(status, "expose_urls", None) or []:
            if url.rstrip("/").endswith(f"--{port}.hf.jobs"):
                return url.rstrip("/")
        return exposed_url(info.id, port)

    def cancel(self) -> None:
        """Cancel every job this launcher submitted (HF jobs outlive this process otherwise)."""
        if not self.jobs:
            return
        if self._cancel_job is None:
            from huggingface_hub import cancel_job

            self._cancel_job = cancel_job
        for name, info in reversed(list(self.jobs.items())):
            kwargs = {"job_id": info.id}
            if self.namespace:
                kwargs["namespace"] = self.namespace
            try:
                self._cancel_job(**kwargs)
            except Exception as exc:  # keep cancelling the others
                print(f"could not cancel {name} ({info.id}): {exc}", file=sys.stderr)


def _double_quoted(text: str, urls: dict[str, str]) -> str:
    """`text` as one double-quoted shell word; placeholders become `$VAR` references."""
    out, pos = [], 0
    for m in URL_PLACEHOLDER.finditer(text):
        out.append(re.sub(r'(["$`\\])', r"\\\1", text[pos:m.start()]))
        out.append(urls[m.group(1)])
        pos = m.end()
    out.append(re.sub(r'(["$`\\])', r"\\\1", text[pos:]))
    return '"' + "".join(out) + '"'


def hf_jobs_commands(plan: RunPlan, namespace: str | None = None) -> str:
    """The plan as `hf jobs run` lines to paste into a shell (bash): replicas first, each id
    kept in a shell variable, then the trainer job, which reaches them at their exposed URLs."""
    needed = {dep for job in plan.jobs for dep in job.placeholders()}
    urls = {name: exposed_url("${" + shell_var(name) + "}", plan[name].ports[0]) for name in needed}
    lines = [f"# {plan.name}: {len(plan.jobs)} Hugging Face Jobs; needs `hf auth login` "
             "(or HF_TOKEN exported) and the bucket created"]
    for job in plan.jobs:
        args = ["hf", "jobs", "run", "--detach"] + (["--quiet"] if job.name in needed else [])
        args += ["--name", f"{plan.name}-{job.name}", "--flavor", job.flavor]
        args += ["--timeout", job.timeout] if job.timeout else []
        args += ["--namespace", namespace] if namespace else []
        for name in job.secrets:
            args += ["--secrets", name]
        for port in job.ports:
            args += ["--expose", str(port)]
        for volume in job.volumes:
            args += ["-v", volume.cli_spec()]
        for key, value in job.env.items():
            args += ["-e", f"{key}={value}"]
        words = [shlex.join(args), "--", shlex.quote(job.image)]
        words += [_double_quoted(a, urls) if URL_PLACEHOLDER.search(a) else shlex.quote(a)
                  for a in job.command]
        line = " ".join(words)
        lines.append(f"# {job.name}")
        lines.append(f"{shell_var(job.name)}=$({line})" if job.name in needed else line)
    return "\n".join(lines)


def local_commands(plan: RunPlan, run_dir: str | Path) -> str:
    """What `LocalLauncher` will run, as shell lines (for --dry-run)."""
    lines = [f"# {plan.name}: {len(plan.jobs)} local processes, logs in {Path(run_dir) / 'logs'}"]
    for job in plan.jobs:
        env = " ".join(shlex.quote(f"{k}={v}") for k, v in job.env.items())
        lines.append(f"# {job.name}" + (f" (ready when {job.health_url} answers 200)" if job.health_url else ""))
        lines.append(f"{env} {shlex.join(job.command)}".strip())
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# `grpo-lab launch`
# ---------------------------------------------------------------------------------------------

def add_launch_parser(sub) -> None:
    """Add `grpo-lab launch` to the CLI's subparsers."""
    from .cli import add_config_flags, field_docs

    launch = sub.add_parser(
        "launch", help="docs/recipe.md's multi-job run: replicas, proxy, trainer, one bucket",
        description="Start the recipe's jobs locally (one process each) or on Hugging Face "
                    "Jobs. Arguments after `--` replace the trainer's grpo-lab arguments.")
    launch.add_argument("--backend", choices=("local", "hf-jobs"), default="local",
                        help=field_docs(RecipeConfig)["backend"])
    add_config_flags(launch, RecipeConfig, exclude=("backend",))
    launch.add_argument("--dry-run", action="store_true",
                        help="print the plan and the equivalent commands; start nothing")
    launch.add_argument("--run-dir", default=None,
                        help="local backend: folder for logs and plan.json (default: runs/<run-name>)")
    launch.add_argument("--namespace", default=None, help="hf-jobs: user or org running the jobs")
    launch.add_argument("trainer_args", nargs="*",
                        help="after `--`: the trainer's grpo-lab arguments, with {model}, "
                             "{proxy_url}, {output_dir}, {lora_rank}, {max_staleness} filled in")


def launch_main(args: argparse.Namespace) -> int:
    """`grpo-lab launch`: build the plan, then print it (--dry-run), run it, or submit it."""
    try:
        return _launch(args)
    except LaunchError as exc:  # a job failed to start: its log tail, no traceback
        print(f"grpo-lab launch: {exc}", file=sys.stderr)
        return 1


def _launch(args: argparse.Namespace) -> int:
    from .cli import config_from_args

    config = config_from_args(args, RecipeConfig)
    extra = {"trainer_args": args.trainer_args} if args.trainer_args else {}
    plan = recipe_plan(config, **extra)
    run_dir = Path(args.run_dir or Path("runs") / plan.name)
    if args.dry_run:
        print(plan.describe(), end="\n\n")
        if plan.backend == "local":
            print(local_commands(plan, run_dir))
        else:
            print(hf_jobs_commands(plan, args.namespace))
        return 0
    if plan.backend == "hf-jobs":
        launcher = HfJobsLauncher(plan, namespace=args.namespace)
        for name, info in launcher.submit().items():
            print(f"{name}: {getattr(info, 'url', info.id)}")
        print(f"replicas at: {', '.join(launcher.urls.values())}")
        return 0
    # Local: stop the jobs on SIGTERM too (`kill <pid>` of this command), not only on Ctrl-C
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    print(f"starting {', '.join(plan.names)}; logs in {run_dir / 'logs'}", flush=True)
    try:
        with LocalLauncher(plan, run_dir) as run:
            print(json.dumps(run.status(), indent=2), flush=True)
            code = run.wait("trainer")
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(f"trainer exited with code {code}")
    return code


def _main(argv: list[str] | None = None) -> int:
    """`python -m grpo_lab.launchers wait-healthy URL`: used inside the HF trainer job."""
    parser = argparse.ArgumentParser(prog="python -m grpo_lab.launchers")
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
