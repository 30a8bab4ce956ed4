"""The fleet presented as one server (grpo_lab.proxy.app): `FleetInfo`.

/health (200 only if every replica is healthy), /server_info and /v1/models from one replica,
/get_world_size, read-only routes passed through to one replica, and every other route refused
with 400, since it may change one replica's state (docs/serving-api.md, "The proxy in front of
several replicas").
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
from collections.abc import Callable

from aiohttp import web

from ..serve.protocol import error_body
from .config import ProxyConfig
from .replicas import ReplicaSet, UpstreamError

WEIGHT_TRANSFER_PATHS = ("/init_weight_transfer_engine", "/start_weight_update",
                         "/update_weights", "/finish_weight_update")
ONE_REPLICA_STATE_PATHS = ("/sleep", "/wake_up", "/collective_rpc", "/scale_elastic_ep")
"""vLLM routes that change one server's state in ways the proxy does not broadcast: refused."""
READ_ONLY_POSTS = ("/tokenize", "/detokenize", "/v1/embeddings", "/pooling", "/classify",
                   "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank")
"""vLLM's POST routes that change nothing on the server: any one replica may answer them."""
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
              "trailers", "transfer-encoding", "upgrade", "host", "content-length"}
"""Headers that describe one connection, not the message: never passed through."""


class FleetInfo:
    """/health, /server_info, /v1/models, /get_world_size and every other route: the fleet
    answers as one server."""

    def __init__(self, config: ProxyConfig, replicas: ReplicaSet,
                 error: Callable[..., web.Response]):
        self.config = config
        self.replicas = replicas
        self.error = error  # (status, message, kind, replica=None, param=None) -> response
        self.counters = {"forwarded": 0}
        self._turn = itertools.count()

    async def health(self, request: web.Request) -> web.Response:
        urls = self.replicas.urls
        reasons = await asyncio.gather(*(self.replicas.probe(r) for r in urls))
        bad = {r: why for r, why in zip(urls, reasons) if why}
        if not bad:
            return web.Response(status=200)
        message = f"{len(bad)} of {len(urls)} replicas are not healthy: {bad}"
        return web.json_response(error_body(message, 503), status=503)

    async def _first_answer(self, path_qs: str) -> tuple[str, int, str] | str:
        """GET `path_qs` from the first replica that answers below 500 (up replicas first):
        (replica, status, text), or why none did."""
        order = sorted(self.replicas.urls, key=lambda r: r in self.replicas.down_reasons)
        why = "no replica"
        for replica in order:
            try:
                status, text = await self.replicas.send(replica, path_qs, None,
                                                        self.config.control_timeout_s, "GET")
            except UpstreamError as exc:
                why = exc.message
                continue
            if status >= 500:
                why = f"{replica} answered {status}"
                continue
            return replica, status, text
        return why

    async def one_answer(self, request: web.Request) -> web.Response:
        """/server_info and /v1/models: the first replica that answers (up replicas first)."""
        answer = await self._first_answer(request.path_qs)
        if isinstance(answer, str):
            return self.error(503, f"no replica answered {request.path}: {answer}", "no_replica")
        replica, status, text = answer
        if request.path == "/server_info" and status == 200:
            text = _one_replica_info(text)
        ctype = "application/json" if text.lstrip()[:1] in ("{", "[") else "text/plain"
        return web.Response(text=text, status=status, content_type=ctype,
                            headers={"X-Proxy-Upstream": replica})

    async def world_size(self, request: web.Request) -> web.Response:
        """/get_world_size: the processes of one replica (tensor x pipeline parallel), read from
        its /server_info; TRL's client reads `world_size` (the replicas are alike)."""
        answer = await self._first_answer("/server_info?config_format=json")
        try:
            replica, status, text = answer
            parallel = json.loads(text)["vllm_config"]["parallel_config"]
            size = (int(parallel.get("tensor_parallel_size", 1))
                    * int(parallel.get("pipeline_parallel_size", 1)))
        except (ValueError, KeyError, TypeError):
            why = answer if isinstance(answer, str) else f"{replica}/server_info: {status}"
            return self.error(503, f"no replica told its world size: {why}", "no_replica")
        return web.json_response({"world_size": size}, headers={"X-Proxy-Upstream": replica})

    async def forward(self, request: web.Request) -> web.Response:
        """Any read-only route the proxy does not handle: to one healthy replica, replicas in
        turn. Every other route is refused (400): it may change one replica's state."""
        refusal = _refusal(request.method, request.path)
        if refusal:
            return self.error(400, refusal, "refused")
        up = self.replicas.up()
        if not up:
            return self.error(503, f"no replica is up ({self.replicas.down_reasons})",
                              "no_replica")
        replica = up[next(self._turn) % len(up)]
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() not in HOP_BY_HOP | {"authorization"}}
        try:
            status, reply_headers, body = await self.replicas.relay(
                replica, request.method, request.path_qs, await request.read(), headers)
        except UpstreamError as exc:
            if exc.kind == "connect":
                self.replicas.refused(replica, exc.message)
            kind = {"timeout": "timeout", "connect": "down"}.get(exc.kind, "closed")
            return self.error(exc.status, exc.message, kind, replica)
        self.counters["forwarded"] += 1
        # aiohttp has decoded the body: its encoding and length headers no longer apply
        reply_headers = {k: v for k, v in reply_headers.items()
                         if k.lower() not in HOP_BY_HOP | {"content-encoding"}}
        return web.Response(body=body, status=status,
                            headers={**reply_headers, "X-Proxy-Upstream": replica})


def _refusal(method: str, path: str) -> str:
    """'' if a route may go to one replica, else why the proxy refuses it."""
    route = re.sub("/+", "/", path).rstrip("/") or "/"  # /sleep/ and //sleep are /sleep
    if route in WEIGHT_TRANSFER_PATHS:
        return (f"{path}: the proxy serves several replicas, and an NCCL weight transfer would "
                "reach one of them only. Sync LoRA adapters through /v1/load_lora_adapter "
                "instead.")
    if route in ONE_REPLICA_STATE_PATHS:
        return (f"{path}: the proxy serves several replicas and cannot apply this to all of "
                "them; call each replica directly.")
    if method in ("GET", "HEAD") or (method == "POST" and route in READ_ONLY_POSTS):
        return ""
    return (f"{method} {path}: the proxy passes only read-only routes to a replica (GET, or "
            f"POST to {', '.join(READ_ONLY_POSTS)}); this one may change a replica's state, "
            "which the rest of the fleet would not share.")


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
