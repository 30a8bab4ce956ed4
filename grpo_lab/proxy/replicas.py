"""The replicas behind the proxy (grpo_lab.proxy.app): calls to them, which of them are in routing.

`ReplicaSet` owns the replicas, their health and the connections to them: control calls on a
session of their own, completions over the lean pool, the health probe that takes a failing
replica out of routing, and the resync that brings it back (docs/internals.md, "proxy: inside
`grpo-lab proxy`"; the rules: docs/serving-api.md, "Replicas that fail").
"""

from __future__ import annotations

import asyncio
import json
import sys
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from ..serve.protocol import parse_error
from .config import ProxyConfig
from .http_pool import ConnectFailed, ConnectionPool, InvalidResponse
from .router import PrefixRouter

_JSON_HEADERS = {"Content-Type": "application/json"}


class ReplicaSet:
    """The replicas, which of them are in routing, and the connections to them. `open` before
    the first call, `close` after the last; `probe_forever` runs as a task in between."""

    def __init__(self, config: ProxyConfig, router: PrefixRouter, token: str | None = None):
        self.config = config
        self.router = router  # told when a replica leaves routing and when it comes back
        self.urls = list(config.upstreams)
        self.down_reasons: dict[str, str] = {}  # replica -> why it is out of routing
        self.counters = {"marked_down": 0, "resynced_adapters": 0}
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.pool: ConnectionPool | None = None  # completions travel over it (after `open`)
        self._session: aiohttp.ClientSession | None = None  # streamed completions
        self._control: aiohttp.ClientSession | None = None  # probes and broadcasts
        # tasks waiting on each replica, and those cancelled because their replica went down
        self._calls: dict[str, set[asyncio.Task]] = {r: set() for r in self.urls}
        self._killed: dict[asyncio.Task, str] = {}
        self._failures = dict.fromkeys(self.urls, 0)  # failed probes in a row
        self._refusals = dict.fromkeys(self.urls, 0)  # refused connections in a row
        self._locks: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # name -> lock
        # The fleet's pause state as the last /pause or /resume broadcast left it: the query
        # of that /pause (e.g. "/pause?mode=keep"), "/resume", or None (never broadcast; a
        # returning replica is then left as it is). Broadcasts and resyncs hold `pause_lock`.
        self.pause_state: str | None = None
        self.pause_lock = asyncio.Lock()

    async def open(self) -> None:
        cfg = self.config
        # completions: the lean pool; streamed completions: aiohttp
        self.pool = ConnectionPool(cfg.conn_limit, self._auth, cfg.connect_timeout_s)
        self._session = aiohttp.ClientSession(
            headers={**self._auth, **_JSON_HEADERS},
            connector=aiohttp.TCPConnector(limit=cfg.conn_limit, keepalive_timeout=4.0),
            timeout=aiohttp.ClientTimeout(total=cfg.request_timeout_s,
                                          sock_connect=cfg.connect_timeout_s))
        # A separate, small pool: probes must not queue behind 1,024 long completions.
        self._control = aiohttp.ClientSession(
            headers=self._auth, connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=4.0),
            timeout=aiohttp.ClientTimeout(total=cfg.control_timeout_s,
                                          sock_connect=cfg.connect_timeout_s))

    async def close(self) -> None:
        for session in (self._session, self._control):
            if session is not None:
                await session.close()
        if self.pool is not None:
            self.pool.close()

    # ------------------------------------------------------------------ replicas up and down

    def up(self) -> list[str]:
        """Replicas in routing: broadcasts go to these. One that is down catches up when it
        comes back (`_resync`), so it must not fail a broadcast meanwhile."""
        return [r for r in self.urls if r not in self.down_reasons]

    def mark_down(self, replica: str, reason: str) -> None:
        if replica in self.down_reasons:
            return
        self.down_reasons[replica] = reason
        self.router.mark_down(replica)  # it may restart with an empty prefix cache: forget it
        self.counters["marked_down"] += 1
        print(f"grpo-lab proxy: {replica} is out of routing: {reason}", file=sys.stderr)
        for task in list(self._calls[replica]):  # fail its requests in flight now, not at timeout
            if task not in self._killed:
                self._killed[task] = reason
                task.cancel()

    def refused(self, replica: str, reason: str) -> None:
        """A call to `replica` could not connect: `health_failures` in a row take it out."""
        self._refusals[replica] += 1
        if self._refusals[replica] >= self.config.health_failures:
            self.mark_down(replica, f"{self._refusals[replica]} refused connections in a row: "
                           f"{reason}")

    async def probe(self, replica: str) -> str:
        """'' if /health answers 200, else why not."""
        try:
            async with self._control.get(replica + "/health", timeout=aiohttp.ClientTimeout(
                    total=self.config.health_timeout_s)) as reply:
                await reply.read()
                return "" if reply.status == 200 else f"/health answered {reply.status}"
        except (aiohttp.ClientError, OSError) as exc:
            return transport_error(replica, exc, self.config.health_timeout_s).message

    async def probe_forever(self) -> None:
        while True:
            reasons = await asyncio.gather(*(self.probe(r) for r in self.urls))
            for replica, why in zip(self.urls, reasons):
                if why:
                    self._failures[replica] += 1
                    if self._failures[replica] >= self.config.health_failures:
                        self.mark_down(replica, f"health probe: {why}")
                    continue
                self._failures[replica] = 0
                if replica in self.down_reasons:
                    why = await self._resync(replica)
                    async with self.pause_lock:  # no /pause or /resume half done meanwhile
                        why = why or await self._resync_pause(replica)
                        if why:
                            self.down_reasons[replica] = why
                        else:
                            del self.down_reasons[replica]
                            self._refusals[replica] = 0
                            self.router.mark_up(replica)
                            print(f"grpo-lab proxy: {replica} is back in routing",
                                  file=sys.stderr)
            self.pool.prune()  # close connections idle for too long
            await asyncio.sleep(self.config.health_interval_s)

    async def _adapters(self, replica: str) -> dict[str, str]:
        """{name: path} of the adapter cards in the replica's /v1/models."""
        status, text = await self.send(replica, "/v1/models", None, self.config.control_timeout_s,
                                       "GET")
        if status != 200:
            raise UpstreamError(502, f"{replica}/v1/models answered {status}", "closed")
        return {c["id"]: c.get("root") for c in json.loads(text)["data"] if c.get("parent")}

    def adapter_lock(self, name: str) -> asyncio.Lock:
        """One adapter operation per name at a time (broadcasts and resyncs)."""
        return self._locks.setdefault(name, asyncio.Lock())

    async def _resync(self, replica: str) -> str:
        """Before routing to a replica that came back, give it the adapters of a healthy peer:
        load what it lacks (a restarted server has none), unload what the peer dropped while it
        was away. Returns '' or why it stays out of routing."""
        peers = [r for r in self.urls if r != replica and r not in self.down_reasons]
        if not peers:
            return ""
        timeout_s = self.config.control_timeout_s
        try:
            want, have = await self._adapters(peers[0]), await self._adapters(replica)
            for name in sorted(want.keys() ^ have.keys()):
                async with self.adapter_lock(name):  # no broadcast of this name is half done now
                    want, have = await self._adapters(peers[0]), await self._adapters(replica)
                    if name in want and name not in have:
                        status, text = await self.send(replica, LOAD_PATH, {
                            "lora_name": name, "lora_path": want[name]}, timeout_s)
                    elif name in have and name not in want:
                        status, text = await self.send(replica, UNLOAD_PATH,
                                                       {"lora_name": name}, timeout_s)
                    else:
                        continue
                if status != 200:
                    return f"back, but adapter {name!r} could not be synced: {status} {text[:200]}"
                self.counters["resynced_adapters"] += 1
        except (UpstreamError, ValueError, KeyError, TypeError) as exc:
            return f"back, but its adapters could not be synced: {exc}"
        return ""

    async def _resync_pause(self, replica: str) -> str:
        """Bring a returning replica to the fleet's pause state (a restarted server runs; one
        that was away may still be paused after the fleet resumed). '' or why not."""
        if self.pause_state is None:
            return ""
        try:
            status, text = await self.send(replica, self.pause_state, None,
                                           self.config.control_timeout_s)
        except UpstreamError as exc:
            return f"back, but {self.pause_state} failed: {exc.message}"
        if not 200 <= status < 300:
            return f"back, but {self.pause_state} answered {status} {text[:200]}"
        return ""

    # ------------------------------------------------------------------ upstream calls

    async def send(self, replica: str, path: str, body: dict | None, timeout_s: float,
                   method: str = "POST") -> tuple[int, str]:
        """One control call (broadcasts, probes, one-answer routes): (status, text)."""
        try:
            async with self._control.request(method, replica + path, json=body,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                self._refusals[replica] = 0
                return r.status, await r.text(errors="replace")
        except (aiohttp.ClientError, OSError) as exc:
            raise transport_error(replica, exc, timeout_s) from None

    async def call(self, replica: str, path: str, data: bytes) -> tuple[int, bytes, str]:
        """POST a completion to one replica -> (status, body, content type). `mark_down` cuts
        it short by cancelling the calling task, which then raises UpstreamError (503)."""
        task = asyncio.current_task()
        calls = self._calls[replica]
        calls.add(task)
        try:
            answer = await self.pool.post(replica + path, data, self.config.request_timeout_s)
            self._refusals[replica] = 0
            return answer
        except asyncio.CancelledError:
            reason = self._killed.pop(task, None)
            if reason is None or task.uncancel() > 0:
                raise  # (also) cancelled by someone else: the client went away
            raise UpstreamError(503, f"replica {replica} was taken out of routing while this "
                                f"request was in flight ({reason}); retry the request",
                                "down") from None
        except OSError as exc:
            raise transport_error(replica, exc, self.config.request_timeout_s) from None
        finally:
            calls.discard(task)
            self._killed.pop(task, None)

    async def relay(self, replica: str, method: str, path_qs: str, data: bytes,
                    headers: dict) -> tuple[int, dict, bytes]:
        """Any other request, passed through to one replica -> (status, headers, body)."""
        try:
            async with self._session.request(method, replica + path_qs, data=data,
                                             headers={**headers, **self._auth}) as reply:
                self._refusals[replica] = 0
                return reply.status, dict(reply.headers), await reply.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise transport_error(replica, exc, self.config.request_timeout_s) from None

    def stream(self, replica: str, path: str, data: bytes):
        """POST a streamed completion: `async with` it for the aiohttp reply, read as it comes."""
        return self._session.post(replica + path, data=data)


# ------------------------------------------------------------ a call to a replica
# A call from the proxy to a replica: its control routes, what a call without an HTTP answer
# becomes (`UpstreamError`, whose `kind` says what the proxy does next: `connect` counts towards
# taking the replica out, the others answer 502/504), and what a call to every replica returns.


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
