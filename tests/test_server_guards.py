"""What only `grpo-lab serve` has, beyond the contract that tests/test_server_contract.py checks
on both engines: an allowed LoRA root, an emulated lagging mount, a body limit, vLLM's
environment gates, max_cpu_loras, its checks of hostile input (issue 23) and the end of a dead
engine (docs/serving-api.md: where the two engines differ).

The tests that ask a running server use the one that tests/server_contract_fixtures.py starts
for both files, and exist for `grpo-lab serve` alone (`serve_only`: nothing is generated for
vLLM only to be skipped). Variants that need other environment gates run grpo_lab's application
in process.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time

import pytest
from server_contract_helpers import KEY, LAG_S, error, serve_only, vllm_error

from grpo_lab.serve.client import BlockingClient, ServerError
from grpo_lab.serve.config import ServeConfig
from grpo_lab.serve.server import InferenceServer

pytest_plugins = ["server_contract_fixtures"]


# ------------------------------------------------------------------ adapters: root and mount lag


@serve_only
def test_load_route_refuses_paths_outside_the_allowed_root(client, lora_root):
    # Outside --allowed-lora-root: directly, through `..`, through a symlink: 400 at once.
    for path in (lora_root.parent / "elsewhere", lora_root / ".." / lora_root.name / ".." / "x",
                 lora_root / "link"):
        exc = error(client.load_lora_adapter, "x", str(path))
        assert exc.status == 400 and exc.error_type == "BadRequestError"
        assert "outside the allowed LoRA root" in exc.message
    exc = error(client.load_lora_adapter, "x", str(lora_root / "config-only"))
    assert exc.status == 400 and "safetensors" in exc.message


@serve_only
def test_lagging_mount_answers_no_adapter_found_then_loads(server, client, make_adapter,
                                                           lora_root):
    """A directory the emulated mount does not show yet (modified less than LAG_S ago) answers
    vLLM's "No adapter found"; `retry_not_found_s` retries that answer until the mount shows
    it. The test moves the directory's time itself, so no clock decides what it sees."""
    fresh = make_adapter(lora_root / "fresh", seed=5)
    ahead = time.time() + 3600  # modified "later than now": not visible, however slow the run
    os.utime(fresh, (ahead, ahead))
    statuses = []  # of every request the lagging client sends
    with BlockingClient(server.url, api_key=KEY, timeout_s=60) as lagging:
        send = lagging.client.request

        async def counted(method, path, **kwargs):
            try:
                reply = await send(method, path, **kwargs)
            except ServerError as exc:
                statuses.append(exc.status)
                raise
            statuses.append(reply[0])
            return reply

        lagging.client.request = counted
        exc = error(lagging.load_lora_adapter, "fresh", str(fresh))
        assert exc.status == 404 and exc.adapter_not_visible
        assert exc.message == f"Loading lora fresh failed: No adapter found for {fresh}"
        pending = lagging.submit(lagging.client.load_lora_adapter(
            "fresh", str(fresh), retry_not_found_s=300, retry_every_s=0.05))
        deadline = time.monotonic() + 120
        while len(statuses) < 3:  # the answer above, then the retried call's first two tries
            assert time.monotonic() < deadline and not pending.done(), (statuses, pending)
            time.sleep(0.01)
        assert not pending.done()  # "No adapter found" so far: still retrying
        old = time.time() - 10 * LAG_S
        os.utime(fresh, (old, old))  # the mount caught up
        assert pending.result(120) == "Success: LoRA adapter 'fresh' added successfully."
    assert len(statuses) >= 4 and statuses == [404] * (len(statuses) - 1) + [200]  # retried
    client.unload_lora_adapter("fresh")


# ------------------------------------------------------------------ body limit, streaming


@serve_only
def test_body_limit_and_no_streaming(client):
    """grpo-lab serve only: a body limit (vLLM has none) and no streaming (vLLM streams)."""
    big = json.dumps({"prompt": [1] * 60_000}).encode()  # ~180 kB > the 100 kB limit
    exc = error(client.request, "POST", "/v1/completions", data=big,
                headers={"Content-Type": "application/json"})
    assert exc.status == 413 and "limit of 100000 bytes" in exc.message
    assert exc.error_type == "BadRequestError"  # the proxy labels its 413 the same
    exc = error(client.request, "POST", "/v1/completions", json_body={"prompt": [1, 5],
                                                                       "stream": True})
    assert (exc.status, exc.param) == (400, "stream") and "stream" in exc.message


