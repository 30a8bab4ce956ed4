"""The config's sampling settings reach the inference servers (issue 33, item 4): TRL's fields
and defaults in GRPOConfig, the /v1/completions body `HTTPGenerator` sends, and what grpo_lab's
own server makes of it."""

from __future__ import annotations

import pytest
from fake_http import FakeServer

from grpo_lab.bucket.adapters import AdapterBucket
from grpo_lab.rollout.http_generator import HTTPGenerator, request_body
from grpo_lab.serve.protocol import RequestError, parse_completion_request
from grpo_lab.serve.sampling_settings import sampling_settings, truncates_sampling
from grpo_lab.train.config import GRPOConfig

ARGS = dict(model="policy-v3", n=4, max_tokens=5, temperature=0.7, seed=11)


def test_trl_names_and_defaults():
    config = GRPOConfig()
    assert (config.top_p, config.top_k, config.min_p, config.repetition_penalty) == \
        (1.0, 0, None, 1.0)  # TRL 1.16's GRPOConfig
    assert (config.stop, config.stop_token_ids, truncates_sampling(config)) == \
        (None, None, False)
    assert truncates_sampling(GRPOConfig(top_k=20))
    config = GRPOConfig(stop_token_ids="151643, 151645", stop="</answer>")  # the CLI's text
    assert (config.stop_token_ids, config.stop) == ([151643, 151645], ["</answer>"])
    assert GRPOConfig.from_dict(config.to_dict()) == config
    # Several stop strings on the command line: a list literal, as `flag_args` writes a list.
    assert GRPOConfig(stop="['</a>', 'x, y']").stop == ["</a>", "x, y"]
    assert GRPOConfig(stop_token_ids="[1, 2]").stop_token_ids == [1, 2]


@pytest.mark.parametrize("field, value", [
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("repetition_penalty", 0.0), ("stop_token_ids", "1,x"), ("stop_token_ids", [-1]),
    ("stop", [""]),
])
def test_bad_sampling_settings_fail_at_construction(field, value):
    with pytest.raises(ValueError, match=field):
        GRPOConfig(**{field: value})


def test_the_default_body_is_untruncated_sampling():
    body = request_body([1, 5, 6], **ARGS)
    assert body == {"prompt": [1, 5, 6], "model": "policy-v3", "n": 4, "max_tokens": 5,
                    "temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0,
                    "repetition_penalty": 1.0, "seed": 11, "logprobs": 0,
                    "return_token_ids": True}
    assert request_body([1], **ARGS, sampling=sampling_settings(GRPOConfig())) == \
        request_body([1], **ARGS)
    with pytest.raises(ValueError, match="unknown sampling settings"):
        request_body([1], **ARGS, sampling={"top_q": 0.5})


def test_the_configs_settings_are_sent():
    config = GRPOConfig(top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                        stop_token_ids=[2, 7], stop=["\n\n"])
    body = request_body([1], **ARGS, sampling=sampling_settings(config))
    assert {k: body[k] for k in ("top_p", "top_k", "min_p", "repetition_penalty", "stop",
                                 "stop_token_ids")} == \
        {"top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "stop": ["\n\n"],
         "stop_token_ids": [2, 7]}


def test_grpo_lab_server_reads_every_field_but_stop_strings():
    config = GRPOConfig(top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
                        stop_token_ids=[2, 7])
    request = parse_completion_request(request_body([1], **ARGS,
                                                    sampling=sampling_settings(config)))
    params = request.params
    assert (params.top_p, params.top_k, params.min_p, params.repetition_penalty,
            params.stop_token_ids, params.temperature, params.n) == \
        (0.9, 20, 0.05, 1.1, [2, 7], 0.7, 4)
    with pytest.raises(RequestError, match="'stop' strings are not supported"):
        parse_completion_request(request_body([1], **ARGS, sampling={"stop": ["\n"]}))


def completion_reply(body: dict) -> dict:
    """A /v1/completions answer with `n` one-token choices."""
    return {"choices": [{"index": i, "text": "x", "token_ids": [9],
                         "prompt_token_ids": body["prompt"], "finish_reason": "length",
                         "logprobs": {"token_logprobs": [-0.5]}} for i in range(body["n"])]}


@pytest.mark.parametrize("shape", ["group", "single"])
def test_http_generator_sends_the_settings_in_every_request(tmp_path, shape):
    config = GRPOConfig(top_p=0.8, top_k=5, min_p=0.1, repetition_penalty=1.2,
                        stop_token_ids=[3])
    with FakeServer({"/v1/completions": completion_reply}) as server:
        generator = HTTPGenerator(server.url, AdapterBucket(tmp_path), seed=0,
                                  request_shape=shape, sampling=sampling_settings(config))
        try:
            out = generator.generate([[1, 2], [3]], version=0, num_generations=2,
                                     max_new_tokens=4, temperature=0.9)
        finally:
            generator.close()
    assert len(out) == 4 and out.prompt_ids == [[1, 2], [1, 2], [3], [3]]
    bodies = [body for _, path, body, _ in server.requests if path == "/v1/completions"]
    assert len(bodies) == (2 if shape == "group" else 4)
    for body in bodies:
        assert {k: body[k] for k in ("top_p", "top_k", "min_p", "repetition_penalty",
                                     "stop_token_ids", "temperature", "max_tokens", "model")} == \
            {"top_p": 0.8, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2,
             "stop_token_ids": [3], "temperature": 0.9, "max_tokens": 4, "model": "policy-v0"}
        assert "stop" not in body
