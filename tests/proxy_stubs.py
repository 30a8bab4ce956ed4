"""Stub replicas for the proxy tests: small aiohttp apps that answer as vLLM does
(docs/serving-api.md), with a switch for every fault a real fleet shows.

A stub keeps the set of adapters it has loaded (`.adapters`), so a test can check that a name
is on every replica or on none. Completions answer at once with one choice per prompt and
sample whose text names the replica and the prompt: `"r1|[1, 2, 3]|0"`.

    async with fleet(2, lora_retry_s=0.01) as f:    # 2 stubs + an in-process proxy
        status, body, headers = await f.post("/v1/completions", {"prompt": [1, 2, 3]})
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from grpo_lab.proxy.app import PROXY_KEY, Proxy, make_app
from grpo_lab.proxy.config import ProxyConfig

BASE = "base"


def error(message: str, err_type: str, status: int) -> web.Response:
    return web.json_response({"error": {"message": message, "type": err_type, "param": None,
                                        "code": status}}, status=status)


async def hang() -> None:
    await asyncio.sleep(3600)  # until the client goes away (handler cancellation) or shutdown


def drop(request: web.Request) -> web.Response:
    """Close the connection without an answer."""
    request.transport.abort()
    return web.Response()  # written to a closed transport: nothing goes out


class StubReplica:
    """One fake vLLM server. Switches (set them at any time):

    health_status: /health status (200, 503); health_hang: /health never answers.
    completion_mode: ok | garbage (200 text/html) | close | hang | error500;
        completion_delay_s: seconds each completion takes; completion_gate: an asyncio.Event
        each completion waits for (a request held in flight until the test sets it).
    load_mode: ok | fail (500, rank too big) | close | hang | never ('No adapter found' forever)
        | load_then_close / load_then_hang (loads it, but the answer is lost) | gate_off (404).
    not_visible_for: answer 'No adapter found' to the first N load attempts of each name.
    unload_mode: ok | fail (500).
    """

    def __init__(self, name: str):
        self.name = name
        self.adapters: dict[str, str] = {}
        self.health_status, self.health_hang = 200, False
        self.completion_mode, self.completion_delay_s = "ok", 0.0
        self.completion_gate: asyncio.Event | None = None
        self.load_mode, self.not_visible_for, self.unload_mode = "ok", 0, "ok"
        self.load_attempts: Counter = Counter()
        self.seen: list[tuple[str, str, str | None]] = []  # (method, path_qs, Authorization)
        self.paused = False
        self.cache_resets = 0
        self.url: str | None = None
        self._runner: web.AppRunner | None = None

    # ---- routes

    async def health(self, request):
        if self.health_hang:
            await hang()
        return web.Response(status=self.health_status)

    async def completions(self, request):
        mode = self.completion_mode
        if mode == "close":
            return drop(request)
        if mode == "hang":
            await hang()
        if mode == "garbage":
            return web.Response(text="<html>upstream exploded</html>", content_type="text/html")
        if mode == "error500":
            return error("EngineCore died", "InternalServerError", 500)
        await asyncio.sleep(self.completion_delay_s)
        if self.completion_gate is not None:
            await self.completion_gate.wait()
        body = await request.json()
        if body.get("stream"):  # server-sent events, as vLLM streams them
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
            for piece in ("a", "b", "c"):
                await out.write(f'data: {{"replica": "{self.name}", "text": "{piece}"}}\n\n'
                                .encode())
            await out.write(b"data: [DONE]\n\n")
            return out
        model = body.get("model") or BASE
        if model != BASE and model not in self.adapters:
            return error(f"The model `{model}` does not exist.", "NotFoundError", 404)
        if request.path == "/v1/chat/completions":
            prompts = [body["messages"]]
        else:
            prompt = body["prompt"]
            single = isinstance(prompt, str) or (prompt and isinstance(prompt[0], int))
            prompts = [prompt] if single else prompt
        n = body.get("n", 1)
        choices = [{"index": i * n + j, "text": f"{self.name}|{json.dumps(p)}|{j}",
                    "logprobs": None, "finish_reason": "length", "stop_reason": None,
                    "token_ids": [7, 8], "prompt_token_ids": p if isinstance(p, list) else None}
                   for i, p in enumerate(prompts) for j in range(n)]
        prompt_tokens = sum(len(p) for p in prompts)
        return web.json_response({
            "id": f"cmpl-{self.name}", "object": "text_completion", "created": 1, "model": model,
            "choices": choices, "usage": {"prompt_tokens": prompt_tokens,
                                          "completion_tokens": 2 * len(choices),
                                          "total_tokens": prompt_tokens + 2 * len(choices)}})

    async def load(self, request):
        mode = self.load_mode
        if mode == "gate_off":
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.json()
        name, path = body.get("lora_name"), body.get("lora_path")
        if not name or not path:
            return error("Both 'lora_name' and 'lora_path' must be provided.",
                         "InvalidUserInput", 400)
        self.load_attempts[name] += 1
        if mode == "fail":
            return error("LoRA rank 16 is greater than max_lora_rank 8.",
                         "InternalServerError", 500)
        if mode == "close":
            return drop(request)
        if mode == "hang":
            await hang()
        if mode == "never" or self.load_attempts[name] <= self.not_visible_for:
            return error(f"Loading lora {name} failed: No adapter found for {path}",
                         "NotFoundError", 404)
        if name in self.adapters and body.get("load_inplace") is not True:
            return error(f"The lora adapter '{name}' has already been loaded. If you want to "
                         "load the adapter in place, set 'load_inplace' to True.",
                         "InvalidUserInput", 400)
        self.adapters[name] = path
        if mode == "load_then_close":
            return drop(request)
        if mode == "load_then_hang":
            await hang()
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request):
        name = (await request.json()).get("lora_name")
        if self.unload_mode == "fail":
            return error("unload exploded", "InternalServerError", 500)
        if name not in self.adapters:
            return error(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
        del self.adapters[name]
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def pause(self, request):
        self.paused = True
        return web.json_response({"status": "paused"})

    async def resume(self, request):
        self.paused = False
        return web.json_response({"status": "resumed"})

    async def reset_prefix_cache(self, request):
        self.cache_resets += 1
        return web.Response(status=200)  # vLLM answers 200 with an empty body

    async def server_info(self, request):
        return web.json_response({"vllm_config": {
            "parallel_config": {"data_parallel_size": 2, "tensor_parallel_size": 1},
            "lora_config": {"max_lora_rank": 8, "max_loras": 6},
            "model_config": {"dtype": "torch.float32"}, "replica": self.name}})

    async def other(self, request):
        """A route the proxy does not know (vLLM has many): echoes what arrived, with a status
        and a header of its own."""
        body = await request.read()
        return web.json_response(
            {"replica": self.name, "method": request.method, "path_qs": request.path_qs,
             "body": body.decode(), "x_client": request.headers.get("X-Client")},
            status=201, headers={"X-Replica-Says": f"hello from {self.name}"})

    async def models(self, request):
        cards = [{"id": BASE, "object": "model", "root": BASE, "parent": None,
                  "max_model_len": 256}]
        cards += [{"id": n, "object": "model", "root": p, "parent": BASE, "max_model_len": None}
                  for n, p in self.adapters.items()]
        return web.json_response({"object": "list", "data": cards})

    @web.middleware
    async def _record(self, request, handler):
        self.seen.append((request.method, request.path_qs, request.headers.get("Authorization")))
        return await handler(request)

    # ---- lifecycle

    async def start(self, port: int = 0) -> StubReplica:
        app = web.Application(middlewares=[self._record])
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        app.router.add_post("/pause", self.pause)
        app.router.add_post("/resume", self.resume)
        app.router.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/v1/models", self.models)
        app.router.add_route("*", "/v1/other", self.other)
        app.router.add_route("*", "/tokenize", self.other)  # a read-only POST route of vLLM's
        for path in ("/sleep", "/wake_up", "/collective_rpc", "/scale_elastic_ep",
                     "/update_weights", "/v1/state"):  # routes the proxy must never relay
            app.router.add_route("*", path, self.other)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1,
                                     access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def junk_server() -> asyncio.Server:
    """A TCP server that answers every connection with bytes that are not HTTP."""

    async def answer(reader, writer):
        await reader.read(1024)
        writer.write(b"NOT HTTP AT ALL\r\n\r\n")
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0)


@dataclass
class Fleet:
    url: str
    stubs: list[StubReplica]
    proxy: Proxy
    session: aiohttp.ClientSession

    async def request(self, method: str, path: str, body=None, *, data: bytes | None = None,
                      headers: dict | None = None):
        """-> (status, parsed JSON or text, headers)."""
        async with self.session.request(method, self.url + path, json=body, data=data,
                                        headers=headers) as reply:
            text = await reply.text()
            try:
                parsed = json.loads(text)
            except ValueError:
                parsed = text
            return reply.status, parsed, reply.headers

    async def post(self, path: str, body=None, **kw):
        return await self.request("POST", path, body, **kw)

    async def get(self, path: str, **kw):
        return await self.request("GET", path, **kw)

    def holders(self, name: str) -> int:
        return sum(name in s.adapters for s in self.stubs)


# Fast defaults for tests: quick probes and retries, short deadlines.
TEST_CONFIG = dict(port=0, lora_retry_s=0.01, lora_load_timeout_s=1.0, health_interval_s=0.05,
                   health_timeout_s=0.5, health_failures=1, request_timeout_s=10.0,
                   control_timeout_s=2.0, connect_timeout_s=1.0, stats_every_s=0)


@contextlib.asynccontextmanager
async def fleet(n: int = 2, *, token: str | None = None, upstreams: list[str] | None = None,
                **overrides):
    """`n` stub replicas (plus any extra `upstreams` URLs) behind an in-process proxy."""
    stubs: list[StubReplica] = []
    runner = session = None
    try:
        for i in range(n):
            stubs.append(await StubReplica(f"r{i}").start())
        config = ProxyConfig(upstreams=[s.url for s in stubs] + (upstreams or []),
                             **{**TEST_CONFIG, **overrides})
        app = make_app(config, token=token)
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.1,
                               access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        yield Fleet(f"http://127.0.0.1:{runner.addresses[0][1]}", stubs, app[PROXY_KEY], session)
    finally:
        if session is not None:
            await session.close()
        if runner is not None:
            await runner.cleanup()
        for stub in stubs:
            await stub.stop()


def run(coro, timeout_s: float = 60.0):
    """Run one async test body with a hard time limit."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


async def wait_until(condition, timeout_s: float = 30.0, what: str = "condition") -> None:
    """Poll `condition()` until it holds: a wait on a state, not on a guess of how long it takes
    (a bound far above any machine's time, below `run`'s; reaching it fails the test)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s:g} s")
        await asyncio.sleep(0.01)
