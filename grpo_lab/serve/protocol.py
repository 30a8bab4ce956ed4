"""The OpenAI/vLLM wire format: request validation, response bodies, and errors both ways.

Kept apart from the HTTP plumbing (grpo_lab.serve.server) so the field rules read in one
place; the proxy and the client use the same rules (one error type, one error body, one prompt
check). Every rule answers what vLLM answers (docs/serving-api.md): a 400 `BadRequestError` for
a request that can never succeed, a 404 `NotFoundError` for an unknown model, and the error body
`{"error": {"message", "type", "param", "code"}}`.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at import: the proxy uses the error and prompt rules
    from .sampling import SamplingParams

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_TINY, FLOAT32_MAX = 2.0**-126, 3.4028234663852886e38
"""The smallest normal and the largest float32: sampling parameters are float32 tensors, where
a smaller non-zero value becomes 0 or a denormal (a division by it overflows) and a larger one
inf."""
MAX_STOP_TOKEN_IDS = 1024
"""Most `stop_token_ids` a request may name (each is checked at every decode step)."""
_MISSING = object()

ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError",
               502: "BadGatewayError", 503: "ServiceUnavailableError",
               504: "GatewayTimeoutError"}
"""The error `type` per status (any other: InternalServerError). 413 is a refused request like
any 400, so BadRequestError (docs/serving-api.md), from the server and the proxy alike; 502-504
are the proxy's (vLLM has no upstream)."""


class RequestError(Exception):
    """An error answer in vLLM's wire format: `.message`, `.status`, `.error_type`, `.param`.
    The server and the proxy raise it for a request they refuse and answer `.as_body()`; the
    client's `ServerError` is one that came back."""

    def __init__(self, message: str, status: int = 400, error_type: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param = message, status, param
        self.error_type = error_type or ERROR_TYPES.get(status, "InternalServerError")

    def as_body(self) -> dict:
        return error_body(self.message, self.status, self.error_type, self.param)


def error_body(message: str, status: int, error_type: str | None = None,
               param: str | None = None) -> dict:
    """vLLM's error body; `error_type` defaults to vLLM's type for `status`."""
    error_type = error_type or ERROR_TYPES.get(status, "InternalServerError")
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


def parse_error(text: str) -> tuple[str, str | None, str | None]:
    """An error answer's text -> (message, type, param). vLLM's body gives all three; other JSON
    bodies (`{"detail": "Not Found"}`, `{"error": "Unauthorized"}`) a message; else the text."""
    try:
        data = json.loads(text)
    except ValueError:
        return text, None, None
    error = data.get("error", data.get("detail")) if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", text)), error.get("type"), error.get("param")
    return (text if error is None else str(error)), None, None


def _type_name(value) -> str:
    return type(value).__name__ if value is not None else "null"


_KIND_NAMES = {"int": "an integer", "float": "a number", "bool": "a boolean", "str": "a string",
               "int_list": "a list of integers"}


def get_field(body: dict, name: str, kind: str, default=_MISSING, *, nullable: bool = False):
    """body[name] checked against `kind` ("int", "float", "bool", "str", "int_list")."""
    value = body.get(name, default)
    if value is _MISSING:
        raise RequestError(f"Field required: '{name}'.", param=name)
    if value is None and (nullable or default is None):
        return None
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
        "int_list": isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                                    for v in value),
    }[kind]
    if not ok:
        raise RequestError(f"'{name}' must be {_KIND_NAMES[kind]}, got {_type_name(value)} "
                           f"{value!r:.80}.", param=name)
    if kind == "float":
        value = float(value)
        if not (value == 0 or FLOAT32_TINY <= abs(value) <= FLOAT32_MAX):  # NaN fails too
            raise RequestError(f"'{name}' must be a finite number, 0 or of magnitude between "
                               f"{FLOAT32_TINY:.4g} and {FLOAT32_MAX:.4g} (float32), got "
                               f"{value!r}.", param=name)
    return value


