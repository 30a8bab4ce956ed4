"""A call from the proxy to a replica: its control routes, what a call without an HTTP answer
becomes (`UpstreamError`, whose `kind` says what the proxy does next: `connect` counts towards
taking the replica out, the others answer 502/504), and what a call to every replica returns.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from ..serve.protocol import parse_error
from .http_pool import ConnectFailed, InvalidResponse

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"


class UpstreamError(Exception):
    """No usable HTTP answer from a replica: `status` is what the proxy answers (502, 503, 504)."""

    def __init__(self, status: int, message: str, kind: str):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind



Send = Callable[..., Awaitable[tuple[int, str]]]  # (replica, path, body, timeout_s[, method])


def upstream_message(text: str) -> str:
    """The `message` of an error answer (protocol's `parse_error`), shortened."""
    return parse_error(text)[0][:300]


def transport_error(replica: str, exc: BaseException, timeout_s: float) -> UpstreamError:
    """A failed call with no HTTP answer -> what the proxy answers (kind drives what it does)."""
    if isinstance(exc, ConnectFailed | aiohttp.ConnectionTimeoutError |
                  aiohttp.ClientConnectorError):
        return UpstreamError(503, f"cannot connect to replica {replica}: {exc}", "connect")
    if isinstance(exc, TimeoutError):
        return UpstreamError(504, f"replica {replica} did not answer within {timeout_s:g} s",
                             "timeout")
    if isinstance(exc, InvalidResponse):
        return UpstreamError(502, f"replica {replica} sent an invalid HTTP response: {exc}",
                             "closed")
    return UpstreamError(502, f"replica {replica} closed the connection before answering "
                         f"({type(exc).__name__}: {exc})", "closed")


@dataclass
class BroadcastResult:
    """What the proxy answers, and what happened on each replica."""

    status: int
    body: str | dict  # text is relayed as it came (vLLM's plain-text success), dicts as JSON
    per_replica: dict[str, str] = field(default_factory=dict)
    retries: int = 0  # "No adapter found" answers that were retried
    rolled_back: list[str] = field(default_factory=list)  # unloaded again after a failed load
    rollback_failed: list[str] = field(default_factory=list)  # may still hold the adapter
    timed_out: bool = False
