"""The proxy's broadcasts (grpo_lab.proxy.app): requests that change the replicas' state reach all
of them.

    POST /pause, /resume              sent to every replica in routing
    POST /reset_prefix_cache          every replica in routing (each one's prefix cache flushed)
    POST /v1/load_lora_adapter        every replica in routing or none (proxy/adapter_loads.py);
                                      one operation per adapter name at a time
    POST /v1/unload_lora_adapter      every replica in routing

A broadcast goes to the replicas in routing; one that is down catches up when it comes back
(`ReplicaSet`'s resync, grpo_lab.proxy.replicas): the adapters, and the pause state that the
last /pause or /resume left. Loads and pause/resume are shielded: a client that hangs up does
not cut them in half.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Sequence

from aiohttp import web

from ..serve.protocol import RequestError, error_body, loads_json
from .adapter_loads import load_everywhere, unload_everywhere
from .config import ProxyConfig
from .replicas import (
    LOAD_PATH,
    UNLOAD_PATH,
    BroadcastResult,
    ReplicaSet,
    Send,
    UpstreamError,
    upstream_message,
)

BROADCAST_PATHS = ("/pause", "/resume", "/reset_prefix_cache", LOAD_PATH, UNLOAD_PATH)


async def broadcast(send: Send, replicas: Sequence[str], path: str, body: dict | None,
                    timeout_s: float) -> BroadcastResult:
    """Send one request (pause, resume) to every replica at once. All 2xx, or the same status
    everywhere (e.g. 404 when a route's gate is off): relay the first answer. Else 502."""

    async def one(replica: str) -> tuple[int, str]:
        try:
            return await send(replica, path, body, timeout_s)
        except UpstreamError as exc:
            return -exc.status, exc.message  # negative: no HTTP answer came back

    answers = dict(zip(replicas, await asyncio.gather(*(one(r) for r in replicas))))
    per_replica = {r: f"{abs(st)} {upstream_message(text)}" for r, (st, text) in answers.items()}
    statuses = {st for st, _ in answers.values()}
    status, text = next(iter(answers.values()))
    if all(200 <= st < 300 for st in statuses) or (len(statuses) == 1 and status > 0):
        return BroadcastResult(status, text, per_replica)
    bad = {r: why for r, why in per_replica.items() if not 200 <= answers[r][0] < 300}
    message = f"{path} failed on {len(bad)} of {len(answers)} replicas: {bad}"
    return BroadcastResult(502, error_body(message, 502), per_replica)


class Broadcaster:
    """Pause, resume, load and unload on every replica in routing, and their counters. The
    answers the proxy makes itself come from `error` (counted by the proxy)."""

    def __init__(self, config: ProxyConfig, replicas: ReplicaSet,
                 error: Callable[..., web.Response]):
        self.config = config
        self.replicas = replicas
        self.error = error  # (status, message, kind, replica=None, param=None) -> response
        self.counters = {
            "broadcasts": {p.rsplit("/", 1)[1]: 0 for p in BROADCAST_PATHS},
            "retries": 0, "rollbacks": 0, "rollback_failures": 0, "load_timeouts": 0,
        }

    async def adapter_op(self, request: web.Request) -> web.Response:
        """Load or unload on every replica, one operation per adapter name at a time."""
        load = request.path == LOAD_PATH
        try:
            body = loads_json(await request.read())
        except RequestError as exc:
            return self.error(400, exc.message, "bad_request")
        body = body if isinstance(body, dict) else {}
        name, path = body.get("lora_name"), body.get("lora_path")
        if not (isinstance(name, str) and name) or (load and not (isinstance(path, str) and path)):
            message = ("Both 'lora_name' and 'lora_path' must be provided." if load else
                       "'lora_name' needs to be provided to unload a LoRA adapter.")
            return self.error(400, message, "bad_request")
        self.counters["broadcasts"][request.path.rsplit("/", 1)[1]] += 1
        # shield: a client that hangs up must not cut a load in half (no partial fleet)
        result = await asyncio.shield(asyncio.ensure_future(self._adapter_op(load, name, body)))
        return self._broadcast_answer(result)

    async def _broadcast_send(self, replica: str, path: str, body: dict | None,
                              timeout_s: float, method: str = "POST") -> tuple[int, str]:
        """`ReplicaSet.send` for broadcasts: refused connections count towards taking the
        replica out, so a retry of the broadcast goes to the replicas that are left."""
        try:
            return await self.replicas.send(replica, path, body, timeout_s, method)
        except UpstreamError as exc:
            if exc.kind == "connect":
                self.replicas.refused(replica, exc.message)
            raise

    async def _adapter_op(self, load: bool, name: str, body: dict) -> BroadcastResult:
        async with self.replicas.adapter_lock(name):
            cfg = self.config
            replicas = self.replicas.up()
            if not replicas:
                return BroadcastResult(503, error_body(
                    f"no replica is up ({self.replicas.down_reasons})", 503), {})
            if not load:
                return await unload_everywhere(self._broadcast_send, replicas, body,
                                               retry_s=cfg.lora_retry_s,
                                               timeout_s=cfg.control_timeout_s)
            result = await load_everywhere(self._broadcast_send, replicas, body,
                                           retry_s=cfg.lora_retry_s,
                                           timeout_s=cfg.lora_load_timeout_s,
                                           unload_timeout_s=cfg.control_timeout_s)
        self.counters["retries"] += result.retries
        self.counters["rollbacks"] += bool(result.rolled_back)
        self.counters["rollback_failures"] += len(result.rollback_failed)
        self.counters["load_timeouts"] += result.timed_out
        if result.status != 200:
            print(f"grpo-lab proxy: load of {name!r} -> {result.status}: {result.per_replica}",
                  file=sys.stderr)
        return result

    @staticmethod
    def _broadcast_answer(result: BroadcastResult) -> web.Response:
        if isinstance(result.body, dict):
            return web.json_response(result.body, status=result.status)
        ctype = "application/json" if result.body.lstrip()[:1] in ("{", "[") else "text/plain"
        return web.Response(text=result.body, status=result.status, content_type=ctype)

    async def to_every_replica(self, request: web.Request) -> web.Response:
        """/pause, /resume, /reset_prefix_cache: the same call to every replica in routing.
        A /pause or /resume that succeeds is the fleet's pause state, which a replica that
        comes back is brought to (`ReplicaSet._resync_pause`)."""
        self.counters["broadcasts"][request.path.lstrip("/")] += 1
        if not self.replicas.up():
            return self.error(503, f"no replica is up ({self.replicas.down_reasons})",
                              "no_replica")
        result = await asyncio.shield(asyncio.ensure_future(
            self._to_every_replica(request.path, request.path_qs)))
        return self._broadcast_answer(result)

    async def _to_every_replica(self, path: str, path_qs: str) -> BroadcastResult:
        async with self.replicas.pause_lock:  # no replica comes back halfway through
            replicas = self.replicas.up()
            if not replicas:
                return BroadcastResult(503, error_body(
                    f"no replica is up ({self.replicas.down_reasons})", 503), {})
            result = await broadcast(self._broadcast_send, replicas, path_qs, None,
                                     self.config.request_timeout_s)
            if path in ("/pause", "/resume") and 200 <= result.status < 300:
                self.replicas.pause_state = path_qs
            return result