def _check(condition: bool, message: str, param: str) -> None:
    if not condition:
        raise RequestError(message, param=param)


def is_token_ids(value) -> bool:
    """A non-empty list of 64-bit ints, bools excluded; checked at C speed (the proxy runs it on
    every request): array refuses floats, strings, None and ints past 64 bits."""
    if type(value) is not list or not value:
        return False
    try:
        array("q", value)
    except (TypeError, OverflowError):
        return False
    return bool not in map(type, value)


def parse_prompts(prompt) -> list[str | list[int]]:
    """vLLM's prompt forms as a list: a string, a list of strings, a list of token ids, or a list
    of token-id lists. Anything else is a 400 (the server's and the proxy's)."""
    if isinstance(prompt, str):
        return [prompt]
    if is_token_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(v, str) for v in prompt) or all(is_token_ids(v) for v in prompt):
            return list(prompt)
    if prompt == []:
        raise RequestError("Prompt cannot be empty.", param="prompt")
    raise RequestError("'prompt' must be a string, a list of strings, a list of token ids or a "
                       f"list of token-id lists (non-empty), got {_type_name(prompt)}.",
                       param="prompt")


@dataclass
class CompletionRequest:
    model: str | None
    prompts: list[str | list[int]]
    params: SamplingParams
    max_tokens: int | None  # None = up to max_model_len
    return_token_ids: bool
    add_special_tokens: bool


