"""Start a server as a process, wait until it is ready, stop it.

Notebooks, tests and benchmarks start servers through `start_server_process`, never by pasting
shell: it picks a free port, waits until the server is ready, and `stop()` (or leaving the `with`
block) ends exactly the process group it started. `spawn_until_ready` is shared with the proxy
and real vLLM; `serve_until_signalled` is the loop the server and the proxy run in.

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
import time
from pathlib import Path

from ..util.argv import flag_args
from ..util.processes import (
    spawn,
    stop_groups,
    wait_healthy,
)

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
    (VLLM_SERVER_DEV_MODE, VLLM_ALLOW_RUNTIME_LORA_UPDATING). On the CPU the server uses one
    torch thread unless `num_threads` says otherwise; on a GPU torch's own unless it is given.
    Raises RuntimeError (with the log's tail) if it does not come up in time; the process is
    stopped in that case.
    """
    from ..util.devices import default_threads

    threads = default_threads(flags.get("device", "auto"), flags.get("num_threads"))
    if threads:
        flags["num_threads"] = threads
    api_key = flags.pop("api_key", None)  # through the environment, never argv (ps shows it)
    args = [*GRPO_LAB, *serve_args(model, host, port, **flags)]
    proc_env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0",
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1" if runtime_lora_updating else "0",
                **({"OMP_NUM_THREADS": str(threads)} if threads else {}),
                **({"VLLM_API_KEY": api_key} if api_key else {}),
                "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **(env or {})}
    return spawn_until_ready(args, proc_env, ready_marker=READY_MARKER, ready_path="/health",
                             what="server", log_path=log_path, startup_timeout_s=startup_timeout_s,
                             api_key=api_key or proc_env.get("VLLM_API_KEY"))


def spawn_until_ready(args: list[str], env: dict, *, ready_path: str, what: str,
                      ready_marker: str | None = None, url: str | None = None,
                      log_path: str | os.PathLike | None = None,
                      startup_timeout_s: float = 180.0,
                      api_key: str | None = None) -> ServerProcess:
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
