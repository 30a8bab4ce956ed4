"""The replicas behind the proxy (grpo_lab.proxy.app): calls to them, which of them are in routing.

    _send     one control call (probes, broadcasts, /server_info): a session of its own, so
              probes never queue behind long completions
    _call     one completion over the lean pool (http_pool.py); `_mark_down` cuts it short
    _probe    GET /health every `health_interval_s`; `health_failures` failures in a row, or a
              refused connection, take a replica out of routing (`_mark_down`) and fail its
              requests in flight (503)
    _resync   a replica that answers again gets a healthy peer's adapters (what it lacks loaded,
              what the fleet dropped meanwhile unloaded) before it is routed to again

A call that gets no HTTP answer becomes an `UpstreamError` (`transport_error`), whose `kind`
says what the proxy does next: `connect` takes the replica out, the others answer 502/504.
"""

from __future__ import annotations

import asyncio
import json
import sys
import weakref

import aiohttp

from .broadcast import LOAD_PATH, UNLOAD_PATH, UpstreamError
from .config import ProxyConfig
from .http_pool import ConnectFailed, ConnectionPool, InvalidResponse
from .router import PrefixRouter


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


class ProxyReplicas:
    """The replica half of `Proxy` (a mixin): `Proxy.__init__` and `Proxy.start` set this state."""

    config: ProxyConfig
    replicas: list[str]
    router: PrefixRouter
    counters: dict
    down_reasons: dict[str, str]  # replica -> why it is out of routing
    _pool: ConnectionPool | None  # completions
    _control: aiohttp.ClientSession | None  # probes and broadcasts
    _calls: dict[str, set[asyncio.Task]]  # tasks waiting on each replica
    _killed: dict[asyncio.Task, str]  # ... cancelled because their replica went down
    _failures: dict[str, int]  # failed probes in a row
    _locks: weakref.WeakValueDictionary  # adapter name -> its lock

    # ------------------------------------------------------------------ replicas up and down

    def _mark_down(self, replica: str, reason: str) -> None:
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

    async def _probe(self, replica: str) -> str:
        """'' if /health answers 200, else why not."""
        try:
            async with self._control.get(replica + "/health", timeout=aiohttp.ClientTimeout(
                    total=self.config.health_timeout_s)) as reply:
                await reply.read()
                return "" if reply.status == 200 else f"/health answered {reply.status}"
        except (aiohttp.ClientError, OSError) as exc:
            return transport_error(replica, exc, self.config.health_timeout_s).message

    async def _probe_forever(self) -> None:
        while True:
            reasons = await asyncio.gather(*(self._probe(r) for r in self.replicas))
            for replica, why in zip(self.replicas, reasons):
                if why:
                    self._failures[replica] += 1
                    if self._failures[replica] >= self.config.health_failures:
                        self._mark_down(replica, f"health probe: {why}")
                    continue
                self._failures[replica] = 0
                if replica in self.down_reasons:
                    why = await self._resync(replica)
                    if why:
                        self.down_reasons[replica] = why
                    else:
                        del self.down_reasons[replica]
                        self.router.mark_up(replica)
                        print(f"grpo-lab proxy: {replica} is back in routing", file=sys.stderr)
            self._pool.prune()  # close connections idle for too long
            await asyncio.sleep(self.config.health_interval_s)

    async def _adapters(self, replica: str) -> dict[str, str]:
        """{name: path} of the adapter cards in the replica's /v1/models."""
        status, text = await self._send(replica, "/v1/models", None, self.config.control_timeout_s,
                                         "GET")
        if status != 200:
            raise UpstreamError(502, f"{replica}/v1/models answered {status}", "closed")
        return {c["id"]: c.get("root") for c in json.loads(text)["data"] if c.get("parent")}

    def _lock(self, name: str) -> asyncio.Lock:
        """One adapter operation per name at a time (broadcasts and resyncs)."""
        return self._locks.setdefault(name, asyncio.Lock())

    async def _resync(self, replica: str) -> str:
        """Before routing to a replica that came back, give it the adapters of a healthy peer:
        load what it lacks (a restarted server has none), unload what the peer dropped while it
        was away. Returns '' or why it stays out of routing."""
        peers = [r for r in self.replicas if r != replica and r not in self.down_reasons]
        if not peers:
            return ""
        timeout_s = self.config.control_timeout_s
        try:
            want, have = await self._adapters(peers[0]), await self._adapters(replica)
            for name in sorted(want.keys() ^ have.keys()):
                async with self._lock(name):  # no broadcast of this name is half done now
                    want, have = await self._adapters(peers[0]), await self._adapters(replica)
                    if name in want and name not in have:
                        status, text = await self._send(replica, LOAD_PATH, {
                            "lora_name": name, "lora_path": want[name]}, timeout_s)
                    elif name in have and name not in want:
                        status, text = await self._send(replica, UNLOAD_PATH,
                                                        {"lora_name": name}, timeout_s)
                    else:
                        continue
                if status != 200:
                    return f"back, but adapter {name!r} could not be synced: {status} {text[:200]}"
                self.counters["resynced_adapters"] += 1
        except (UpstreamError, ValueError, KeyError, TypeError) as exc:
            return f"back, but its adapters could not be synced: {exc}"
        return ""

    # ------------------------------------------------------------------ upstream calls

    async def _send(self, replica: str, path: str, body: dict | None, timeout_s: float,
                    method: str = "POST") -> tuple[int, str]:
        """One control call (broadcasts, probes, one-answer routes): (status, text)."""
        try:
            async with self._control.request(method, replica + path, json=body,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status, await r.text(errors="replace")
        except (aiohttp.ClientError, OSError) as exc:
            raise transport_error(replica, exc, timeout_s) from None

    async def _call(self, replica: str, path: str, data: bytes) -> tuple[int, bytes, str]:
        """POST a completion to one replica -> (status, body, content type). `_mark_down` cuts
        it short by cancelling the calling task, which then raises UpstreamError (503)."""
        task = asyncio.current_task()
        calls = self._calls[replica]
        calls.add(task)
        try:
            return await self._pool.post(replica + path, data, self.config.request_timeout_s)
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
