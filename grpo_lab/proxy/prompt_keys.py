"""What the proxy routes on: the token ids of each prompt in a completion request.

The router (grpo_lab.proxy.router) needs token ids, and requests carry them in one of vLLM's prompt
forms: a list of ids, a list of id lists (a batch), a string, a list of strings, or chat
messages. Ids are used as they are. Text is tokenized with the proxy's `--tokenizer` when one
is given (with the chat template for messages); without one, the proxy routes on pseudo-tokens:
the UTF-8 bytes (chat: the messages as sorted JSON) cut into 4-byte chunks, about one token
each in English text. Pseudo-blocks do not line up with the server's KV blocks, but prompts that
share a long prefix share their leading pseudo-blocks, and that is what affinity needs.

A body that no replica could ever accept (no prompt, an empty one, a wrong type) raises the
server's `RequestError` (grpo_lab.serve.protocol, the same prompt rules), so the proxy answers
400 at once without a round trip.
"""

from __future__ import annotations

import json

from ..serve.protocol import RequestError, parse_prompts

TEXT_BYTES_PER_TOKEN = 4  # pseudo-tokens of text prompts: 4 UTF-8 bytes each


def pseudo_tokens(text: str) -> list[int]:
    """Text as routing keys without a tokenizer: one int per 4 UTF-8 bytes (a partial tail is
    dropped, as a partial KV block would be)."""
    data = text.encode()
    return memoryview(data)[: len(data) - len(data) % TEXT_BYTES_PER_TOKEN].cast("I").tolist()


def routing_keys(body: dict, chat: bool, tokenizer=None) -> tuple[list, list[list[int]]]:
    """-> (the prompts, the token ids to route each one on)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("Field required: 'messages' (a non-empty list).", param="messages")
        if tokenizer is not None:
            try:
                ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=(
                    body.get("add_generation_prompt", True)))
                return [messages], [list(ids["input_ids"] if hasattr(ids, "keys") else ids)]
            except Exception:  # the replica will judge the messages; route on their bytes
                pass
        return [messages], [pseudo_tokens(json.dumps(messages, sort_keys=True))]
    if "prompt" not in body:
        raise RequestError("Field required: 'prompt'.", param="prompt")
    prompts = parse_prompts(body["prompt"])
    if tokenizer is None:
        return prompts, [p if isinstance(p, list) else pseudo_tokens(p) for p in prompts]
    special = body.get("add_special_tokens", True) is not False
    return prompts, [p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=special)
                     for p in prompts]
