"""Start `grpo-lab proxy` (grpo_lab.proxy) as a separate process and stop it again, from Python.

Notebooks, tests and benchmarks start the proxy through `start_proxy_process`, as they start
servers through grpo_lab.server_process: it waits until the proxy says it is ready and answers
/proxy/stats, and `stop()` (or leaving the `with` block) ends exactly the process group it started.

    with start_proxy_process([replica_a.url, replica_b.url], lora_retry_s=0.5) as proxy:
        print(proxy.url)             # http://127.0.0.1:40217
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from .server_process import ServerProcess

READY_MARKER = "GRPO_LAB_PROXY_READY"


def start_proxy_process(upstreams: list[str], *, host: str = "127.0.0.1", port: int = 0,
                        env: dict | None = None, log_path: str | os.PathLike | None = None,
                        startup_timeout_s: float = 60.0, **flags) -> ServerProcess:
    """Start `grpo-lab proxy --upstream URL ...` in its own process group; returns a handle with
    `.url` and `.stop()` (also a context manager). `flags` are ProxyConfig fields
    (`lora_retry_s=0.5` -> `--lora-retry-s 0.5`). Pass tokens through `env`, never argv."""
    args = [sys.executable, "-m", "grpo_lab.cli", "proxy", "--host", host, "--port", str(port)]
    for url in upstreams:
        args += ["--upstream", url]
    for name, value in flags.items():
        if value is not None:
            args += ["--" + name.replace("_", "-"), str(value)]
    if log_path is None:
        fd, log_path = tempfile.mkstemp(prefix="grpo-lab-proxy-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    handle = ServerProcess(proc, log_path)
    deadline = time.monotonic() + startup_timeout_s
    try:
        while handle.url is None:
            for line in handle.log_text().splitlines():
                if line.startswith(READY_MARKER):
                    handle.url = line.split()[1]
            if handle.url is None:
                if not handle.running():
                    raise RuntimeError(f"the proxy exited with status {proc.returncode}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the proxy did not start in {startup_timeout_s} s")
                time.sleep(0.05)
        with urllib.request.urlopen(handle.url + "/proxy/stats", timeout=10) as reply:
            if reply.status != 200:
                raise RuntimeError(f"/proxy/stats answered {reply.status}")
        return handle
    except BaseException as exc:
        handle.stop()
        if isinstance(exc, RuntimeError | OSError):
            raise RuntimeError(f"{exc}; command: {' '.join(args)}\nlog ({log_path}):\n"
                               f"{handle.log_text()[-3000:]}") from None
        raise
