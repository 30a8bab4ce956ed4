"""`grpo-lab proxy`: several inference replicas behind one URL, routed by KV-prefix affinity.

    grpo-lab proxy --upstream http://10.0.0.2:8000 --upstream http://10.0.0.3:8000 \\
        --port 8000 --upstream-token-env HF_TOKEN

The trainer talks to the proxy as to one vLLM server (docs/serving-api.md, "The proxy in front
of several replicas"; docs/recipe.md, "The proxy"):

    POST /v1/completions, /v1/chat/completions  each prompt to one replica (grpo_lab.router);
                                                the answer names it in `X-Proxy-Upstream`
    POST /pause, /resume                        sent to every replica in routing
    POST /v1/load_lora_adapter                  every replica in routing or none (grpo_lab.broadcast)
    POST /v1/unload_lora_adapter                every replica
    GET  /health                                200 only if every replica answers 200
    GET  /server_info, /v1/models               from one healthy replica; data_parallel_size 1
    GET  /proxy/stats                           the counters below, as JSON

Routing. Each prompt is routed on its token ids; text and chat prompts on the ids of
`--tokenizer` or, without one, on UTF-8 pseudo-tokens (grpo_lab.prompt_keys). A batched request
is routed prompt by prompt: split across the replicas, and the choices merged back in prompt
order with `index` renumbered (the reference proxy routed a batch on its first prompt). A
streamed request goes whole to the replica of its first prompt.

Faults. Every upstream call has a timeout. What the proxy answers itself has vLLM's error body:
400 (bad JSON, a missing or malformed prompt), 404 (unknown route), 413 (body over
`max_request_bytes`), 502 (a replica dropped the connection or answered something that is not
a JSON object), 503 (no replica up, or the replica was declared down while the request was in
flight), 504 (no answer in time). Replicas' own answers (a 400, a 404 model) pass through. A probe
calls every replica's /health every `health_interval_s`: `health_failures` failures in a row,
or a refused connection, take a replica out of routing and fail its requests in flight (503);
it is probed until it answers, synced to a healthy peer's adapters (what it lacks is loaded,
what the fleet dropped meanwhile unloaded), and routed again. Broadcasts still go to every
replica, in routing or not: while one is unreachable, loads fail and are rolled back.

Completions travel over a lean keep-alive HTTP/1.1 pool (grpo_lab.http_pool), which halves the
proxy's CPU per request against aiohttp's client (benchmarks/proxy_overhead.py); everything
else uses aiohttp.

Logged metrics (`GET /proxy/stats`, next to the router's own, see grpo_lab.router):
- `completion_calls`: completion requests received; `split_batches`: batches spread over more
  than one replica; `rerouted`: prompts re-sent after a replica refused the connection.
- `errors`: answers the proxy made itself, by cause (bad_request, not_found, closed, garbage,
  timeout, down, no_replica).
- `broadcasts`: state-changing calls, by route; `retries`: "No adapter found" answers retried;
  `rollbacks`: loads undone on the replicas that had accepted them; `rollback_failures`;
  `load_timeouts`: loads that hit `lora_load_timeout_s` (answered 504).
- `marked_down`: times a replica left routing; `down_reasons`: why each one is down now;
  `resynced_adapters`: adapters loaded onto (or unloaded from) replicas that came back.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from .broadcast import (
    LOAD_PATH,
    UNLOAD_PATH,
    BroadcastResult,
    UpstreamError,
    broadcast,
    error_json,
    load_everywhere,
    unload_everywhere,
)
from .http_pool import ConnectFailed, ConnectionPool, InvalidResponse
from .prompt_keys import BadRequest, routing_keys
from .router import NoReplicaAvailable, PrefixRouter, RouterConfig
from .server_process import ServerProcess, serve_until_signalled

READY_MARKER = "GRPO_LAB_PROXY_READY"
_JSON_HEADERS = {"Content-Type": "application/json"}
_BROADCAST_PATHS = ("/pause", "/resume", LOAD_PATH, UNLOAD_PATH)
_KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/health", "/server_info",
                "/v1/models", "/proxy/stats", *_BROADCAST_PATHS)


@dataclass
class ProxyConfig:
    """Flags of `grpo-lab proxy` (the reference proxy's UPSTREAM_URLS and PROXY_* settings)."""

    upstreams: list[str] = field(default_factory=list)
    """Base URLs of the replicas, e.g. http://10.0.0.2:8000 (`--upstream URL`, once per replica)."""
    host: str = "127.0.0.1"
    """Interface to bind (127.0.0.1 = this machine only: the trainer runs next to the proxy)."""
    port: int = 8000
    """TCP port (0 = any free port; the chosen one is printed)."""
    upstream_token_env: str | None = None
    """Environment variable holding the token sent upstream as `Authorization: Bearer <token>`
    (e.g. HF_TOKEN: exposed HF Jobs ports need it). Incoming Authorization headers are dropped."""
    block_size: int = 16
    """Tokens per KV block, as the servers' (vLLM: 16)."""
    imbalance: int = 8
    """In-flight requests the preferred replica may be ahead of the least-loaded one."""
    max_tracked_blocks: int = 500_000
    """Cap on the router's block table (least recently used blocks are forgotten)."""
    tokenizer: str | None = None
    """Tokenizer (path or hub id) for routing text and chat prompts; default: UTF-8 pseudo-tokens."""
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
    health_timeout_s: float = 5.0
    """A health probe without an answer after this long counts as a failure."""
    health_failures: int = 2
    """Failed probes in a row that take a replica out of routing."""
    stats_every_s: float = 60.0
    """Print the routing counters every S seconds (0 = never)."""
    max_request_bytes: int = 16 * 2**20
    """Largest request body accepted (413 above)."""

    def __post_init__(self):
        self.upstreams = [u.rstrip("/") for u in self.upstreams]
        problems = []
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
        if not 0 <= self.port < 65536:
            problems.append(f"port must be in 0..65535 (got {self.port})")
        if problems:
            raise ValueError("invalid ProxyConfig: " + "; ".join(problems))


def _transport_error(replica: str, exc: BaseException, timeout_s: float) -> UpstreamError:
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


def _looks_like_json_object(data: bytes) -> bool:
    """A cheap check of a relayed body (parsing every completion would cost more than routing)."""
    return data[:1] == b"{" and data.rstrip()[-1:] == b"}"


class Proxy:
    """The proxy's state: the router, the sessions to the replicas, the probe, the counters."""

    def __init__(self, config: ProxyConfig, token: str | None = None):
        self.config = config
        self.replicas = list(config.upstreams)
        self.router = PrefixRouter(self.replicas, RouterConfig(
            config.block_size, config.imbalance, config.max_tracked_blocks))
        if token is None and config.upstream_token_env:
            token = os.environ.get(config.upstream_token_env)
            if not token:
                raise ValueError(f"--upstream-token-env {config.upstream_token_env}: that "
                                 "environment variable is not set or empty")
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self.tokenizer = None
        if config.tokenizer:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(config.tokenizer)
        self._pool: ConnectionPool | None = None  # completions
        self._session: aiohttp.ClientSession | None = None  # streamed completions
        self._control: aiohttp.ClientSession | None = None  # probes and broadcasts
        self._tasks: list[asyncio.Task] = []
        # tasks waiting on each replica, and those cancelled because their replica went down
        self._calls: dict[str, set[asyncio.Task]] = {r: set() for r in self.replicas}
        self._killed: dict[asyncio.Task, str] = {}
        self._failures = dict.fromkeys(self.replicas, 0)
        self.down_reasons: dict[str, str] = {}
        self._locks: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._started = time.monotonic()
        self.counters = {
            "completion_calls": 0, "split_batches": 0, "rerouted": 0,
            "errors": dict.fromkeys(("bad_request", "not_found", "closed", "garbage", "timeout",
                                     "down", "no_replica"), 0),
            "broadcasts": {p.rsplit("/", 1)[1]: 0 for p in _BROADCAST_PATHS},
            "retries": 0, "rollbacks": 0, "rollback_failures": 0, "load_timeouts": 0,
            "marked_down": 0, "resynced_adapters": 0,
        }

    # ------------------------------------------------------------------ lifecycle

    async def start(self, app=None) -> None:
        cfg = self.config
        # completions: the lean pool; streamed completions: aiohttp
        self._pool = ConnectionPool(cfg.conn_limit, self._auth, cfg.connect_timeout_s)
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
        self._tasks.append(asyncio.create_task(self._probe_forever()))
        if cfg.stats_every_s > 0:
            self._tasks.append(asyncio.create_task(self._log_forever()))

    async def close(self, app=None) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for session in (self._session, self._control):
            if session is not None:
                await session.close()
        if self._pool is not None:
            self._pool.close()

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
            return _transport_error(replica, exc, self.config.health_timeout_s).message

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

    async def _log_forever(self) -> None:
        last = None
        while True:
            await asyncio.sleep(self.config.stats_every_s)
            line = self.router.summary()
            if line != last:
                print(f"grpo-lab proxy: {line}", file=sys.stderr, flush=True)
                last = line

    # ------------------------------------------------------------------ upstream calls

    async def _send(self, replica: str, path: str, body: dict | None, timeout_s: float,
                    method: str = "POST") -> tuple[int, str]:
        """One control call (broadcasts, probes, one-answer routes): (status, text)."""
        try:
            async with self._control.request(method, replica + path, json=body,
                                             timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                return r.status, await r.text(errors="replace")
        except (aiohttp.ClientError, OSError) as exc:
            raise _transport_error(replica, exc, timeout_s) from None

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
            raise _transport_error(replica, exc, self.config.request_timeout_s) from None
        finally:
            calls.discard(task)
            self._killed.pop(task, None)

    # ------------------------------------------------------------------ answers

    def _error(self, status: int, message: str, kind: str, replica: str | None = None,
               param: str | None = None) -> web.Response:
        self.counters["errors"][kind] += 1
        body = error_json(message, status)
        body["error"]["param"] = param
        headers = {"X-Proxy-Upstream": replica} if replica else None
        return web.json_response(body, status=status, headers=headers)

    def _upstream_error(self, exc: UpstreamError, replica: str | None) -> web.Response:
        kind = {"connect": "no_replica"}.get(exc.kind, exc.kind)
        return self._error(exc.status, exc.message, kind, replica)

    def _no_replica(self) -> web.Response:
        return self._error(503, f"no replica is up ({self.down_reasons}); the proxy probes them "
                           f"every {self.config.health_interval_s:g} s", "no_replica")

    def _relay(self, status: int, data: bytes, ctype: str, replica: str) -> web.Response:
        if not _looks_like_json_object(data):
            return self._error(502, f"replica {replica} answered {status} with a body that is "
                               f"not a JSON object: {data[:100]!r}", "garbage", replica)
        return web.Response(body=data, status=status,
                            headers={"Content-Type": ctype, "X-Proxy-Upstream": replica})

    # ------------------------------------------------------------------ routes: completions

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.counters["completion_calls"] += 1
        try:
            raw = await request.read()
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise BadRequest(f"Invalid JSON body: {exc}") from None
            if not isinstance(body, dict):
                raise BadRequest(f"The request body must be a JSON object, got "
                                 f"{type(body).__name__}.")
            model = body.get("model") or ""
            if not isinstance(model, str):
                raise BadRequest("'model' must be a string.", "model")
            prompts, keys = routing_keys(body, request.path == "/v1/chat/completions",
                                         self.tokenizer)
        except web.HTTPRequestEntityTooLarge:
            return self._error(413, f"The request body is larger than the proxy's limit of "
                               f"{self.config.max_request_bytes} bytes.", "bad_request")
        except BadRequest as exc:
            return self._error(exc.status, exc.message, "bad_request", param=exc.param)
        if body.get("stream"):
            return await self._stream(request, raw, keys[0], model)
        return await self._dispatch(request.path, body, raw, prompts, keys, model)

    async def _dispatch(self, path, body, raw, prompts, keys, model) -> web.Response:
        """Route every prompt, send each replica its share, merge. A replica that refuses the
        connection is marked down and its share routed again."""
        pending = list(range(len(keys)))
        results: dict[int, tuple] = {}  # prompt -> (replica, sub-answer, place in it, its size)
        for _attempt in range(len(self.replicas)):
            groups: dict[str, list[int]] = {}
            try:
                for i in pending:
                    groups.setdefault(self.router.route(keys[i], model).replica, []).append(i)
            except NoReplicaAvailable:
                for replica, idxs in groups.items():
                    for _ in idxs:
                        self.router.finish(replica)
                return self._no_replica()
            whole = len(groups) == 1 and len(pending) == len(keys)
            if len(groups) == 1:  # the usual case (one prompt): no gather, one task less
                outcomes = [await self._send_share(path, body, raw if whole else None, prompts,
                                                   *next(iter(groups.items())))]
            else:
                outcomes = await asyncio.gather(*(
                    self._send_share(path, body, None, prompts, r, idxs)
                    for r, idxs in groups.items()))
            if whole and isinstance(outcomes[0], web.Response):
                return outcomes[0]  # one replica took it all: its answer as it came
            retry, failures = [], []
            for (replica, idxs), out in zip(groups.items(), outcomes):
                if isinstance(out, UpstreamError) and out.kind == "connect":
                    self._mark_down(replica, out.message)
                    retry += idxs
                elif isinstance(out, dict):
                    results.update((i, (replica, out, pos, len(idxs)))
                                   for pos, i in enumerate(idxs))
                else:
                    failures.append((idxs[0], replica, out))
            if failures:  # the failure of the earliest prompt is the answer (as one server)
                _, replica, out = min(failures, key=lambda f: f[0])
                return out if isinstance(out, web.Response) else self._upstream_error(out, replica)
            if not retry:
                break
            self.counters["rerouted"] += len(retry)
            pending = sorted(retry)
        else:
            return self._no_replica()
        return self._merge(prompts, results)

    async def _send_share(self, path, body, raw, prompts, replica, idxs):
        """One replica's share of the prompts -> its parsed answer (dict), a finished response
        (a relayed error, or the whole answer when `raw` is the original body), or an error."""
        data = raw if raw is not None else json.dumps(
            {**body, "prompt": [prompts[i] for i in idxs]}).encode()
        try:
            status, reply, ctype = await self._call(replica, path, data)
        except UpstreamError as exc:
            return exc
        finally:
            for _ in idxs:
                self.router.finish(replica)
        if raw is not None or not 200 <= status < 300:
            return self._relay(status, reply, ctype, replica)
        try:
            answer = json.loads(reply)
            choices = answer["choices"]
            if len(choices) % len(idxs):
                raise ValueError(f"{len(choices)} choices for {len(idxs)} prompts")
            choices.sort(key=lambda c: c["index"])
        except (ValueError, KeyError, TypeError) as exc:
            return self._error(502, f"replica {replica} answered {status} with a body that is "
                               f"not a JSON completion ({exc}): {reply[:100]!r}", "garbage",
                               replica)
        return answer

    def _merge(self, prompts, results) -> web.Response:
        """One answer from the sub-answers: choices in prompt order, `index` renumbered."""
        self.counters["split_batches"] += 1
        choices, usage, replicas, seen = [], {}, [], set()
        for i in range(len(prompts)):
            replica, answer, pos, share = results[i]
            if id(answer) not in seen:  # count each sub-answer's usage once
                seen.add(id(answer))
                replicas.append(replica)
                for key, value in (answer.get("usage") or {}).items():
                    if isinstance(value, int):
                        usage[key] = usage.get(key, 0) + value
            per = len(answer["choices"]) // share  # n choices per prompt, prompt-major
            for choice in answer["choices"][pos * per: (pos + 1) * per]:
                choices.append({**choice, "index": len(choices)})
        first = results[0][1]
        merged = {**first, "choices": choices, "usage": usage or first.get("usage")}
        return web.json_response(merged, headers={"X-Proxy-Upstream": ",".join(replicas)})

    async def _stream(self, request, raw, key, model) -> web.StreamResponse:
        """A streamed request goes to one replica (routed on its first prompt); bytes pass through."""
        try:
            replica = self.router.route(key, model).replica
        except NoReplicaAvailable:
            return self._no_replica()
        out = None
        try:
            async with self._session.post(replica + request.path, data=raw) as reply:
                out = web.StreamResponse(status=reply.status, headers={
                    "Content-Type": reply.headers.get("Content-Type", "text/event-stream"),
                    "X-Proxy-Upstream": replica})
                await out.prepare(request)
                async for chunk in reply.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, OSError) as exc:
            err = _transport_error(replica, exc, self.config.request_timeout_s)
            if err.kind == "connect":
                self._mark_down(replica, err.message)
            if out is None:
                return self._upstream_error(err, replica)
            return out  # already streaming: the client sees the stream end early
        finally:
            self.router.finish(replica)

    # ------------------------------------------------------------------ routes: the rest

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
                return BroadcastResult(503, error_json(
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
        return web.json_response(error_json(message, 503), status=503)

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
        if request.path in _KNOWN_PATHS:
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


PROXY_KEY = web.AppKey("proxy", Proxy)


def make_app(config: ProxyConfig, token: str | None = None) -> web.Application:
    """The proxy as an aiohttp application (`app[PROXY_KEY]` is its `Proxy`); `token` overrides
    `config.upstream_token_env`."""
    proxy = Proxy(config, token)
    app = web.Application(client_max_size=config.max_request_bytes)
    app[PROXY_KEY] = proxy
    app.router.add_post("/v1/completions", proxy.completions)
    app.router.add_post("/v1/chat/completions", proxy.completions)
    app.router.add_post("/pause", proxy.pause_resume)
    app.router.add_post("/resume", proxy.pause_resume)
    app.router.add_post(LOAD_PATH, proxy.adapter_op)
    app.router.add_post(UNLOAD_PATH, proxy.adapter_op)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/server_info", proxy.one_answer)
    app.router.add_get("/v1/models", proxy.one_answer)
    app.router.add_get("/proxy/stats", proxy.stats_route)
    app.router.add_route("*", "/{tail:.*}", proxy.not_found)
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
    print(f"{READY_MARKER} http://{config.host}:{port} upstreams={','.join(config.upstreams)}",
          flush=True)
    await serve_until_signalled(runner)


def serve_proxy(config: ProxyConfig) -> None:
    asyncio.run(run_proxy(config))


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
