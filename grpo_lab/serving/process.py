"""Start an inference server as a separate process and stop it again, from Python.

Notebooks, tests and benchmarks start servers through `start_server_process`, never by pasting
shell: it picks a free port, waits until the server says it is ready, and `stop()` (or leaving the
`with` block) ends exactly the process group it started. `spawn_until_ready` is that start-and-wait,
shared with the proxy (grpo_lab.proxy.process); `serve_until_signalled` is the serving loop both
run inside their process. (Jobs of a run plan are started by grpo_lab.jobs.local instead.)

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
import urllib.request
from pathlib import Path

READY_MARKER = "GRPO_LAB_SERVER_READY"


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

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # the group we created with start_new_session
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM the server's process group, SIGKILL it after `timeout`; returns the exit code."""
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout)
        atexit.unregister(self.stop)
        return self.proc.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running() else f"exited {self.proc.returncode}"
        return f"ServerProcess(url={self.url!r}, pid={self.pid}, {state})"


def _flag_args(flags: dict) -> list[str]:
    """{"enable_lora": True, "max_loras": 4} -> ["--enable-lora", "--max-loras", "4"]."""
    args = []
    for name, value in flags.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False and value is not None:
            args += [flag, str(value)]
    return args


def start_server_process(
    model: str = "tiny",
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    dev_mode: bool = True,
    runtime_lora_updating: bool = True,
    env: dict | None = None,
    command: list[str] | None = None,
    log_path: str | os.PathLike | None = None,
    startup_timeout_s: float = 180.0,
    **flags,
) -> ServerProcess:
    """Start `grpo-lab serve MODEL --flag value ...` and wait until it answers /health.

    `flags` become CLI flags (`max_lora_rank=8` -> `--max-lora-rank 8`, `enable_lora=True` ->
    `--enable-lora`). `dev_mode` / `runtime_lora_updating` set vLLM's gates
    (VLLM_SERVER_DEV_MODE, VLLM_ALLOW_RUNTIME_LORA_UPDATING). The server uses one torch thread
    unless `num_threads` says otherwise. Raises RuntimeError (with the log's tail) if it does
    not come up in time; the process is stopped in that case.
    """
    command = command or [sys.executable, "-m", "grpo_lab.cli", "serve"]
    flags.setdefault("num_threads", 1)
    args = [*command, model, "--host", host, "--port", str(port), *_flag_args(flags)]
    proc_env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1" if dev_mode else "0",
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1" if runtime_lora_updating else "0",
                "OMP_NUM_THREADS": str(flags["num_threads"]), "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    return spawn_until_ready(args, proc_env, ready_marker=READY_MARKER, ready_path="/health",
                             what="server", log_path=log_path, startup_timeout_s=startup_timeout_s,
                             api_key=flags.get("api_key"))


def spawn_until_ready(args: list[str], env: dict, *, ready_marker: str, ready_path: str,
                      what: str, log_path: str | os.PathLike | None = None,
                      startup_timeout_s: float = 180.0, api_key: str | None = None) -> ServerProcess:
    """Start `args` in a process group of its own (output to a log file), wait for the line
    `<ready_marker> <url>` in its log, then until `<url><ready_path>` answers 200.

    On failure (it exits, or the time runs out) the process is stopped and RuntimeError names
    the command and shows the log's tail."""
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix=f"grpo-lab-{what}-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    handle = ServerProcess(proc, log_path, api_key=api_key)
    deadline = time.monotonic() + startup_timeout_s
    try:
        while handle.url is None:  # 1. the socket is bound: the log names the URL
            for line in handle.log_text().splitlines():
                if line.startswith(ready_marker):
                    handle.url = line.split()[1]
            if handle.url is None:
                if not handle.running():
                    raise RuntimeError(f"the {what} exited with status {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {what} did not start in {startup_timeout_s} s")
                time.sleep(0.05)
        while True:  # 2. it answers (a server: once its engine is healthy)
            try:
                with urllib.request.urlopen(handle.url + ready_path, timeout=5) as reply:
                    if reply.status == 200:
                        return handle
            except OSError:
                pass
            if time.monotonic() > deadline or not handle.running():
                raise RuntimeError(f"the {what} never answered {ready_path} with 200")
            time.sleep(0.1)
    except BaseException as exc:
        handle.stop()
        if isinstance(exc, RuntimeError):
            raise RuntimeError(f"{exc}; command: {' '.join(args)}\nlog ({log_path}):\n"
                               f"{handle.log_text()[-3000:]}") from None
        raise
