"""The proxy's completion routes (grpo_lab.proxy.app): each prompt to one replica, answers merged.

`CompletionForwarder` parses a request, routes each prompt on its key (router.py), sends each
replica its share (a refused share is routed again), and merges the choices back in prompt
order. A one-prompt request is passed through unparsed, a streamed one
goes whole to its first prompt's replica (docs/internals.md, "proxy: inside `grpo-lab proxy`").
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
from aiohttp import web

from ..serve.protocol import RequestError, loads_json
from .config import ProxyConfig
from .replicas import ReplicaSet, UpstreamError, transport_error
from .router import NoReplicaAvailable, PrefixRouter, routing_keys


def _looks_like_json_object(data: bytes) -> bool:
    """A cheap check of a relayed body (parsing every completion would cost more than routing)."""
    return data[:1] == b"{" and data.rstrip()[-1:] == b"}"


class CompletionForwarder:
    """The completion routes: `forward` answers them. The replicas are called through
    `replicas`; the answers the proxy makes itself come from `error` (counted by the proxy)."""

    def __init__(self, config: ProxyConfig, replicas: ReplicaSet, router: PrefixRouter,
                 tokenizer: object | None, error: Callable[..., web.Response]):
        self.config = config
        self.replicas = replicas
        self.router = router
        self.tokenizer = tokenizer  # for text and chat prompts; None = UTF-8 pseudo-tokens
        self.error = error  # (status, message, kind, replica=None, param=None) -> response
        self.counters = {"completion_calls": 0, "split_batches": 0, "rerouted": 0}

    def _upstream_error(self, exc: UpstreamError, replica: str | None) -> web.Response:
        kind = {"connect": "no_replica"}.get(exc.kind, exc.kind)
        return self.error(exc.status, exc.message, kind, replica)

    def _no_replica(self) -> web.Response:
        return self.error(503, f"no replica is up ({self.replicas.down_reasons}); the proxy "
                          f"probes them every {self.config.health_interval_s:g} s", "no_replica")

    def _relay(self, status: int, data: bytes, ctype: str, replica: str) -> web.Response:
        if not _looks_like_json_object(data):
            return self.error(502, f"replica {replica} answered {status} with a body that is "
                              f"not a JSON object: {data[:100]!r}", "garbage", replica)
        return web.Response(body=data, status=status,
                            headers={"Content-Type": ctype, "X-Proxy-Upstream": replica})

    async def forward(self, request: web.Request) -> web.StreamResponse:
        self.counters["completion_calls"] += 1
        try:
            raw = await request.read()
            body = loads_json(raw)  # 400, also for JSON nested too deeply
            if not isinstance(body, dict):
                raise RequestError(f"The request body must be a JSON object, got "
                                   f"{type(body).__name__}.")
            model = body.get("model") or ""
            if not isinstance(model, str):
                raise RequestError("'model' must be a string.", param="model")
            prompts, keys = routing_keys(body, request.path == "/v1/chat/completions",
                                         self.tokenizer)
        except web.HTTPRequestEntityTooLarge:
            return self.error(413, f"The request body is larger than the proxy's limit of "
                              f"{self.config.max_request_bytes} bytes.", "bad_request")
        except RequestError as exc:
            return self.error(exc.status, exc.message, "bad_request", param=exc.param)
        if body.get("stream"):
            return await self._stream(request, raw, keys[0], model)
        if len(keys) == 1:  # the usual case: the body goes as it came, the answer comes back so
            return await self._one_prompt(request.path, raw, keys[0], model)
        return await self._dispatch(request.path, body, raw, prompts, keys, model)

    async def _one_prompt(self, path, raw, key, model) -> web.Response:
        """`_dispatch` for a request with one prompt: no split and no merge, the replica's answer
        is relayed as it came. A refused connection routes it again, to another replica if any
        is up."""
        refused: set[str] = set()  # replicas that refused this request's connection
        for _attempt in range(len(self.replicas.urls) + 1):
            try:
                replica = self.router.route(key, model, avoid=refused).replica
            except NoReplicaAvailable:
                return self._no_replica()
            try:
                status, reply, ctype = await self.replicas.call(replica, path, raw)
            except UpstreamError as exc:
                if exc.kind != "connect":
                    return self._upstream_error(exc, replica)
                self.replicas.refused(replica, exc.message)
                refused.add(replica)
                self.counters["rerouted"] += 1
                continue
            finally:
                self.router.finish(replica)
            return self._relay(status, reply, ctype, replica)
        return self._no_replica()

    async def _dispatch(self, path, body, raw, prompts, keys, model) -> web.Response:
        """Route every prompt, send each replica its share, merge. The share of a replica that
        refuses the connection is routed again, to the other replicas if any is up."""
        pending = list(range(len(keys)))
        results: dict[int, tuple] = {}  # prompt -> (replica, sub-answer, place in it, its size)
        refused: set[str] = set()  # replicas that refused this request's connection
        for _attempt in range(len(self.replicas.urls) + 1):
            groups: dict[str, list[int]] = {}
            try:
                for i in pending:
                    groups.setdefault(self.router.route(keys[i], model, avoid=refused).replica,
                                      []).append(i)
            except NoReplicaAvailable:
                for replica, idxs in groups.items():
                    for _ in idxs:
                        self.router.finish(replica)
                return self._no_replica()
            whole = len(groups) == 1 and len(pending) == len(keys)
            if len(groups) == 1:  # one replica takes them all: no gather, one task less
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
                    self.replicas.refused(replica, out.message)
                    refused.add(replica)
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
            status, reply, ctype = await self.replicas.call(replica, path, data)
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
            return self.error(502, f"replica {replica} answered {status} with a body that is "
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
        """A streamed request goes to one replica (routed on its first prompt); its bytes pass
        through."""
        try:
            replica = self.router.route(key, model).replica
        except NoReplicaAvailable:
            return self._no_replica()
        out = None
        try:
            async with self.replicas.stream(replica, request.path, raw) as reply:
                out = web.StreamResponse(status=reply.status, headers={
                    "Content-Type": reply.headers.get("Content-Type", "text/event-stream"),
                    "X-Proxy-Upstream": replica})
                await out.prepare(request)
                async for chunk in reply.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, OSError) as exc:
            err = transport_error(replica, exc, self.config.request_timeout_s)
            if err.kind == "connect":
                self.replicas.refused(replica, err.message)
            if out is None:
                return self._upstream_error(err, replica)
            return out  # already streaming: the client sees the stream end early
        finally:
            self.router.finish(replica)
