"""The process-group toolkit: start a command in a process group of its own, wait until it answers,
stop its whole group; every part of grpo_lab that runs other processes uses these.

    spawn           Popen in a process group of its own (start_new_session), output to a log
    wait_healthy    GET a URL until 200; fail as soon as the process behind it exits
    stop_groups     SIGTERM the groups, SIGKILL what is left after a grace period
    signal_group    a signal to a whole group (gone or foreign groups are skipped)
    is_alive        a pid that exists and is not a zombie
    group_members   the live processes of a group (/proc)
    free_port       a TCP port nobody listens on right now

Servers started as processes (`start_server_process`) are grpo_lab.serve.process; the proxy's,
grpo_lab.proxy.config; a run plan's jobs, grpo_lab.launch.local.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

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
                 poll_s: float = 0.2, headers: dict[str, str] | None = None,
                 on_poll: Callable[[float, str], None] | None = None) -> None:
    """Poll `url` (with `headers`) until it answers 200. Raises TimeoutError at the deadline, or
    ChildProcessError as soon as `alive()` says the process behind it has exited. `on_poll`
    gets the seconds waited and the last answer after each try that was not 200."""
    start = time.monotonic()
    deadline = start + timeout_s
    last = "no answer yet"
    while True:
        if alive is not None and not alive():
            raise ChildProcessError(f"exited before {url} answered ({last})")
        try:
            request = urllib.request.Request(url, headers=headers or {})
            with urllib.request.urlopen(request,
                                        timeout=min(5.0, max(0.5, timeout_s))) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (OSError, ValueError) as exc:
            last = type(exc).__name__
        if on_poll is not None:
            on_poll(time.monotonic() - start, last)
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
    """Send `sig` to process group `pgid`; a group that is gone (or not ours) is skipped."""
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
