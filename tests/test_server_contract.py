"""docs/serving-api.md, checked against two engines running as real processes: `grpo-lab serve`
and real vLLM (its CPU build, where installed: `make vllm`). Same requests, same assertions;
where vLLM answers differently the difference is written in docs/serving-api.md ("Where the two
engines differ") and the test names it through `differs(...)`.

One server per engine serves this file and tests/test_server_guards.py (what only `grpo-lab
serve` has: gates, limits, hostile input, engine death): tests/server_contract_fixtures.py
starts it once for both. Every test here runs on both engines.
"""

from __future__ import annotations

import copy
import json
import re
import time

import torch
from float_tolerance import logprob_atol
from server_contract_helpers import (
    MAX_LEN,
    body_of,
    differs,
    error,
    prompt_ids,
    vllm_error,
)

from grpo_lab.algo.logprobs import policy_logprobs
from grpo_lab.serve.client import BlockingClient
from grpo_lab.train.rollout_batch import pad_left, pad_right

pytest_plugins = ["server_contract_fixtures"]


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
        body = body_of(exc)
        if engine == "vllm":  # vLLM redacts what it takes for a temporary path: all of
            # /tmp/pytest-of-root/..., but only the /tmp/... part of a TMPDIR elsewhere
            # (/work/x/tmp/... -> /work/x<path>); the path itself is never echoed either way
            body["error"]["message"] = re.sub(r"\S*<path>", "<path>", body["error"]["message"])
        assert (exc.status, body) == (status, vllm_error(message, err_type, status)), path
    exc = error(client.request, "POST", "/v1/load_lora_adapter", data=b"{not json")
    assert exc.status == 400 and exc.error_type in ("BadRequestError", "Bad Request")
    exc = error(client.request, "POST", "/v1/load_lora_adapter",
                json_body={"lora_name": 3, "lora_path": "/x"})
    assert exc.status == 400 and exc.param in ("lora_name", "body.lora_name")
    assert [m["id"] for m in client.models()] == ["tiny"]  # nothing half-loaded


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
    # The same tokens, exactly. Their logprobs agree to float32 rounding, not bit for bit: real
    # vLLM's CPU build returned -1.0083743 once and -1.0083746 for the same token of the same
    # seeded request (its kernels' sums follow the batch it runs in).
    for a, b in zip(first["choices"], second["choices"], strict=True):
        assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"]
        gaps = [abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"],
                                           b["logprobs"]["token_logprobs"], strict=True)]
        vocab = len(tiny_model_and_tokenizer[1])
        assert max(gaps) <= logprob_atol(torch.tensor(a["logprobs"]["token_logprobs"]),
                                         vocab), gaps
    tokens = [c["token_ids"] for c in first["choices"]]
    assert len({tuple(t) for t in tokens}) > 1  # children differ...
    child2 = client.completions(ids, n=1, seed=125, **kwargs)  # ...child i uses seed + i
    assert child2["choices"][0]["token_ids"] == tokens[2]


def test_seeded_children_that_fill_more_than_one_scheduler_step_all_complete(
        client, tiny_model_and_tokenizer):
    """128 seeded children of a 20-token prompt: 2,560 prompt tokens, more than vLLM's CPU
    scheduler takes in one step (2,048), as a real model's chat prompts in a GRPO batch are. vLLM
    0.27.1's CPU build chunks such a prefill and then rewinds each seeded child's generator,
    which a CPU generator cannot do: its engine died ("CPU Generator does not use offset") until
    grpo_lab started it without chunked prefill (serve/process.vllm_cpu_args)."""
    ids = prompt_ids(tiny_model_and_tokenizer[1], ["12+34=56,78+90=168,1+"])[0]
    assert len(ids) >= 20
    out = client.completions(ids, n=128, seed=7, max_tokens=2, temperature=1.0, ignore_eos=True)
    assert len(out["choices"]) == 128
    assert all(len(c["token_ids"]) == 2 for c in out["choices"])
    assert client.completions(ids, n=1, seed=7, max_tokens=2, temperature=1.0, ignore_eos=True)[
        "choices"][0]["token_ids"] == \
        out["choices"][0]["token_ids"]  # the server is still up, and child 0 used seed 7


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


def test_an_adapter_under_the_base_models_name(client, lora_root, engine):
    """vLLM 0.27.1 accepts it (newer vLLM refuses it, as grpo-lab serve does;
    docs/serving-api.md). Last in this file, and no test of tests/test_server_guards.py runs on
    vLLM, so it is the last test on vLLM's server: there it leaves the engine's adapter state
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
