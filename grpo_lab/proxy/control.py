"""The proxy's control routes (grpo_lab.proxy.app): everything but the completions.

    POST /pause, /resume              sent to every replica in routing
    POST /v1/load_lora_adapter        every replica in routing or none (grpo_lab.proxy.broadcast);
                                      one operation per adapter name at a time
    POST /v1/unload_lora_adapter      every replica in routing
    GET  /health                      200 only if every replica answers 200
    GET  /server_info, /v1/models     from one healthy replica; data_parallel_size 1
    GET  /proxy/stats                 the router's and the proxy's counters, as JSON
    anything else                     404 (405 for a known path with another method)

A broadcast goes to the replicas in routing; one that is down catches up when it comes back
(`_resync`, grpo_lab.proxy.replicas). Loads and pause/resume are shielded: a client that hangs
up does not cut them in half.
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
import time

from aiohttp import web

from ..serving.protocol import error_body
from .broadcast import (
    LOAD_PATH,
    UNLOAD_PATH,
    BroadcastResult,
    UpstreamError,
    broadcast,
    load_everywhere,
    unload_everywhere,
)
from .config import ProxyConfig
from .router import PrefixRouter

BROADCAST_PATHS = ("/pause", "/resume", LOAD_PATH, UNLOAD_PATH)
KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/health", "/server_info",
               "/v1/models", "/proxy/stats", *BROADCAST_PATHS)


class ProxyControl:
    """The control half of `Proxy` (a mixin): `_send`, `_probe`, `_mark_down` and `_lock` come
    from `ProxyReplicas`, `_error` from `Proxy`."""

    config: ProxyConfig
    replicas: list[str]
    router: PrefixRouter
    counters: dict
    down_reasons: dict[str, str]
    _started: float  # time.monotonic() at start

    async def adapter_op(self, request: web.Request) -> web.Response:
        """Load or unload on every replica, one operation per adapter name at a time."""
        load = request.path == LOAD_PATH
        try:
            body = json.loads(await request.read())
        except ValueError as exc:
            return self._error(400, f"Invalid JSON body: {exc}", "bad_request")
        body = body if isinstance(body, dict) else {}
        name, path = body.get("lora_name"), body.get("lora_path")
        if not (isinstance(name, str) and name) or (load and not (isinstance(path, str) and path)):
            message = ("Both 'lora_name' and 'lora_path' must be provided." if load else
                       "'lora_name' needs to be provided to unload a LoRA adapter.")
            return self._error(400, message, "bad_request")
        self.counters["broadcasts"][request.path.rsplit("/", 1)[1]] += 1
        # shield: a client that hangs up must not cut a load in half (no partial fleet)
        result = await asyncio.shield(asyncio.ensure_future(self._adapter_op(load, name, body)))
        return self._broadcast_answer(result)

    def _up(self) -> list[str]:
        """Replicas in routing: broadcasts go to these. One that is down catches up when it
        comes back (`_resync`), so it must not fail a broadcast meanwhile."""
        return [r for r in self.replicas if r not in self.down_reasons]

    async def _broadcast_send(self, replica: str, path: str, body: dict | None,
                              timeout_s: float) -> tuple[int, str]:
        """`_send` for broadcasts: a refused connection takes the replica out at once, so the
        caller's retry of the broadcast goes to the replicas that are left."""
        try:
            return await self._send(replica, path, body, timeout_s)
        except UpstreamError as exc:
            if exc.kind == "connect":
                self._mark_down(replica, exc.message)
            raise

    async def _adapter_op(self, load: bool, name: str, body: dict) -> BroadcastResult:
        async with self._lock(name):
            cfg = self.config
            replicas = self._up()
            if not replicas:
                return BroadcastResult(503, error_body(
                    f"no replica is up ({self.down_reasons})", 503), {})
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

    async def pause_resume(self, request: web.Request) -> web.Response:
        self.counters["broadcasts"][request.path.lstrip("/")] += 1
        replicas = self._up()
        if not replicas:
            return self._error(503, f"no replica is up ({self.down_reasons})", "no_replica")
        result = await asyncio.shield(asyncio.ensure_future(broadcast(
            self._broadcast_send, replicas, request.path_qs, None,
            self.config.request_timeout_s)))
        return self._broadcast_answer(result)

    async def health(self, request: web.Request) -> web.Response:
        reasons = await asyncio.gather(*(self._probe(r) for r in self.replicas))
        bad = {r: why for r, why in zip(self.replicas, reasons) if why}
        if not bad:
            return web.Response(status=200)
        message = f"{len(bad)} of {len(self.replicas)} replicas are not healthy: {bad}"
        return web.json_response(error_body(message, 503), status=503)

    async def one_answer(self, request: web.Request) -> web.Response:
        """/server_info and /v1/models: the first replica that answers (up replicas first)."""
        order = sorted(self.replicas, key=lambda r: r in self.down_reasons)
        why = "no replica"
        for replica in order:
            try:
                status, text = await self._send(replica, request.path_qs, None,
                                                self.config.control_timeout_s, "GET")
            except UpstreamError as exc:
                why = exc.message
                continue
            if status >= 500:
                why = f"{replica} answered {status}"
                continue
            if request.path == "/server_info" and status == 200:
                text = _one_replica_info(text)
            ctype = "application/json" if text.lstrip()[:1] in ("{", "[") else "text/plain"
            return web.Response(text=text, status=status, content_type=ctype,
                                headers={"X-Proxy-Upstream": replica})
        return self._error(503, f"no replica answered {request.path}: {why}", "no_replica")

    def stats(self) -> dict:
        out = self.router.stats()
        out.update(json.loads(json.dumps(self.counters)))  # a copy
        out.update(upstreams=self.replicas, down_reasons=dict(self.down_reasons),
                   uptime_s=round(time.monotonic() - self._started, 1))
        return out

    async def stats_route(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def not_found(self, request: web.Request) -> web.Response:
        if request.path in KNOWN_PATHS:
            return web.json_response({"detail": "Method Not Allowed"}, status=405)
        self.counters["errors"]["not_found"] += 1
        return web.json_response({"detail": "Not Found"}, status=404)


def _one_replica_info(text: str) -> str:
    """The fleet presents itself as one server: data_parallel_size 1 (TRL checks it)."""
    try:
        data = json.loads(text)
        config = data["vllm_config"]
    except (ValueError, KeyError, TypeError):
        return text
    if isinstance(config, dict):
        config.setdefault("parallel_config", {})["data_parallel_size"] = 1
    elif isinstance(config, str):  # ?config_format=text: a printed dict
        data["vllm_config"] = re.sub(r"'data_parallel_size': \d+", "'data_parallel_size': 1",
                                     config)
    return json.dumps(data)
