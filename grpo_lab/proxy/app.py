"""`grpo-lab proxy`: several inference replicas behind one URL, routed by KV-prefix affinity.

    grpo-lab proxy --upstream http://10.0.0.2:8000 --upstream http://10.0.0.3:8000 \\
        --port 8000 --upstream-token-env HF_TOKEN

`Proxy` builds the parts (router, replica set, completion forwarder, broadcaster, fleet info),
starts and stops them and wires the routes to them; the trainer sees one vLLM server. The routes,
auth, errors and counters: docs/serving-api.md, "The proxy in front of several replicas"; the
parts: docs/internals.md, "proxy: inside `grpo-lab proxy`".
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import sys
import time

from aiohttp import web

from ..serve.process import serve_until_signalled
from ..serve.protocol import bearer_ok, error_body
from .broadcast import BROADCAST_PATHS, Broadcaster
from .completions import CompletionForwarder
from .config import READY_MARKER, ProxyConfig
from .fleet_info import FleetInfo
from .replicas import LOAD_PATH, UNLOAD_PATH, ReplicaSet
from .router import PrefixRouter

KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/health", "/ping", "/server_info",
               "/v1/models", "/get_world_size", "/proxy/stats", *BROADCAST_PATHS)


class Proxy:
    """The proxy, built from its parts: the router, the replica set, the completion forwarder,
    the broadcaster and the fleet's info routes. It starts and stops them, answers /proxy/stats
    and unknown routes, and counts the errors it answers itself (`error`, handed to the parts)."""

    def __init__(self, config: ProxyConfig, token: str | None = None):
        self.config = config
        if token is None and config.upstream_token_env:
            token = os.environ.get(config.upstream_token_env)
            if not token:
                raise ValueError(f"--upstream-token-env {config.upstream_token_env}: that "
                                 "environment variable is not set or empty")
        self.api_key = config.api_key or os.environ.get("VLLM_API_KEY") or None
        self.tokenizer = None
        if config.tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self.router = PrefixRouter(config.upstreams, config.router_config())
        self.errors = dict.fromkeys(("bad_request", "not_found", "closed", "garbage", "timeout",
                                     "down", "no_replica", "refused",
                                     "unauthorized"), 0)
        self.replicas = ReplicaSet(config, self.router, token)
        self.completions = CompletionForwarder(config, self.replicas, self.router,
                                               self.tokenizer, self.error)
        self.broadcaster = Broadcaster(config, self.replicas, self.error)
        self.info = FleetInfo(config, self.replicas, self.error)
        self._tasks: list[asyncio.Task] = []
        self._started = time.monotonic()

    # ------------------------------------------------------------------ lifecycle

    async def start(self, app=None) -> None:
        await self.replicas.open()
        self._tasks.append(asyncio.create_task(self.replicas.probe_forever()))
        if self.config.stats_every_s > 0:
            self._tasks.append(asyncio.create_task(self._log_forever()))

    async def close(self, app=None) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.replicas.close()

    async def _log_forever(self) -> None:
        last = None
        while True:
            await asyncio.sleep(self.config.stats_every_s)
            line = self.router.summary()
            if line != last:
                print(f"grpo-lab proxy: {line}", file=sys.stderr, flush=True)
                last = line

    # ------------------------------------------------------------------ answers

    def error(self, status: int, message: str, kind: str, replica: str | None = None,
              param: str | None = None) -> web.Response:
        """An answer the proxy makes itself: vLLM's error body, counted under `kind`."""
        self.errors[kind] += 1
        body = error_body(message, status, param=param)
        headers = {"X-Proxy-Upstream": replica} if replica else None
        return web.json_response(body, status=status, headers=headers)

    def stats(self) -> dict:
        """The router's counters, then the parts' (the JSON of /proxy/stats)."""
        out = self.router.stats()
        counters = {**self.completions.counters, "errors": self.errors,
                    **self.broadcaster.counters, **self.replicas.counters,
                    **self.info.counters}
        out.update(json.loads(json.dumps(counters)))  # a copy
        out.update(upstreams=self.replicas.urls, down_reasons=dict(self.replicas.down_reasons),
                   paused=self.replicas.pause_state,
                   uptime_s=round(time.monotonic() - self._started, 1))
        return out

    @web.middleware
    async def auth(self, request: web.Request, handler) -> web.StreamResponse:
        """With an API key, every route but /health needs `Authorization: Bearer KEY`."""
        if self.api_key and request.path != "/health":
            if not bearer_ok(request.headers.get("Authorization"), self.api_key):
                self.errors["unauthorized"] += 1
                return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def stats_route(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def other_route(self, request: web.Request) -> web.Response:
        """A known path with another method: 405, as FastAPI. Anything else: to a replica."""
        if request.path in KNOWN_PATHS:
            return web.json_response({"detail": "Method Not Allowed"}, status=405)
        return await self.info.forward(request)


PROXY_KEY = web.AppKey("proxy", Proxy)


def make_app(config: ProxyConfig, token: str | None = None) -> web.Application:
    """The proxy as an aiohttp application (`app[PROXY_KEY]` is its `Proxy`); `token` overrides
    `config.upstream_token_env`."""
    proxy = Proxy(config, token)
    # without an API key, no middleware: one call less on every request's path
    app = web.Application(client_max_size=config.max_request_bytes,
                          middlewares=[proxy.auth] if proxy.api_key else [])
    app[PROXY_KEY] = proxy
    app.router.add_post("/v1/completions", proxy.completions.forward)
    app.router.add_post("/v1/chat/completions", proxy.completions.forward)
    app.router.add_post("/pause", proxy.broadcaster.to_every_replica)
    app.router.add_post("/resume", proxy.broadcaster.to_every_replica)
    app.router.add_post("/reset_prefix_cache", proxy.broadcaster.to_every_replica)
    app.router.add_post(LOAD_PATH, proxy.broadcaster.adapter_op)
    app.router.add_post(UNLOAD_PATH, proxy.broadcaster.adapter_op)
    app.router.add_get("/health", proxy.info.health)
    app.router.add_get("/ping", proxy.info.health)
    app.router.add_post("/ping", proxy.info.health)
    app.router.add_get("/get_world_size", proxy.info.world_size)
    app.router.add_get("/server_info", proxy.info.one_answer)
    app.router.add_get("/v1/models", proxy.info.one_answer)
    app.router.add_get("/proxy/stats", proxy.stats_route)
    app.router.add_route("*", "/{tail:.*}", proxy.other_route)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.close)
    return app


async def run_proxy(config: ProxyConfig) -> None:
    """Serve until SIGTERM or Ctrl-C; prints `GRPO_LAB_PROXY_READY <url>` once listening."""
    runner = web.AppRunner(make_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port, backlog=2048).start()
    port = runner.addresses[0][1]
    # The CLI imported torch and transformers: millions of long-lived objects that every full
    # garbage collection would walk (a 100+ ms pause). Move them out of the collector's sight.
    gc.collect()
    gc.freeze()
    loop = type(asyncio.get_running_loop()).__module__.split(".")[0]  # uvloop or asyncio
    print(f"{READY_MARKER} http://{config.host}:{port} upstreams={','.join(config.upstreams)} "
          f"event_loop={loop}", flush=True)
    await serve_until_signalled(runner)


def serve_proxy(config: ProxyConfig) -> None:
    run = asyncio.run
    if config.event_loop == "uvloop":
        try:
            import uvloop  # libuv's event loop, a drop-in for asyncio's
        except ImportError:
            print("uvloop is not installed: the proxy runs on asyncio's event loop", flush=True)
        else:
            run = uvloop.run
    run(run_proxy(config))
