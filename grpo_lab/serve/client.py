"""An async HTTP client for the inference-server contract (docs/serving-api.md).

The same calls work against grpo_lab's server, the proxy and a real `vllm serve`:

    async with InferenceClient("http://127.0.0.1:8000") as client:
        await client.load_lora_adapter("policy-v1", "/lora/policy-v1")
        out = await client.completions([1, 5, 6], model="policy-v1", max_tokens=8, seed=7)

A non-2xx answer raises `ServerError` (`adapter_not_visible`: the one load error worth retrying).
`BlockingClient` runs the same calls from synchronous code.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import threading
import time
from collections.abc import Mapping
from typing import Any

import aiohttp

from .protocol import RequestError, parse_error


class ServerError(RequestError):
    """A non-2xx answer, parsed by protocol's `parse_error`: `.status`, `.message`,
    `.error_type` and `.param` (None when the body is not vLLM's), `.body` (the raw text)."""

    def __init__(self, method: str, path: str, status: int, body: str):
        message, error_type, param = parse_error(body)
        super().__init__(message, status, param=param)
        self.method, self.path, self.body, self.error_type = method, path, body, error_type

    def __str__(self) -> str:
        return (f"{self.method} {self.path} -> {self.status} {self.error_type or ''}: "
                f"{self.message}")

    @property
    def adapter_not_visible(self) -> bool:
        """The load route's 'No adapter found' 404: retry, the mount may catch up."""
        return self.status == 404 and "No adapter found" in self.message


class InferenceClient:
    """Async client of one server (or one proxy). Use as `async with`, or call `close()`."""

    def __init__(self, base_url: str, *, api_key: str | None = None, timeout_s: float = 600.0,
                 max_connections: int = 1024):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(
                headers=headers, timeout=self.timeout,
                connector=aiohttp.TCPConnector(limit=self.max_connections))
        return self._session

    async def request(self, method: str, path: str, *, json_body: Any = None,
                      params: dict | None = None, data: bytes | None = None,
                      headers: dict | None = None) -> tuple[int, str]:
        """One request; returns (status, body text) for 2xx, raises `ServerError` otherwise.
        `data` sends raw bytes instead of `json_body` (e.g. to test a server's error handling)."""
        status, text, _ = await self.request_with_headers(
            method, path, json_body=json_body, params=params, data=data, headers=headers)
        return status, text

    async def request_with_headers(self, method: str, path: str, *, json_body: Any = None,
                                   params: dict | None = None, data: bytes | None = None,
                                   headers: dict | None = None,
                                   ) -> tuple[int, str, Mapping[str, str]]:
        """`request`, plus the reply's headers, case-insensitive (e.g. the proxy's
        `X-Proxy-Upstream`: which replica served it)."""
        async with self._get_session().request(method, self.base_url + path, json=json_body,
                                               params=params, data=data,
                                               headers=headers) as reply:
            text = await reply.text()
            if not 200 <= reply.status < 300:
                raise ServerError(method, path, reply.status, text)
            return reply.status, text, reply.headers.copy()  # aiohttp's case-insensitive dict

    async def _json(self, method: str, path: str, **kwargs) -> Any:
        return json.loads((await self.request(method, path, **kwargs))[1])

    # ------------------------------------------------------------------ the endpoints

    async def health(self) -> bool:
        """True on 200; False on 503 or when nothing answers."""
        try:
            await self.request("GET", "/health")
            return True
        except ServerError:
            return False
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def models(self) -> list[dict]:
        """The model cards: the base model first, then one per loaded adapter."""
        return (await self._json("GET", "/v1/models"))["data"]

    async def server_info(self) -> dict:
        """The server's `vllm_config` (needs VLLM_SERVER_DEV_MODE=1 on the server)."""
        return (await self._json("GET", "/server_info",
                                 params={"config_format": "json"}))["vllm_config"]

    async def pause(self, mode: str = "keep") -> dict:
        return await self._json("POST", "/pause", params={"mode": mode})

    async def resume(self) -> dict:
        return await self._json("POST", "/resume")

    async def load_lora_adapter(self, name: str, path: str, *, load_inplace: bool = False,
                                retry_not_found_s: float = 0.0, retry_every_s: float = 0.5) -> str:
        """Load an adapter; with `retry_not_found_s` > 0, retry 'No adapter found' until then."""
        deadline = time.monotonic() + retry_not_found_s
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": load_inplace}
        while True:
            try:
                return (await self.request("POST", "/v1/load_lora_adapter", json_body=body))[1]
            except ServerError as exc:
                if not exc.adapter_not_visible or time.monotonic() + retry_every_s > deadline:
                    raise
            await asyncio.sleep(retry_every_s)

    async def unload_lora_adapter(self, name: str) -> str:
        return (await self.request("POST", "/v1/unload_lora_adapter",
                                   json_body={"lora_name": name}))[1]

    async def completions(self, prompt, *, model: str | None = None, max_tokens: int = 16,
                          temperature: float = 1.0, n: int = 1, seed: int | None = None,
                          logprobs: int | None = 0, return_token_ids: bool = True,
                          **fields) -> dict:
        """POST /v1/completions; `prompt` is token ids, a string, or a list of either.
        Extra `fields` (top_p, top_k, min_p, repetition_penalty, ...) are sent as given."""
        body = {"prompt": prompt, "max_tokens": max_tokens,
                "temperature": temperature, "n": n, "logprobs": logprobs,
                "return_token_ids": return_token_ids, **fields}
        if model is not None:  # omitted or empty = the base model
            body["model"] = model
        if seed is not None:
            body["seed"] = seed
        return await self._json("POST", "/v1/completions", json_body=body)


class BlockingClient:
    """The `InferenceClient` calls, synchronous: `BlockingClient(url).completions(...)`.

    Runs an event loop in a daemon thread; safe to call from several threads at once (each call
    is a coroutine on that loop). `close()` stops the loop.
    """

    def __init__(self, base_url: str, **kwargs):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="grpo-lab-client")
        self._thread.start()
        self.client = InferenceClient(base_url, **kwargs)

    def call(self, coroutine, timeout: float | None = None):
        """Run a coroutine on the client's loop and wait for its result."""
        return self.submit(coroutine).result(timeout)

    def submit(self, coroutine) -> concurrent.futures.Future:
        """Start a coroutine on the client's loop; returns at once with a future."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)

    def __getattr__(self, name):
        method = getattr(self.client, name)
        if not asyncio.iscoroutinefunction(method):
            return method
        return functools.wraps(method)(lambda *args, **kwargs: self.call(method(*args, **kwargs)))

    def __dir__(self) -> list[str]:
        """Its own names and the client's public calls (`completions`, `load_lora_adapter`,
        ...): what tab completion and `dir()` show."""
        public = (n for n in dir(self.client) if not n.startswith("_"))
        return sorted({*super().__dir__(), *public})

    def close(self) -> None:
        if self._loop.is_running():
            self.call(self.client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