def parse_completion_request(body, max_logprobs: int = 20) -> CompletionRequest:
    """Validate a /v1/completions body (types and ranges); lengths are checked after tokenizing."""
    from .sampling import SamplingParams  # torch: only where requests are served

    if not isinstance(body, dict):
        raise RequestError(f"The request body must be a JSON object, got {_type_name(body)}.")
    if body.get("stream"):
        raise RequestError("stream=true is not supported by grpo_lab's server.", param="stream")
    if body.get("echo"):
        raise RequestError("echo=true is not supported by grpo_lab's server.", param="echo")
    model = get_field(body, "model", "str", None)
    if "prompt" not in body:
        raise RequestError("Field required: 'prompt'.", param="prompt")
    prompts = parse_prompts(body["prompt"])
    n = get_field(body, "n", "int", 1)
    _check(n is not None and n >= 1, f"n must be at least 1, got {n}.", "n")
    max_tokens = get_field(body, "max_tokens", "int", 16, nullable=True)
    _check(max_tokens is None or max_tokens >= 1,
           f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    temperature = get_field(body, "temperature", "float", 1.0, nullable=True)
    temperature = 1.0 if temperature is None else temperature
    _check(temperature >= 0, f"temperature must be non-negative, got {temperature}.",
           "temperature")
    # as vLLM: greedy children would all be the same completion
    _check(temperature > 0 or n == 1, f"n must be 1 when using greedy sampling, got {n}.", "n")
    top_p = get_field(body, "top_p", "float", 1.0, nullable=True)
    top_p = 1.0 if top_p is None else top_p
    _check(0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}.", "top_p")
    top_k = get_field(body, "top_k", "int", 0, nullable=True) or 0
    _check(top_k >= -1, f"top_k must be 0 or -1 (disable), or at least 1, got {top_k}.", "top_k")
    min_p = get_field(body, "min_p", "float", 0.0, nullable=True) or 0.0
    _check(0 <= min_p <= 1, f"min_p must be in [0, 1], got {min_p}.", "min_p")
    penalty = get_field(body, "repetition_penalty", "float", 1.0, nullable=True)
    penalty = 1.0 if penalty is None else penalty
    _check(penalty > 0, f"repetition_penalty must be greater than zero, got {penalty}.",
           "repetition_penalty")
    seed = get_field(body, "seed", "int", None)
    _check(seed is None or INT64_MIN <= seed <= INT64_MAX, f"seed must fit in 64 bits, got {seed}.",
           "seed")
    logprobs = get_field(body, "logprobs", "int", None)
    _check(logprobs is None or 0 <= logprobs <= max_logprobs,
           f"Requested sample logprobs of {logprobs}, which is greater than max allowed: "
           f"{max_logprobs}" if logprobs is not None and logprobs > 0 else
           f"logprobs must be non-negative, got {logprobs}.", "logprobs")
    stop_ids = body.get("stop_token_ids")
    _check(not isinstance(stop_ids, list) or len(stop_ids) <= MAX_STOP_TOKEN_IDS,
           f"stop_token_ids has {len(stop_ids or [])} entries; the limit is "
           f"{MAX_STOP_TOKEN_IDS}.", "stop_token_ids")  # before its entries are checked
    stop_token_ids = get_field(body, "stop_token_ids", "int_list", None) or []
    stop = body.get("stop")
    _check(not stop, "'stop' strings are not supported by grpo_lab's server; use "
           "stop_token_ids.", "stop")
    params = SamplingParams(
        n=n, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        repetition_penalty=penalty, max_tokens=max_tokens or 0, seed=seed, logprobs=logprobs,
        stop_token_ids=stop_token_ids, ignore_eos=get_field(body, "ignore_eos", "bool", False),
    )
    return CompletionRequest(
        model=model, prompts=prompts, params=params, max_tokens=max_tokens,
        return_token_ids=bool(get_field(body, "return_token_ids", "bool", False, nullable=True)),
        add_special_tokens=get_field(body, "add_special_tokens", "bool", True),
    )


def parse_chat_request(body, max_logprobs: int = 20) -> tuple[CompletionRequest, list[dict]]:
    """Validate a /v1/chat/completions body: its `messages` (roles and text contents), and the
    sampling fields as /v1/completions takes them (`max_completion_tokens` is `max_tokens`;
    `logprobs: true` with `top_logprobs` is the completions API's `logprobs: N`)."""
    if not isinstance(body, dict):
        raise RequestError(f"The request body must be a JSON object, got {_type_name(body)}.")
    messages = body.get("messages")
    _check(isinstance(messages, list) and bool(messages),
           "Field required: 'messages', a non-empty list of {role, content}.", "messages")
    for i, message in enumerate(messages):
        _check(isinstance(message, dict) and isinstance(message.get("role"), str)
               and isinstance(message.get("content"), str),
               f"messages[{i}] must be an object with a string 'role' and a string 'content' "
               "(text only on grpo_lab's server).", "messages")
    as_completion = {k: v for k, v in body.items()
                     if k not in ("messages", "logprobs", "top_logprobs", "max_completion_tokens")}
    as_completion["prompt"] = [0]  # replaced by the rendered conversation
    if "max_completion_tokens" in body:
        as_completion["max_tokens"] = body["max_completion_tokens"]
    if get_field(body, "logprobs", "bool", False, nullable=True):
        as_completion["logprobs"] = get_field(body, "top_logprobs", "int", 0, nullable=True) or 0
    return parse_completion_request(as_completion, max_logprobs), messages


def chat_choice(index: int, seq, token_text, text: str, return_token_ids: bool) -> dict:
    """One `choices[]` entry of a chat completion in vLLM's non-streaming shape."""
    logprobs = None
    if seq.params.logprobs is not None:
        content = []
        for pos, (token, logprob) in enumerate(zip(seq.output_ids, seq.logprobs, strict=True)):
            top = seq.top_logprobs[pos] if seq.top_logprobs else []
            content.append({"token": token_text(token), "logprob": logprob,
                            "bytes": list(token_text(token).encode()),
                            "top_logprobs": [{"token": token_text(t), "logprob": lp,
                                              "bytes": list(token_text(t).encode())}
                                             for t, lp in top]})
        logprobs = {"content": content}
    return {
        "index": index, "message": {"role": "assistant", "content": text},
        "logprobs": logprobs, "finish_reason": seq.finish_reason,
        "stop_reason": seq.stop_reason,
        "token_ids": list(seq.output_ids) if return_token_ids else None,
    }


def check_prompt(ids: list[int], max_tokens: int | None, max_model_len: int,
                 vocab_size: int) -> int:
    """Token ids in range and the length rule (vLLM never clamps); returns the max_tokens to use."""
    if not ids:
        raise RequestError("Prompt cannot be empty.", param="prompt")
    if len(ids) >= max_model_len:  # first: a huge prompt is refused before it is scanned
        raise RequestError(f"The prompt (length {len(ids)}) is longer than the maximum model "
                           f"length of {max_model_len}.", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise RequestError(f"Token id {bad[0]} is out of vocabulary (vocabulary size "
                           f"{vocab_size}).", param="prompt")
    if max_tokens is None:
        return max_model_len - len(ids)
    if len(ids) + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the prompt, {max_tokens} "
            "in the completion). Please reduce the length of the prompt or the completion.",
            param="max_tokens")
    return max_tokens


def completion_choice(index: int, seq, token_text, text: str, return_token_ids: bool) -> dict:
    """One `choices[]` entry in vLLM's non-streaming shape."""
    logprobs = None
    if seq.params.logprobs is not None:
        tokens = [token_text(t) for t in seq.output_ids]
        offsets, offset = [], 0
        for tok in tokens:
            offsets.append(offset)
            offset += len(tok)
        top = []
        for pos, (token, logprob) in enumerate(zip(seq.output_ids, seq.logprobs, strict=True)):
            entry = {token_text(t): lp for t, lp in
                     (seq.top_logprobs[pos] if seq.top_logprobs else [])}
            entry[token_text(token)] = logprob  # the sampled token is always there
            top.append(entry)
        logprobs = {"text_offset": offsets, "token_logprobs": seq.logprobs, "tokens": tokens,
                    "top_logprobs": top}
    return {
        "index": index, "text": text, "logprobs": logprobs,
        "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
        "token_ids": list(seq.output_ids) if return_token_ids else None,
        "prompt_token_ids": list(seq.prompt_ids) if return_token_ids else None,
    }


def completion_response(model: str, choices: list[dict], prompt_tokens: int,
                        completion_tokens: int, chat: bool = False) -> dict:
    return {
        "id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()), "model": model, "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def model_card(name: str, root: str, parent: str | None, max_model_len: int | None,
               created: int) -> dict:
    """One entry of /v1/models (vLLM's ModelCard)."""
    return {
        "id": name, "object": "model", "created": created, "owned_by": "vllm", "root": root,
        "parent": parent, "max_model_len": max_model_len,
        "permission": [{"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission",
                        "created": created, "allow_create_engine": False,
                        "allow_sampling": True, "allow_logprobs": True,
                        "allow_search_indices": False, "allow_view": True,
                        "allow_fine_tuning": False, "organization": "*", "group": None,
                        "is_blocking": False}],
    }


def loads_json(raw: bytes) -> object:
    """A request body parsed; a 400 in vLLM's format when it is not JSON, also when it is nested
    too deeply for the parser (a RecursionError, which must not become a 500)."""
    try:
        return json.loads(raw)
    except ValueError as exc:
        raise RequestError(f"Invalid JSON body: {exc}") from None
    except RecursionError:
        raise RequestError("Invalid JSON body: nested too deeply.") from None


async def read_json_body(request) -> object:
    """An aiohttp request's JSON body; a 400 in vLLM's format when it is not JSON."""
    return loads_json(await request.read())  # read() raises 413 above client_max_size


def bearer_ok(header: str | None, api_key: str) -> bool:
    """Whether an `Authorization` header is `Bearer <api_key>`, compared in constant time on
    bytes. aiohttp hands non-UTF-8 header bytes over as surrogate escapes: they are encoded
    back as they came (never a UnicodeEncodeError, so a 401, not a 500)."""
    given = (header or "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {api_key}".encode("utf-8", "surrogateescape"))
