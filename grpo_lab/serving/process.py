"""Start processes, wait until they are healthy, stop them: the one implementation of each.

Notebooks, tests and benchmarks start servers through `start_server_process`, never by pasting
shell: it picks a free port, waits until the server says it is ready, and `stop()` (or leaving the
`with` block) ends exactly the process group it started. The pieces are shared with the proxy
(grpo_lab.proxy.process) and the jobs of a run plan (grpo_lab.jobs.local):

    spawn           Popen in a process group of its own (start_new_session), output to a log
    wait_healthy    GET a URL until 200; fail as soon as the process behind it exits
    stop_groups     SIGTERM the groups, SIGKILL what is left after a grace period
    serve_args      `grpo-lab serve` argv from config values (grpo_lab.core.argv's convention)

`serve_until_signalled` is the serving loop the server and the proxy run inside their process.

    with start_server_process("tiny", enable_lora=True, max_lora_rank=8, max_loras=4) as server:
        print(server.url)            # http://127.0.0.1:40213
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from ..core.argv import flag_args

READY_MARKER = "GRPO_LAB_SERVER_READY"
GRPO_LAB = (sys.executable, "-m", "grpo_lab.cli")
"""`grpo-lab` as this interpreter runs it (the package as installed or on PYTHONPATH)."""


async def serve_until_signalled(runner) -> None:
    """Keep an aiohttp `AppRunner` serving until SIGTERM or Ctrl-C, then close it cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


class ServerProcess:
    """A running server process: `.url`, `.pid`, `.log_path`; `stop()` ends its process group."""

    def __init__(self, proc: subprocess.Popen, log_path: Path, api_key: str | None = None):
        self.proc, self.log_path, self.api_key = proc, log_path, api_key
        self.url: str | None = None
        atexit.register(self.stop)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after `timeout`; returns the exit code."""
        stop_groups([self.proc], timeout)
        atexit.unregister(self.stop)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running() else f"exited {self.proc.returncode}"
        return f"ServerProcess(url={self.url!r}, pid={self.pid}, {state})"


def serve_args(model: str, host: str, port: int, **flags) -> list[str]:
    """`grpo-lab serve` argv (after `grpo-lab`): `max_lora_rank=8` -> `--max-lora-rank 8`,
    `enable_lora=True` -> `--enable-lora`."""
    return ["serve", model, "--host", host, "--port", str(port), *flag_args(flags)]


def start_server_process(
    model: str = "tiny",
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    dev_mode: bool = True,
    runtime_lora_updating: bool = True,
    env: dict | None = None,
    log_path: str | os.PathLike | None = None,
    startup_timeout_s: float = 180.0,
    **flags,
) -> ServerProcess:
    """Start `grpo-lab serve MODEL --flag value ...` and wait until it answers /health.

    `flags` become CLI flags (`serve_args`). `dev_mode` / `runtime_lora_updating` set vLLM's gates
    (VLLM_SERVER_DEV_MODE, VLLM_ALLOW_RUNTIME_LORA_UPDATING). The server uses one torch thread
    unless `num_threads` says otherwise. Raises RuntimeError (with the log's tail) if it does
    not come up in time; the process is stopped in that case.
    """
    flags.setdefault("num_threads", 1)
    args = [*GRPO_LAB, *serve_args(model, host, port, **flags)]
    proc_env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0",
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1" if runtime_lora_updating else "0",
                "OMP_NUM_THREADS": str(flags["num_threads"]), "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    return spawn_until_ready(args, proc_env, ready_marker=READY_MARKER, ready_path="/health",
                             what="server", log_path=log_path, startup_timeout_s=startup_timeout_s,
                             api_key=flags.get("api_key"))


def spawn_until_ready(args: list[str], env: dict, *, ready_path: str, what: str,
                      ready_marker: str | None = None, url: str | None = None,
                      log_path: str | os.PathLike | None = None,
                      startup_timeout_s: float = 180.0, api_key: str | None = None) -> ServerProcess:
    """`spawn` `args` (output to a log file), wait for the line `<ready_marker> <url>` in its
    log (or take `url` as given, for a server that prints none: real vLLM), then
    (`wait_healthy`) until `<url><ready_path>` answers 200.

    On failure (it exits, or the time runs out) the process is stopped and RuntimeError names
    the command and shows the log's tail."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"grpo-lab-{what}-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    handle = ServerProcess(spawn(args, env, log_path), log_path, api_key=api_key)
    handle.url = url
    deadline = time.monotonic() + startup_timeout_s
    try:
        while handle.url is None:  # 1. the socket is bound: the log names the URL
            for line in handle.log_text().splitlines():
                if line.startswith(ready_marker):
                    handle.url = line.split()[1]
            if handle.url is None:
                if not handle.running():
                    raise RuntimeError(f"the {what} exited with status {handle.proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {what} did not start in {startup_timeout_s} s")
                time.sleep(0.05)
        try:  # 2. it answers (a server: once its engine is healthy)
            wait_healthy(handle.url + ready_path, max(0.0, deadline - time.monotonic()),
                         alive=handle.running, poll_s=0.1)
        except (TimeoutError, ChildProcessError) as exc:
            raise RuntimeError(f"the {what} never answered {ready_path} with 200: {exc}") from None
        return handle
    except BaseException as exc:
        handle.stop()
        if isinstance(exc, RuntimeError):
            raise RuntimeError(f"{exc}; command: {' '.join(args)}\nlog ({log_path}):\n"
                               f"{handle.log_text()[-3000:]}") from None
        raise


# Runs in the child before the command: ask the kernel to SIGTERM this process when the thread
# that started it dies, then become the command (exec keeps the pid and the setting).
_PDEATHSIG_SHIM = (
    "import ctypes,os,signal,sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # 1 = PR_SET_PDEATHSIG
    "if os.getppid() != int(sys.argv[1]): sys.exit(1)\n"  # the parent died before prctl
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def spawn(args: list[str], env: dict, log_path: str | os.PathLike, *, append: bool = False,
          cwd: str | os.PathLike | None = None, die_with_parent: bool = False) -> subprocess.Popen:
    """Start `args` as the leader of a new process group (so stopping the group also stops what
    it spawned), stdout and stderr to `log_path`, no stdin. `die_with_parent`: on Linux, from the
    main thread, the process gets SIGTERM when this one dies (PR_SET_PDEATHSIG), so a notebook
    kernel that is killed rather than shut down still takes it along. Raises OSError."""
    if (die_with_parent and threading.current_thread() is threading.main_thread()
            and sys.platform == "linux"):
        args = [sys.executable, "-c", _PDEATHSIG_SHIM, str(os.getpid()), *args]
    with open(log_path, "ab" if append else "wb") as log:  # the child holds its own copy
        return subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)


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


def signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_groups(procs: list[subprocess.Popen], grace_s: float) -> None:
    """SIGTERM the process group each of `procs` leads (last one first), wait until the groups
    are empty or `grace_s` passed, SIGKILL the rest and see them gone."""
    live = [p for p in procs if p.poll() is None or group_members(p.pid)]
    for proc in reversed(live):  # e.g. the trainer first, the replicas last
        signal_group(proc.pid, signal.SIGTERM)
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
            signal_group(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0  # SIGKILL is queued, not instant: see them gone
        for proc in live:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            while group_members(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.01)
