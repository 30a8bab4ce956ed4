"""The local launcher: start a `RunPlan` (grpo_lab.launch.specs) as processes on this machine.

    with LocalLauncher(recipe_plan(), "runs/r1") as run:   # each job: its own process group
        run.wait("trainer")                                 # and log file, runs/r1/logs/<job>.log
    # leaving the block (normally, by an error, or Ctrl-C) stops every job it started

Each job is started, health-checked and stopped as a process group, so nothing it spawned
outlives the run (docs/internals.md, "The local launcher"). `python3 -m grpo_lab.launch.local
wait-healthy URL` runs `wait_healthy` from a shell (the HF trainer job waits for its proxy so).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..util.processes import is_alive, signal_group, spawn, stop_groups, wait_healthy
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


def fill_urls(text: str, urls: dict[str, str]) -> str:
    """`{url:<job>}` placeholders in `text` -> the URLs in `urls` (job name -> URL)."""
    return URL_PLACEHOLDER.sub(lambda m: urls[m.group(1)], text)


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
        self._finalizer = weakref.finalize(self, stop_groups, self._started, grace_s)

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
        try:
            proc = spawn(command, env, self.log_path(job.name), append=True, cwd=self.run_dir,
                         die_with_parent=True)
        except OSError as exc:
            raise LaunchError(f"job {job.name!r} could not start: {exc}") from exc
        self.procs[job.name] = proc
        self._started.append(proc)

    def preempt_and_restart(self, name: str) -> int:
        """Kill job `name` with SIGKILL (its whole process group, as a reclaimed machine goes)
        and start it again with the same command, as a platform restarts a preempted job.
        Returns the killed process's exit code (-9)."""
        proc = self.procs[name]
        if proc.poll() is None:
            signal_group(proc.pid, signal.SIGKILL)
        code = proc.wait(timeout=30)
        self._start_job(self.plan[name])
        self._wait_healthy(self.plan[name])
        return code

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
            self._finalizer()  # runs stop_groups once, then detaches

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
                code = proc.returncode
                out[job.name] = "exited (0)" if code == 0 else f"failed (code {code})"
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
        ready = f" (ready when {job.health_url} answers 200)" if job.health_url else ""
        lines.append(f"# {job.name}{ready}")
        lines.append(f"{env} {shlex.join(job.command)}".strip())
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python3 -m grpo_lab.launch.local wait-healthy URL`: used inside the HF trainer job."""
    parser = argparse.ArgumentParser(prog="python3 -m grpo_lab.launch.local")
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
    sys.exit(main())


# --- Which GPUs each local job gets
# Which GPUs each job of a local plan gets (grpo_lab.launch.recipe_plan), on a machine that has
# some.
#
# One GPU per replica and the rest to the trainer (one process per GPU, FSDP2, when it has
# several: grpo_lab.launch.trainer_args). With fewer GPUs than jobs they share: the trainer keeps
# GPU 0 to itself when there are two or more, and the replicas split the others, each capped at
# its part of the memory (`--gpu-memory-utilization`, the plan's value split between them):
#
#     GPUs   trainer          replica-0        replica-1        (2 replicas, 0.85 by default)
#     0      the CPU          the CPU          the CPU          today's plan: one thread each
#     1      0, the rest      0, 0.21          0, 0.21          half the GPU left to the trainer
#     2      0                1, 0.42          1, 0.42
#     4      0,1 (FSDP2)      2, 0.85          3, 0.85          the blog's layout
#     8      0-5 (FSDP2)      6, 0.85          7, 0.85
#
# GPUs are named as this process sees them: `CUDA_VISIBLE_DEVICES=2,3 grpo-lab launch` plans over
# GPUs 2 and 3, and `CUDA_VISIBLE_DEVICES= grpo-lab launch` plans for the CPU.


TRAINER_SHARE = 0.5
"""On a GPU the trainer shares with replicas (a machine with one GPU), the part of
`--gpu-memory-utilization` left to the trainer: the replicas split the rest of it."""


@dataclass(frozen=True)
class JobDevices:
    """The GPUs one job of a local plan sees."""

    gpus: tuple[str, ...]
    """Its CUDA_VISIBLE_DEVICES, one entry per GPU (the job numbers them from 0)."""
    memory_fraction: float | None = None
    """Replicas: the most of their GPU's memory they may take (`--gpu-memory-utilization`).
    None for the trainer, which takes what the replicas leave."""

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(self.gpus)


def visible_gpus() -> list[str]:
    """This machine's GPUs as a job must name them in CUDA_VISIBLE_DEVICES: the entries of this
    process's own CUDA_VISIBLE_DEVICES when it is set, else 0 .. N-1 (torch.cuda.device_count)."""
    import torch

    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is None:
        return [str(i) for i in range(count)]
    return [name.strip() for name in listed.split(",") if name.strip()][:count]


def assign_devices(gpus: int | Sequence[str], replicas: int,
                   gpu_memory_utilization: float = 0.85) -> dict[str, JobDevices]:
    """{"trainer": ..., "replica-0": ..., ...} for `gpus` GPUs (a count, numbered from 0, or
    their names); {} without any (every job on the CPU). `gpu_memory_utilization`: what one
    replica takes of a GPU of its own; replicas sharing a GPU split it."""
    names = [str(i) for i in range(gpus)] if isinstance(gpus, int) else list(gpus)
    if not names:
        return {}
    if len(names) > replicas:  # enough for all: a GPU per replica, the rest to the trainer
        trainer, replica_gpus = names[:-replicas], names[-replicas:]
    elif len(names) > 1:  # the trainer alone on the first, the replicas share the others
        trainer, replica_gpus = names[:1], names[1:]
    else:  # one GPU for every job
        trainer, replica_gpus = names, names
    placed = [replica_gpus[i % len(replica_gpus)] for i in range(replicas)]
    devices = {"trainer": JobDevices(tuple(trainer))}
    for i, gpu in enumerate(placed):
        fraction, sharing = gpu_memory_utilization, placed.count(gpu)
        if sharing > 1 or gpu in trainer:  # a part of the budget: 2 decimals, rounded down
            budget = gpu_memory_utilization * ((1 - TRAINER_SHARE) if gpu in trainer else 1)
            fraction = math.floor(round(100 * budget / sharing, 6)) / 100
        if fraction <= 0:
            raise ValueError(f"{sharing} replicas cannot share GPU {gpu} at "
                             f"gpu_memory_utilization {gpu_memory_utilization}")
        devices[f"replica-{i}"] = JobDevices((gpu,), fraction)
    return devices


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity, where the OS says)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def threads_per_process(processes: int, cores: int | None = None) -> int:
    """OMP_NUM_THREADS of each of a GPU plan's `processes`: the cores split between them (each
    process's CPU side: tokenizing, sampling; the tensors work on its GPU)."""
    return max(1, (cores or usable_cores()) // max(1, processes))
