"""`/v1/chat/completions` on `grpo-lab serve` and through the proxy: a chat model's natural call.

The conversation is rendered with the model's chat template, the assistant's turn opened, then
sampled as a /v1/completions prompt; the answer is vLLM's chat shape."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest

from grpo_lab.proxy.config import start_proxy_process

MESSAGES = [{"role": "user", "content": "Tom has 3 apples and buys 4 more. How many?"}]


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.fixture
def chat_server(server_process, chat_model_dir):
    return server_process("tiny-chat")


def test_a_chat_completion_renders_the_template_and_answers_in_chat_shape(chat_server):
    status, out = _post(chat_server.url + "/v1/chat/completions",
                        {"messages": MESSAGES, "max_completion_tokens": 12, "temperature": 0,
                         "logprobs": True, "top_logprobs": 2, "return_token_ids": True})
    assert status == 200, out
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-")
    choice = out["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    tokens = choice["logprobs"]["content"]
    assert len(tokens) == len(choice["token_ids"]) == out["usage"]["completion_tokens"] <= 12
    assert all(t["logprob"] <= 0 and len(t["top_logprobs"]) == 2 for t in tokens)
    # the same conversation through the completions API, rendered by hand: the same reply
    from transformers import AutoTokenizer

    from grpo_lab.model.chat_model import chat_model_path

    tokenizer = AutoTokenizer.from_pretrained(chat_model_path(progress=False))
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    status, plain = _post(chat_server.url + "/v1/completions",
                          {"prompt": text, "max_tokens": 12, "temperature": 0,
                           "add_special_tokens": False})
    assert status == 200 and plain["choices"][0]["text"] == choice["message"]["content"]


def test_a_chat_completion_through_the_proxy(chat_server):
    with start_proxy_process([chat_server.url]) as proxy:
        status, out = _post(proxy.url + "/v1/chat/completions",
                            {"messages": MESSAGES, "max_tokens": 8, "temperature": 0})
    assert status == 200, out
    assert out["choices"][0]["message"]["content"]


def test_bad_chat_requests_are_named(chat_server):
    status, out = _post(chat_server.url + "/v1/chat/completions", {"messages": []})
    assert status == 400 and "messages" in out["error"]["message"]
    status, out = _post(chat_server.url + "/v1/chat/completions",
                        {"messages": [{"role": "user"}]})
    assert status == 400 and "messages[0]" in out["error"]["message"]
    status, out = _post(chat_server.url + "/v1/chat/completions",
                        {"messages": MESSAGES, "model": "no-such-adapter"})
    assert status == 404 and "no-such-adapter" in out["error"]["message"]
