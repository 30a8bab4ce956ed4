"""docs/serving-api.md, checked against two engines running as real processes: `grpo-lab serve`
and real vLLM (its CPU build, where installed: `make vllm`). Same requests, same assertions;
where vLLM answers differently the difference is written in docs/serving-api.md ("Where the two
engines differ") and the test names it through `differs(...)`.

One server per engine serves the whole module: LoRA on, rank <= 8, 4 adapters per batch,
processed logprobs, an API key and max_model_len 32 (so that the length rule is easy to hit).
`grpo-lab serve` also gets what only it has: an allowed LoRA root, a 2 s emulated mount lag and a
100 kB body limit (tests that use them take the `stand_in` fixture). Variants that need other
environment gates run grpo_lab's application in process.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import time

import pytest
import torch

from grpo_lab.core.grpo_loss import policy_logprobs
from grpo_lab.serving.client import BlockingClient, ServerError
from grpo_lab.serving.config import ServeConfig
from grpo_lab.serving.process import start_server_process
from grpo_lab.serving.server import InferenceServer
from grpo_lab.serving.vllm_process import start_vllm_process, vllm_missing_reason
from grpo_lab.train.trainer import pad_left, pad_right

KEY = "test-key"
LAG_S = 2.0
MAX_LEN = 32


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory, make_adapter):
    """Adapters inside the allowed root (made to look old, past the mount lag), and one outside."""
    root = tmp_path_factory.mktemp("lora")
    make_adapter(root / "a", seed=1)
    make_adapter(root / "b", seed=2)
    make_adapter(root / "rank16", rank=16, seed=3)
    (root / "config-only").mkdir()
    shutil.copy(root / "a" / "adapter_config.json", root / "config-only")
    (root / "empty").mkdir()
    outside = make_adapter(tmp_path_factory.mktemp("outside") / "x", seed=4)
    (root / "link").symlink_to(outside, target_is_directory=True)
    old = time.time() - 600
    for path in [*root.iterdir(), outside]:
        os.utime(path, (old, old), follow_symlinks=False)
    return root


ENGINES = ["grpo-lab", pytest.param("vllm", marks=pytest.mark.skipif(
    vllm_missing_reason() is not None, reason=vllm_missing_reason() or ""))]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(engine, lora_root):
    common = dict(enable_lora=True, max_lora_rank=8, max_loras=4, max_model_len=MAX_LEN,
                  logprobs_mode="processed_logprobs", api_key=KEY)
    if engine == "vllm":
        process = start_vllm_process("tiny", max_cpu_loras=4, **common)
    else:
        process = start_server_process(
            "tiny", allowed_lora_root=str(lora_root), adapter_visibility_lag_s=LAG_S,
            max_request_bytes=100_000, **common)
    with process:
        yield process
    assert not process.running()


@pytest.fixture
def stand_in(engine):
    """For what only `grpo-lab serve` has (an allowed LoRA root, an emulated mount lag, a body
    limit, its own counters): real vLLM skips with the reason."""
    if engine == "vllm":
        pytest.skip("grpo-lab serve only (docs/serving-api.md: where the two engines differ)")


def differs(engine: str, grpo_lab, vllm):
    """What each engine answers where docs/serving-api.md says they differ."""
    return vllm if engine == "vllm" else grpo_lab


@pytest.fixture(scope="module")
def client(server):
    with BlockingClient(server.url, api_key=KEY, timeout_s=60) as blocking:
        yield blocking


def error(call, *args, **kwargs) -> ServerError:
    with pytest.raises(ServerError) as info:
        call(*args, **kwargs)
    return info.value


def body_of(exc: ServerError) -> dict:
    return json.loads(exc.body)


def vllm_error(message: str, err_type: str, code: int, param=None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def prompt_ids(tokenizer, texts):
    return [tokenizer(t)["input_ids"] for t in texts]


# ------------------------------------------------------------------ health, models, server_info


def test_health_models_and_server_info(client):
    assert client.request("GET", "/health") == (200, "")
    status, text = client.request("GET", "/v1/models")
    models = json.loads(text)
    assert status == 200 and models["object"] == "list"
    base = models["data"][0]
    assert (base["id"], base["object"], base["parent"], base["max_model_len"]) == (
        "tiny", "model", None, MAX_LEN)
    info = client.server_info()
    assert info["lora_config"]["max_lora_rank"] == 8 and info["lora_config"]["max_loras"] == 4
    assert info["parallel_config"]["data_parallel_size"] == 1
    assert info["model_config"]["dtype"] == "torch.float32"
    text_form = json.loads(client.request("GET", "/server_info")[1])  # config_format=text
    assert isinstance(text_form["vllm_config"], str)
    status, text = client.request("GET", "/get_world_size")  # TRL reads it
    assert (status, json.loads(text)) == (200, {"world_size": 1})


def test_api_key_is_required_everywhere_but_health(server, engine):
    guarded = [("GET", "/v1/models"), ("POST", "/v1/completions")]
    # vLLM's --api-key guards the /v1 routes only: /pause, /resume, /server_info, /metrics and the
    # adapter-free dev routes stay open (docs/serving-api.md); grpo-lab serve guards all but
    # /health.
    guarded += differs(engine, [("POST", "/pause"), ("GET", "/server_info")], [])
    for key in (None, "wrong"):
        with BlockingClient(server.url, api_key=key) as other:
            for method, path in guarded:
                exc = error(other.request, method, path)
                assert exc.status == 401 and body_of(exc) == {"error": "Unauthorized"}
            assert other.health()
            if engine == "vllm":  # the open routes answer without a key (read-only ones only here)
                assert other.request("GET", "/server_info?config_format=json")[0] == 200


def test_unknown_route_and_method_answer_like_fastapi(client):
    exc = error(client.request, "GET", "/v1/nothing")
    assert exc.status == 404 and body_of(exc) == {"detail": "Not Found"}
    exc = error(client.request, "GET", "/v1/completions")
    assert exc.status == 405 and body_of(exc) == {"detail": "Method Not Allowed"}


# ------------------------------------------------------------------ adapters: load and unload


def test_load_route_errors(client, lora_root, engine):
    def not_found(path):  # vLLM 0.27.1 does not echo the path (docs/serving-api.md)
        return f"Loading lora x failed: No adapter found for {differs(engine, path, '<path>')}"

    cases = [
        (("", str(lora_root / "a")), 400, "InvalidUserInput",
         "Both 'lora_name' and 'lora_path' must be provided."),
        (("x", ""), 400, "InvalidUserInput",
         "Both 'lora_name' and 'lora_path' must be provided."),
        (("x", str(lora_root / "missing")), 404, "NotFoundError",
         not_found(lora_root / "missing")),
        (("x", str(lora_root / "empty")), 404, "NotFoundError", not_found(lora_root / "empty")),
        (("x", str(lora_root / "rank16")), 500, "InternalServerError",
         "LoRA rank 16 is greater than max_lora_rank 8."),
    ]
    for (name, path), status, err_type, message in cases:
        exc = error(client.load_lora_adapter, name, path)
        if engine == "vllm" and status == 500:  # vLLM wraps its worker's message
            assert (exc.status, exc.error_type) == (status, err_type) and message in exc.message
            continue
        assert (exc.status, body_of(exc)) == (status, vllm_error(message, err_type, status)), path
    exc = error(client.request, "POST", "/v1/load_lora_adapter", data=b"{not json")
    assert exc.status == 400 and exc.error_type in ("BadRequestError", "Bad Request")
    exc = error(client.request, "POST", "/v1/load_lora_adapter",
                json_body={"lora_name": 3, "lora_path": "/x"})
    assert exc.status == 400 and exc.param in ("lora_name", "body.lora_name")
    assert [m["id"] for m in client.models()] == ["tiny"]  # nothing half-loaded


def test_load_route_refuses_paths_outside_the_allowed_root(client, lora_root, stand_in):
    # Outside --allowed-lora-root: directly, through `..`, through a symlink: 400 at once.
    for path in (lora_root.parent / "elsewhere", lora_root / ".." / lora_root.name / ".." / "x",
                 lora_root / "link"):
        exc = error(client.load_lora_adapter, "x", str(path))
        assert exc.status == 400 and exc.error_type == "BadRequestError"
        assert "outside the allowed LoRA root" in exc.message
    exc = error(client.load_lora_adapter, "x", str(lora_root / "config-only"))
    assert exc.status == 400 and "safetensors" in exc.message


def test_load_list_reload_inplace_and_unload(client, lora_root):
    path = str(lora_root / "a")
    assert client.load_lora_adapter("policy-v1", path) == \
        "Success: LoRA adapter 'policy-v1' added successfully."
    card = client.models()[1]
    assert (card["id"], card["parent"], card["root"], card["max_model_len"]) == (
        "policy-v1", "tiny", path, None)
    exc = error(client.load_lora_adapter, "policy-v1", path)
    assert (exc.status, exc.error_type) == (400, "InvalidUserInput")
    assert exc.message.startswith("The lora adapter 'policy-v1' has already been loaded.")
    assert client.load_lora_adapter("policy-v1", str(lora_root / "b"), load_inplace=True)
    assert client.unload_lora_adapter("policy-v1") == \
        "Success: LoRA adapter 'policy-v1' removed successfully."
    exc = error(client.unload_lora_adapter, "policy-v1")
    assert (exc.status, body_of(exc)) == (404, vllm_error(
        "The lora adapter 'policy-v1' cannot be found.", "NotFoundError", 404))
    exc = error(client.unload_lora_adapter, "")
    assert (exc.status, exc.error_type) == (400, "InvalidUserInput")
    assert [m["id"] for m in client.models()] == ["tiny"]


def test_lagging_mount_answers_no_adapter_found_then_loads(client, make_adapter, lora_root,
                                                           stand_in):
    fresh = make_adapter(lora_root / "fresh", seed=5)  # modified just now
    exc = error(client.load_lora_adapter, "fresh", str(fresh))
    assert exc.status == 404 and exc.adapter_not_visible
    assert exc.message == f"Loading lora fresh failed: No adapter found for {fresh}"
    start = time.monotonic()
    client.load_lora_adapter("fresh", str(fresh), retry_not_found_s=30, retry_every_s=0.25)
    assert time.monotonic() - start > 0.2  # it took retries
    client.unload_lora_adapter("fresh")


# ------------------------------------------------------------------ completions


def test_completion_response_shape(client, tiny_model_and_tokenizer):
    tokenizer = tiny_model_and_tokenizer[1]
    ids = prompt_ids(tokenizer, ["12+34="])[0]
    out = client.completions(ids, model="tiny", max_tokens=8, n=2, seed=11, temperature=0.7)
    assert out["id"].startswith("cmpl-") and out["object"] == "text_completion"
    assert out["model"] == "tiny" and isinstance(out["created"], int)
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for choice in out["choices"]:
        lp = choice["logprobs"]
        assert set(choice) >= {"text", "logprobs", "finish_reason", "stop_reason", "token_ids",
                               "prompt_token_ids"}
        assert choice["prompt_token_ids"] == ids
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(choice["token_ids"])
        assert len(lp["top_logprobs"]) == len(lp["text_offset"]) == len(choice["token_ids"])
        assert all(-9999 <= x <= 0 for x in lp["token_logprobs"])
        if choice["finish_reason"] == "stop":  # EOS is the last token id, not in the text
            assert choice["token_ids"][-1] == tokenizer.eos_token_id
            assert choice["stop_reason"] is None
        assert choice["text"] == tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
    completion_tokens = sum(len(c["token_ids"]) for c in out["choices"])
    usage = {k: out["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage == {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                     "total_tokens": len(ids) + completion_tokens}
    plain = client.completions(ids, max_tokens=1, logprobs=None, return_token_ids=False,
                               temperature=0)
    choice = plain["choices"][0]
    assert plain["model"] == "tiny" and choice["logprobs"] is None
    assert choice["token_ids"] is None and choice["finish_reason"] == "length"


def test_prompt_forms(client, tiny_model_and_tokenizer):
    tokenizer = tiny_model_and_tokenizer[1]
    ids = prompt_ids(tokenizer, ["3+4=", "10+20="])
    by_text = client.completions("3+4=", max_tokens=2, temperature=0)
    assert by_text["choices"][0]["prompt_token_ids"] == ids[0]  # tokenized with <bos>
    two_texts = client.completions(["3+4=", "10+20="], max_tokens=2, n=2, seed=7)
    two_lists = client.completions(ids, max_tokens=2, n=2, seed=7)
    for out in (two_texts, two_lists):
        assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
        assert [c["prompt_token_ids"] for c in out["choices"]] == [ids[0]] * 2 + [ids[1]] * 2
        assert out["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    assert [c["token_ids"] for c in two_texts["choices"]] == \
        [c["token_ids"] for c in two_lists["choices"]]


def test_seeded_requests_are_reproducible(client, tiny_model_and_tokenizer):
    ids = prompt_ids(tiny_model_and_tokenizer[1], ["45+45="])[0]
    kwargs = dict(max_tokens=10, temperature=1.0, ignore_eos=True)
    first = client.completions(ids, n=3, seed=123, **kwargs)
    second = client.completions(ids, n=3, seed=123, **kwargs)
    assert first["choices"] == second["choices"]
    tokens = [c["token_ids"] for c in first["choices"]]
    assert len({tuple(t) for t in tokens}) > 1  # children differ...
    child2 = client.completions(ids, n=1, seed=125, **kwargs)  # ...child i uses seed + i
    assert child2["choices"][0]["token_ids"] == tokens[2]


BAD_REQUESTS = [  # (body, status, grpo-lab's type, its message, its param, vLLM's message)
    ({"prompt": [1, 5], "n": "two"}, 400, "BadRequestError", "'n' must be an integer", "n",
     "Input should be a valid integer"),
    ({"prompt": [1, 5], "n": 0}, 400, "BadRequestError", "n must be at least 1", "n",
     "n must be at least 1"),
    ({"prompt": [1, 5], "n": 10**9}, 400, "BadRequestError", "the limit is 4096", "n",
     "n must be at most 16384"),
    ({"prompt": [1, 5], "n": 2, "temperature": 0}, 400, "BadRequestError",
     "n must be 1 when using greedy sampling", "n", "n must be 1 when using greedy sampling"),
    ({"prompt": [1, 5], "temperature": -1}, 400, "BadRequestError", "temperature",
     "temperature", "temperature must be non-negative"),
    ({"prompt": [1, 5], "top_p": 0}, 400, "BadRequestError", "top_p", "top_p",
     "top_p must be in (0, 1]"),
    ({"prompt": [1, 5], "top_k": -2}, 400, "BadRequestError", "top_k", "top_k",
     "top_k must be 0 (disable), or at least 1"),
    ({"prompt": [1, 5], "min_p": 2}, 400, "BadRequestError", "min_p", "min_p",
     "min_p must be in [0, 1]"),
    ({"prompt": [1, 5], "logprobs": 21}, 400, "BadRequestError",
     "Requested sample logprobs of 21, which is greater than max allowed: 20", "logprobs",
     "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    ({"prompt": [1, 5], "max_tokens": 0}, 400, "BadRequestError", "max_tokens", "max_tokens",
     "max_tokens must be at least 1"),
    ({"prompt": [1, 5], "seed": "x"}, 400, "BadRequestError", "'seed' must be an integer", "seed",
     "Input should be a valid integer"),
    ({"prompt": []}, 400, "BadRequestError", "Prompt cannot be empty", "prompt",
     "You must pass at least one prompt"),
    ({"prompt": [1, "a"]}, 400, "BadRequestError", "'prompt' must be", "prompt",
     "Input should be a valid integer"),
    ({"prompt": 5}, 400, "BadRequestError", "'prompt' must be", "prompt",
     "Input should be a valid list"),
    ({"max_tokens": 3}, 400, "BadRequestError", "Field required: 'prompt'", "prompt",
     "Either prompt or prompt_embeds must be provided"),
    ({"prompt": [1, 999]}, 400, "BadRequestError", "Token id 999 is out of vocabulary",
     "prompt", "Token id 999 is out of vocabulary"),
    ({"prompt": [1] * 7, "max_tokens": MAX_LEN - 6}, 400, "BadRequestError",
     f"This model's maximum context length is {MAX_LEN} tokens. However, you requested "
     f"{MAX_LEN + 1} tokens (7 in the prompt, {MAX_LEN - 6} in the completion).", "max_tokens",
     f"This model's maximum context length is {MAX_LEN} tokens"),
    ({"prompt": [1] * (MAX_LEN + 1)}, 400, "BadRequestError", "longer than the maximum model "
     "length", "prompt", f"your prompt contains {MAX_LEN + 1} input tokens"),
    ({"prompt": [1, 5], "model": "nope"}, 404, "NotFoundError", "The model `nope` does not exist.",
     "model", "The model `nope` does not exist."),
]


def test_bad_completion_requests_get_clear_errors_and_the_server_stays_up(client, engine):
    """Same status everywhere. vLLM words its own messages, and its request-schema errors (a
    string for an integer) have type "Bad Request" and param "body.<field>"
    (docs/serving-api.md)."""
    for body, status, err_type, message, param, vllm_message in BAD_REQUESTS:
        exc = error(client.request, "POST", "/v1/completions", json_body=body)
        assert exc.status == status and body_of(exc)["error"]["code"] == status, body
        assert differs(engine, message, vllm_message) in exc.message, (body, exc.message)
        if engine == "grpo-lab":
            assert (exc.error_type, exc.param) == (err_type, param), body
        else:
            assert exc.error_type in (err_type, "Bad Request"), body
    for raw in (b'{"prompt": [1, 2', b"[1, 2]", b"null"):  # malformed or not an object
        exc = error(client.request, "POST", "/v1/completions", data=raw)
        assert exc.status == 400 and exc.error_type in ("BadRequestError", "Bad Request"), raw
    # The exact limit is fine: prompt + max_tokens == max_model_len.
    out = client.completions([1] * 7, max_tokens=MAX_LEN - 7, ignore_eos=True, temperature=0)
    assert len(out["choices"][0]["token_ids"]) == MAX_LEN - 7
    assert out["choices"][0]["finish_reason"] == "length"
    assert client.health()


def test_body_limit_and_no_streaming(client, stand_in):
    """grpo-lab serve only: a body limit (vLLM has none) and no streaming (vLLM streams)."""
    big = json.dumps({"prompt": [1] * 60_000}).encode()  # ~180 kB > the 100 kB limit
    exc = error(client.request, "POST", "/v1/completions", data=big,
                headers={"Content-Type": "application/json"})
    assert exc.status == 413 and "limit of 100000 bytes" in exc.message
    assert exc.error_type == "BadRequestError"  # the proxy labels its 413 the same
    exc = error(client.request, "POST", "/v1/completions", json_body={"prompt": [1, 5],
                                                                       "stream": True})
    assert (exc.status, exc.param) == (400, "stream") and "stream" in exc.message


# ------------------------------------------------------------------ adapters in completions


def test_adapters_change_logprobs_and_the_base_name_ignores_them(client, lora_root,
                                                                 tiny_model_and_tokenizer):
    ids = prompt_ids(tiny_model_and_tokenizer[1], ["12+34=", "7+8="])
    kwargs = dict(max_tokens=4, n=2, seed=3, ignore_eos=True)

    def logprobs(model):
        out = client.completions(ids, model=model, **kwargs)
        return [c["logprobs"]["token_logprobs"] for c in out["choices"]]

    before = logprobs("tiny")
    client.load_lora_adapter("policy-v1", str(lora_root / "a"))
    client.load_lora_adapter("policy-v2", str(lora_root / "b"))
    try:
        v1, v2 = logprobs("policy-v1"), logprobs("policy-v2")
        assert v1 != before and v2 != before and v1 != v2
        for base in (logprobs("tiny"), logprobs(None), logprobs("")):
            assert torch.allclose(torch.tensor(base), torch.tensor(before), atol=1e-6)
        # Concurrent requests under the three names decode in the same batches.
        futures = [client.submit(client.client.completions(ids, model=m, **kwargs))
                   for m in ("policy-v1", "tiny", "policy-v2")]
        mixed = [[c["logprobs"]["token_logprobs"] for c in f.result(60)["choices"]]
                 for f in futures]
        for got, want in zip(mixed, (v1, before, v2), strict=True):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)
    finally:
        client.unload_lora_adapter("policy-v1")
        client.unload_lora_adapter("policy-v2")


def test_processed_logprobs_equal_the_trainers(client, lora_root, tiny_model_and_tokenizer):
    """ratio = exp(logp_trainer - logp_server) within 1e-3 of 1 on every token, at T = 0.7."""
    from peft import PeftModel

    base, tokenizer = tiny_model_and_tokenizer
    ids = prompt_ids(tokenizer, ["12+34=", "7+8=", "99+1=", "50+50="])
    client.load_lora_adapter("policy-v7", str(lora_root / "a"))
    try:
        for name, model in (("tiny", copy.deepcopy(base)), ("policy-v7", PeftModel.from_pretrained(
                copy.deepcopy(base), str(lora_root / "a")))):
            out = client.completions(ids, model=name, n=4, seed=9, temperature=0.7, max_tokens=6)
            choices = out["choices"]
            p_ids, p_mask = pad_left([c["prompt_token_ids"] for c in choices],
                                     tokenizer.pad_token_id)
            c_ids, c_mask = pad_right([c["token_ids"] for c in choices], tokenizer.pad_token_id)
            served, _ = pad_right([c["logprobs"]["token_logprobs"] for c in choices], 0.0)
            with torch.no_grad():
                trainer = policy_logprobs(model.eval(), p_ids, p_mask, c_ids, c_mask, 0.7)
            ratio = torch.exp(trainer - served.float())
            assert ((ratio - 1).abs() * c_mask).max() < 1e-3, name
    finally:
        client.unload_lora_adapter("policy-v7")


# ------------------------------------------------------------------ pause and resume


def test_pause_keep_holds_requests_until_resume(client, tiny_model_and_tokenizer):
    ids = prompt_ids(tiny_model_and_tokenizer[1], ["1+2="])[0]
    assert client.pause("keep") == {"status": "paused"}
    try:
        pending = client.submit(client.client.completions(ids, max_tokens=3))
        time.sleep(0.5)
        assert not pending.done()  # accepted, waiting
        assert client.health()  # /health does not depend on pause
    finally:
        assert client.resume() == {"status": "resumed"}
    assert pending.result(30)["choices"][0]["finish_reason"] in ("stop", "length")


def test_pause_modes_and_errors(client, engine):
    for mode in ("wait", "abort"):
        assert client.pause(mode) == {"status": "paused"}
        assert client.resume() == {"status": "resumed"}
    assert json.loads(client.request("POST", "/pause")[1]) == {"status": "paused"}  # abort
    client.resume()
    exc = error(client.pause, "later")
    assert (exc.status, exc.param) == (400, differs(engine, "mode", "query.mode"))


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


def test_an_authorization_header_that_is_not_utf8_is_401(server, stand_in):
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


def test_numbers_must_be_finite_float32_and_deep_json_is_400(client, stand_in):
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


def test_stop_lists_are_bounded(client, stand_in):
    from grpo_lab.serving.protocol import MAX_STOP_TOKEN_IDS

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
        import threading

        self.threads.append(threading.current_thread())
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_sizes_are_checked_before_tokenizing_and_tokenizing_is_off_the_loop(
        monkeypatch, tiny_model_and_tokenizer):
    import threading

    model, tokenizer = tiny_model_and_tokenizer
    spy = SpyTokenizer(tokenizer)

    async def check(http, server):
        t0 = time.monotonic()
        reply = await http.post("/v1/completions", json={"prompt": "7+8=" * 3_000_000})
        out = await reply.json()
        assert reply.status == 400 and out["error"]["param"] == "prompt", out
        assert "characters) is longer than the maximum model length" in out["error"]["message"]
        assert spy.threads == [] and time.monotonic() - t0 < 10  # 12 MB never tokenized
        reply = await http.post("/v1/completions", json={"prompt": ["12+3=", "4+4="],
                                                          "max_tokens": 2})
        assert reply.status == 200 and len((await reply.json())["choices"]) == 2
        assert spy.threads and threading.main_thread() not in spy.threads  # a worker thread

    in_process(monkeypatch, (model, spy), {"VLLM_SERVER_DEV_MODE": "1"}, check, max_model_len=64)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_dead_engine_ends_the_server_process(tiny_model_and_tokenizer, model_copy):
    """The serving loop returns 1 (`serve` exits with it) once the engine thread died; the
    in-process test above (`engine.error` set by hand) checks the answers meanwhile."""
    from grpo_lab.serving.requests import RequestGroup, Sequence, make_generator
    from grpo_lab.serving.sampling import SamplingParams
    from grpo_lab.serving.serve_loop import serve_forever

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


def test_an_adapter_under_the_base_models_name(client, lora_root, engine):
    """vLLM 0.27.1 accepts it (newer vLLM refuses it, as grpo-lab serve does;
    docs/serving-api.md). Last in this module: on vLLM it leaves the engine's adapter state
    touched by a name that clients also use for the base model."""
    base_name_answer = differs(engine, None, "Success: LoRA adapter 'tiny' added successfully.")
    if base_name_answer is None:
        exc = error(client.load_lora_adapter, "tiny", str(lora_root / "a"))
        assert (exc.status, body_of(exc)) == (400, vllm_error(
            "The lora adapter 'tiny' conflicts with a served base model.", "InvalidUserInput",
            400))
    else:
        try:
            assert client.load_lora_adapter("tiny", str(lora_root / "a")) == base_name_answer
        finally:
            client.unload_lora_adapter("tiny")
    assert [m["id"] for m in client.models()] == ["tiny"]
