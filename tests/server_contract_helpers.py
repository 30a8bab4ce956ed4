"""Constants and helpers of tests/test_server_contract.py and tests/test_server_guards.py (their
servers are tests/server_contract_fixtures.py's fixtures)."""

from __future__ import annotations

import json

import pytest

from grpo_lab.serve.client import ServerError

KEY = "test-key"
LAG_S = 2.0
MAX_LEN = 32

serve_only = pytest.mark.parametrize("engine", ["grpo-lab"], indirect=True)
"""For what only `grpo-lab serve` has (an allowed LoRA root, an emulated mount lag, a body limit,
its own checks of hostile input): the test exists for that engine alone (docs/serving-api.md:
where the two engines differ), so nothing is generated only to be skipped."""


def differs(engine: str, grpo_lab, vllm):
    """What each engine answers where docs/serving-api.md says they differ."""
    return vllm if engine == "vllm" else grpo_lab


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