# ------------------------------------------------------------------ gates and engine death


def in_process(monkeypatch, tiny_model_and_tokenizer, env: dict, check, **config):
    """Run `check(test_client)` against the app in this process, with these env gates."""
    from aiohttp.test_utils import TestClient, TestServer

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    model, tokenizer = tiny_model_and_tokenizer
    server = InferenceServer(ServeConfig(**config), model=model, tokenizer=tokenizer)

    async def main():
        async with TestClient(TestServer(server.build_app(), host="127.0.0.1")) as test_client:
            await check(test_client, server)

    asyncio.run(main())


def test_gated_off_routes_answer_404_not_found(monkeypatch, tiny_model_and_tokenizer):
    async def check(http, server):
        for method, path in (("POST", "/pause"), ("POST", "/resume"), ("GET", "/server_info"),
                             ("GET", "/get_world_size"),
                             ("POST", "/reset_prefix_cache"), ("POST", "/v1/load_lora_adapter"),
                             ("POST", "/v1/unload_lora_adapter")):
            reply = await http.request(method, path, json={"lora_name": "a", "lora_path": "/a"})
            assert (reply.status, await reply.json()) == (404, {"detail": "Not Found"}), path
        assert (await http.get("/health")).status == 200
        reply = await http.post("/v1/completions", json={"prompt": [1, 5], "max_tokens": 2})
        assert reply.status == 200

    in_process(monkeypatch, tiny_model_and_tokenizer,
               {"VLLM_SERVER_DEV_MODE": "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}, check)


def test_lora_not_enabled_and_a_dead_engine(monkeypatch, tiny_model_and_tokenizer, lora_root):
    async def check(http, server):
        reply = await http.post("/v1/load_lora_adapter",
                                json={"lora_name": "a", "lora_path": str(lora_root / "a")})
        assert (reply.status, await reply.json()) == (500, vllm_error(
            "LoRA is not enabled. Use --enable-lora to enable LoRA.", "InternalServerError", 500))
        info = (await (await http.get("/server_info?config_format=json")).json())["vllm_config"]
        assert info["lora_config"] is None
        server.engine.error = RuntimeError("simulated crash")
        assert (await http.get("/health")).status == 503
        reply = await http.post("/v1/completions", json={"prompt": [1, 5]})
        assert reply.status == 500 and (await reply.json())["error"]["type"] == \
            "InternalServerError"

    in_process(monkeypatch, tiny_model_and_tokenizer,
               {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, check)


def test_serve_flags_are_checked(capsys):
    from grpo_lab.cli.flags import config_from_args
    from grpo_lab.cli.main import build_parser, main

    assert main(["serve", "tiny", "--max-lora-rank", "7"]) == 2
    assert "max_lora_rank must be one of" in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "m", "--enable-lora", "--max-loras", "6",
                                      "--logprobs-mode", "processed_logprobs"])
    config = config_from_args(args, ServeConfig)
    assert (config.model, config.enable_lora, config.max_loras, config.host) == (
        "m", True, 6, "127.0.0.1")


def test_max_cpu_loras_evicts_the_least_recently_used_and_reads_it_again(
        monkeypatch, tiny_model_and_tokenizer, make_adapter, tmp_path):
    """vLLM's two limits: with max_cpu_loras 2, a third load drops the weights of the adapter
    used longest ago; a request under it reads them again from its path (same logprobs), and
    fails with a clear error once that path is gone (a pruned bucket version)."""
    paths = {name: make_adapter(tmp_path / name, seed=i) for i, name in enumerate("abc", 1)}
    body = {"prompt": [1, 9, 7, 14], "max_tokens": 3, "seed": 5, "logprobs": 1}

    async def logprobs(http, model):
        reply = await http.post("/v1/completions", json={**body, "model": model})
        assert reply.status == 200, await reply.text()
        return (await reply.json())["choices"][0]["logprobs"]["token_logprobs"]

    async def check(http, server):
        info = (await (await http.get("/server_info?config_format=json")).json())["vllm_config"]
        assert info["lora_config"]["max_cpu_loras"] == 2
        for name in "ab":
            reply = await http.post("/v1/load_lora_adapter",
                                    json={"lora_name": name, "lora_path": str(paths[name])})
            assert reply.status == 200
        first = {name: await logprobs(http, name) for name in "ab"}  # "a" used before "b"
        await logprobs(http, "a")  # now "b" is the least recently used
        await http.post("/v1/load_lora_adapter", json={"lora_name": "c",
                                                       "lora_path": str(paths["c"])})
        assert server.lora.evictions == 1 and not server.lora.get("b").weights
        names = [m["id"] for m in (await (await http.get("/v1/models")).json())["data"]]
        assert names == ["tiny", "a", "b", "c"]  # evicted from memory, still loaded by name
        assert await logprobs(http, "b") == first["b"]  # read again from its path
        assert server.lora.reloads == 1 and server.lora.evictions == 2  # "a" or "c" went
        evicted = next(n for n in "ac" if not server.lora.get(n).weights)
        shutil.rmtree(paths[evicted])
        reply = await http.post("/v1/completions", json={**body, "model": evicted})
        error = (await reply.json())["error"]
        assert reply.status == 500 and "evicted from memory" in error["message"]
        assert "max_cpu_loras=2" in error["message"]

    in_process(monkeypatch, tiny_model_and_tokenizer,
               {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, check,
               model="tiny", enable_lora=True, max_lora_rank=8, max_loras=1, max_cpu_loras=2)


def test_max_cpu_loras_below_max_loras_is_refused():
    with pytest.raises(ValueError, match="max_cpu_loras"):
        ServeConfig(model="tiny", enable_lora=True, max_loras=3, max_cpu_loras=2)


# ------------------------------------------------------------------ hostile input (issue 23)


def raw_http(url: str, request: bytes) -> bytes:
    """Send raw bytes (headers an HTTP client would refuse to send) -> the raw answer."""
    import socket

    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@serve_only
def test_an_authorization_header_that_is_not_utf8_is_401(server):
    for value in (b"Bearer \xff\xfe", b"Bearer " + KEY.encode() + b"\xe9", b"\xc3\x28"):
        answer = raw_http(server.url, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: "
                          + value + b"\r\nConnection: close\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 401"), (value, answer[:200])
    assert raw_http(server.url, b"GET /health HTTP/1.1\r\nHost: x\r\nAuthorization: \xff\r\n"
                    b"Connection: close\r\n\r\n").startswith(b"HTTP/1.1 200")


HOSTILE_NUMBERS = [  # (raw body, param): NaN, infinities, float32 underflow and overflow
    (b'{"prompt": [1, 5], "temperature": NaN}', "temperature"),
    (b'{"prompt": [1, 5], "top_p": Infinity}', "top_p"),
    (b'{"prompt": [1, 5], "min_p": -Infinity}', "min_p"),
    (b'{"prompt": [1, 5], "repetition_penalty": 1e-46}', "repetition_penalty"),
    (b'{"prompt": [1, 5], "repetition_penalty": 1e-40}', "repetition_penalty"),
    (b'{"prompt": [1, 5], "repetition_penalty": 1e400}', "repetition_penalty"),
    (b'{"prompt": [1, 5], "temperature": 1e39}', "temperature"),
]


@serve_only
def test_numbers_must_be_finite_float32_and_deep_json_is_400(client):
    for raw, param in HOSTILE_NUMBERS:
        exc = error(client.request, "POST", "/v1/completions", data=raw)
        assert (exc.status, exc.error_type, exc.param) == (400, "BadRequestError", param), raw
    for raw in (b"[" * 30_000 + b"]" * 30_000, b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000
                + b"}"):
        exc = error(client.request, "POST", "/v1/completions", data=raw)
        assert (exc.status, exc.error_type) == (400, "BadRequestError"), exc.message
        assert "nested too deeply" in exc.message
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        exc = error(client.request, "POST", path, data=b"[" * 30_000 + b"]" * 30_000)
        assert exc.status == 400, path
    # sampling still works with tiny but normal values
    out = client.completions([1, 5], max_tokens=2, repetition_penalty=1e-30, temperature=0)
    assert len(out["choices"][0]["token_ids"]) >= 1
    assert client.health()


@serve_only
def test_stop_lists_are_bounded(client):
    from grpo_lab.serve.protocol import MAX_STOP_TOKEN_IDS

    exc = error(client.request, "POST", "/v1/completions", json_body={
        "prompt": [1, 5], "stop_token_ids": [3] * (MAX_STOP_TOKEN_IDS + 1)})
    assert (exc.status, exc.param) == (400, "stop_token_ids") and "limit" in exc.message
    exc = error(client.request, "POST", "/v1/completions", json_body={
        "prompt": [1, 5], "stop": ["x"] * 10_000})
    assert (exc.status, exc.param) == (400, "stop")
    out = client.completions([1, 5], max_tokens=2, stop_token_ids=[3] * MAX_STOP_TOKEN_IDS)
    assert out["choices"]


class SpyTokenizer:
    """The tiny tokenizer, recording the thread of every call that tokenizes."""

    def __init__(self, inner):
        self.inner, self.threads = inner, []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread())
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_sizes_are_checked_before_tokenizing_and_tokenizing_is_off_the_loop(
        monkeypatch, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    spy = SpyTokenizer(tokenizer)

    async def check(http, server):
        reply = await http.post("/v1/completions", json={"prompt": "7+8=" * 3_000_000})
        out = await reply.json()
        assert reply.status == 400 and out["error"]["param"] == "prompt", out
        # refused on its length in characters (12 MB), before any tokenizer call
        assert out["error"]["message"].startswith(
            "The prompt (12000000 characters) is longer than the maximum model length"), out
        assert spy.threads == []  # 12 MB never tokenized
        reply = await http.post("/v1/completions", json={"prompt": ["12+3=", "4+4="],
                                                          "max_tokens": 2})
        assert reply.status == 200 and len((await reply.json())["choices"]) == 2
        assert spy.threads and threading.main_thread() not in spy.threads  # a worker thread

    in_process(monkeypatch, (model, spy), {"VLLM_SERVER_DEV_MODE": "1"}, check, max_model_len=64)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_ends_the_server_process(tiny_model_and_tokenizer, model_copy):
    """The serving loop returns 1 (`serve` exits with it) once the engine thread died; the
    in-process test above (`engine.error` set by hand) checks the answers meanwhile."""
    from grpo_lab.serve.batch import RequestGroup, Sequence, make_generator
    from grpo_lab.serve.sampling import SamplingParams
    from grpo_lab.serve.server import serve_forever

    _, tokenizer = tiny_model_and_tokenizer

    def crash(module, args):
        raise RuntimeError("simulated: CUDA error: an illegal memory access")

    model_copy.register_forward_pre_hook(crash)
    server = InferenceServer(ServeConfig(port=0), model=model_copy, tokenizer=tokenizer)
    prompt = tokenizer("1+1=")["input_ids"]
    # queued before the engine starts: the engine thread dies at its first forward
    server.engine.submit(RequestGroup([Sequence(prompt, SamplingParams(max_tokens=2), None,
                                                make_generator(0))]))
    assert asyncio.run(asyncio.wait_for(serve_forever(server), 30)) == 1
    assert not server.engine.alive and "illegal memory access" in repr(server.engine.error)


def test_the_blocking_client_shows_its_calls_in_dir_and_help():
    """`BlockingClient` forwards the async client's calls: `dir()` and tab completion list them,
    and each carries the async call's name and docstring (no server is needed to see them)."""
    from grpo_lab.serve.client import InferenceClient

    with BlockingClient("http://127.0.0.1:9") as client:
        names = dir(client)
        for call in ("completions", "load_lora_adapter", "unload_lora_adapter", "models",
                     "health", "close"):
            assert call in names, call
        assert client.completions.__name__ == "completions"
        assert client.completions.__doc__ == InferenceClient.completions.__doc__
