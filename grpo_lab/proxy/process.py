"""Start `grpo-lab proxy` (grpo_lab.proxy.app) as a separate process and stop it again, from Python.

Notebooks, tests and benchmarks start the proxy through `start_proxy_process`, as they start
servers through grpo_lab.serve.process: it waits until the proxy says it is ready and answers
/proxy/stats, and `stop()` (or leaving the `with` block) ends exactly the process group it started.

    with start_proxy_process([replica_a.url, replica_b.url], lora_retry_s=0.5) as proxy:
        print(proxy.url)             # http://127.0.0.1:40217
"""

from __future__ import annotations

import os

from ..serve.process import GRPO_LAB, ServerProcess, spawn_until_ready
from ..util.argv import flag_args

READY_MARKER = "GRPO_LAB_PROXY_READY"


def proxy_args(upstreams: list[str], host: str, port: int, **flags) -> list[str]:
    """`grpo-lab proxy` argv (after `grpo-lab`): one `--upstream` per replica, then `flags`,
    ProxyConfig fields (`lora_retry_s=0.5` -> `--lora-retry-s 0.5`, grpo_lab.util.argv)."""
    args = ["proxy", "--host", host, "--port", str(port)]
    for url in upstreams:
        args += ["--upstream", url]
    return args + flag_args(flags)


def start_proxy_process(upstreams: list[str], *, host: str = "127.0.0.1", port: int = 0,
                        env: dict | None = None, log_path: str | os.PathLike | None = None,
                        startup_timeout_s: float = 60.0, **flags) -> ServerProcess:
    """Start `grpo-lab proxy --upstream URL ...` in its own process group; returns a handle with
    `.url` and `.stop()` (also a context manager). `flags` are ProxyConfig fields
    (`proxy_args`). Pass tokens through `env`, never argv."""
    api_key = flags.pop("api_key", None)  # through the environment, never argv
    args = [*GRPO_LAB, *proxy_args(upstreams, host, port, **flags)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           **({"VLLM_API_KEY": api_key} if api_key else {}), **(env or {})}
    # with an API key only /health answers without it (it also waits for the replicas)
    ready_path = "/health" if env.get("VLLM_API_KEY") else "/proxy/stats"
    return spawn_until_ready(args, env, ready_marker=READY_MARKER, ready_path=ready_path,
                             what="proxy", log_path=log_path, startup_timeout_s=startup_timeout_s)
