"""The settings of `grpo-lab proxy` (grpo_lab.proxy.app): one dataclass, a docstring under each
field (the CLI's help, see grpo_lab.cli.flags), checked when it is built so that a bad flag fails
before anything listens."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

from ..serve.process import GRPO_LAB, ServerProcess, spawn_until_ready
from ..util.argv import flag_args
from .router import RouterConfig

LOCAL_HEALTH_TIMEOUT_S, LOCAL_HEALTH_FAILURES = 5.0, 2
"""Mark-down defaults when every upstream is on this machine: a stalled replica leaves fast."""
REMOTE_HEALTH_TIMEOUT_S, REMOTE_HEALTH_FAILURES = 20.0, 5
"""Mark-down defaults when an upstream is remote (behind HF Jobs' public proxy): patient."""
EVENT_LOOPS = ("uvloop", "asyncio")


def is_loopback(url: str) -> bool:
    """Whether the URL's host is this machine (localhost, 127.0.0.0/8, ::1)."""
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: remote
        return False


@dataclass
class ProxyConfig(RouterConfig):
    """Flags of `grpo-lab proxy` (the reference proxy's UPSTREAM_URLS and PROXY_* settings). The
    router's knobs (block_size, imbalance, max_tracked_blocks, routing) are RouterConfig's fields,
    inherited: one definition, one default, one help text."""

    upstreams: list[str] = field(default_factory=list)
    """Base URLs of the replicas, e.g. http://10.0.0.2:8000 (`--upstream URL`, once per replica)."""
    host: str = "127.0.0.1"
    """Interface to bind (127.0.0.1 = this machine only: the trainer runs next to the proxy)."""
    port: int = 8000
    """TCP port (0 = any free port; the chosen one is printed)."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` from clients on every route but /health, as
    `vllm serve --api-key` (default: $VLLM_API_KEY; pass it there, not on the command line)."""
    upstream_token_env: str | None = None
    """Environment variable holding the token sent upstream as `Authorization: Bearer <token>`
    (e.g. HF_TOKEN: exposed HF Jobs ports need it). Incoming Authorization headers are dropped."""
    tokenizer: str | None = None
    """Tokenizer (path or hub id) for routing text and chat prompts; default: UTF-8
    pseudo-tokens."""
    lora_retry_s: float = 2.0
    """Seconds between retries of a replica that answers 'No adapter found' to a load."""
    lora_load_timeout_s: float = 300.0
    """Deadline of a broadcast load; past it the load is rolled back and answered 504."""
    conn_limit: int = 1024
    """Most open connections to the replicas for completions (all replicas together)."""
    request_timeout_s: float = 1800.0
    """Longest wait for a completion's answer before 504."""
    connect_timeout_s: float = 5.0
    """Longest wait to open a connection to a replica."""
    control_timeout_s: float = 60.0
    """Longest wait for /pause, /resume, /server_info, /v1/models and unloads."""
    health_interval_s: float = 1.0
    """Seconds between health probes of every replica."""
    health_timeout_s: float | None = None
    """A health probe without an answer after this long counts as a failure. None = set by
    the upstreams: 5 s when every one is on this machine (loopback), 20 s when any is remote
    (an HF Jobs replica answers through a public proxy, whose latency can spike for seconds)."""
    health_failures: int | None = None
    """Failed probes in a row, or refused connections in a row, that take a replica out of
    routing. None = set by the upstreams: 2 on loopback, 5 when any is remote (so a few slow
    answers or one refused connection through a public proxy do not drop a healthy replica)."""
    stats_every_s: float = 60.0
    """Print the routing counters every S seconds (0 = never)."""
    max_request_bytes: int = 16 * 2**20
    """Largest request body accepted (413 above)."""
    event_loop: str = "uvloop"
    """The event loop the proxy runs on: `uvloop` (libuv's: less CPU per request, measured in
    benchmarks/proxy_overhead.py) or `asyncio` (the standard library's). Where uvloop is not
    installed (Windows) the proxy says so and runs on asyncio's."""

    def __post_init__(self):
        self.upstreams = [u.rstrip("/") for u in self.upstreams]
        remote = not all(is_loopback(u) for u in self.upstreams)
        if self.health_timeout_s is None:  # computed at runtime from the upstreams
            self.health_timeout_s = REMOTE_HEALTH_TIMEOUT_S if remote else LOCAL_HEALTH_TIMEOUT_S
        if self.health_failures is None:  # computed at runtime from the upstreams
            self.health_failures = REMOTE_HEALTH_FAILURES if remote else LOCAL_HEALTH_FAILURES
        problems = []
        try:
            super().__post_init__()  # the router's knobs
        except ValueError as exc:
            problems.append(str(exc))
        if not self.upstreams:
            problems.append("need at least one --upstream URL")
        for url in self.upstreams:
            if not re.match(r"^https?://[^/\s]+(/\S*)?$", url):
                problems.append(f"upstream {url!r} is not an http(s):// URL")
        if len(set(self.upstreams)) != len(self.upstreams):
            problems.append(f"upstreams must be distinct, got {self.upstreams}")
        for name in ("lora_retry_s", "lora_load_timeout_s", "request_timeout_s",
                     "connect_timeout_s", "control_timeout_s", "health_interval_s",
                     "health_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"{name} must be > 0 (got {getattr(self, name)})")
        for name in ("conn_limit", "health_failures", "max_request_bytes"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.event_loop not in EVENT_LOOPS:
            problems.append(f"event_loop must be one of {', '.join(EVENT_LOOPS)} "
                            f"(got {self.event_loop!r})")
        if not 0 <= self.port < 65536:
            problems.append(f"port must be in 0..65535 (got {self.port})")
        if problems:
            raise ValueError("invalid ProxyConfig: " + "; ".join(problems))

    def router_config(self) -> RouterConfig:
        """The router's knobs as this proxy was given them (RouterConfig checks them)."""
        return RouterConfig(**{f.name: getattr(self, f.name) for f in fields(RouterConfig)})


# ------------------------------------------------------------ the proxy as a process
# Start `grpo-lab proxy` (grpo_lab.proxy.app) as a separate process and stop it again, from Python.
#
# Notebooks, tests and benchmarks start the proxy through `start_proxy_process`, as they start
# servers through grpo_lab.serve.process: it waits until the proxy says it is ready and answers
# /proxy/stats, and `stop()` (or leaving the `with` block) ends exactly the process group it
# started.
#
#     with start_proxy_process([replica_a.url, replica_b.url], lora_retry_s=0.5) as proxy:
#         print(proxy.url)             # http://127.0.0.1:40217


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
