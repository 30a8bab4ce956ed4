"""From a prompt to the token ids the model sees: plain text, or a chat rendered by its template.

Token ids are made the way TRL's GRPOTrainer makes them, so that grpo_lab and TRL train on the
same ids: a conversation, or text for a model with a chat template, goes through
`apply_chat_template(..., add_generation_prompt=True)`; text for a base model through the
tokenizer (docs/internals.md, "From a prompt to token ids").
"""

from __future__ import annotations

import json
from collections.abc import Sequence

Prompt = str | list[dict]
"""Text, or a conversation: a list of `{"role": ..., "content": ...}` messages."""


def is_conversation(prompt) -> bool:
    return isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                            for m in prompt) and len(prompt) > 0


def prompt_key(prompt: Prompt) -> str | tuple[str, ...]:
    """A hashable stand-in for a prompt (a conversation is a list): equal prompts, equal keys."""
    if isinstance(prompt, str):
        return prompt
    return tuple(json.dumps(message, sort_keys=True) for message in prompt)


def as_conversation(prompt: Prompt, system_prompt: str | None = None) -> list[dict]:
    """The prompt as messages, with the system message first when one is given and none is set."""
    messages = list(prompt) if is_conversation(prompt) else [{"role": "user", "content": prompt}]
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def uses_chat_template(tokenizer, prompts: Sequence[Prompt], chat_template: bool | None) -> bool:
    """Whether these prompts go through the template: always for conversations; for text, when
    the tokenizer has one and `chat_template` is not False."""
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if any(is_conversation(p) for p in prompts):
        if not has_template:
            raise ValueError("conversational prompts need a tokenizer with a chat template; this "
                             "one has none (use text prompts, or a chat model)")
        return True
    if chat_template and not has_template:
        raise ValueError("chat_template=True but the tokenizer has no chat template")
    return has_template and chat_template is not False


def encode_prompts(tokenizer, prompts: Sequence[Prompt], *, system_prompt: str | None = None,
                   chat_template: bool | None = None) -> list[list[int]]:
    """Token ids of each prompt (no padding), as TRL's GRPOTrainer makes them."""
    prompts = list(prompts)
    if not prompts:
        return []
    for p in prompts:
        if not isinstance(p, str) and not is_conversation(p):
            raise TypeError("a prompt is text or a list of {role, content} messages, "
                            f"got {p!r:.80}")
    if not uses_chat_template(tokenizer, prompts, chat_template):
        if system_prompt:
            raise ValueError("system_prompt needs a chat template (this tokenizer has none, or "
                             "chat_template is False)")
        return tokenizer(prompts)["input_ids"]
    conversations = [as_conversation(p, system_prompt) for p in prompts]
    encoded = tokenizer.apply_chat_template(conversations, add_generation_prompt=True,
                                            tokenize=True, return_dict=True)
    return [list(ids) for ids in encoded["input_ids"]]


def render_prompt(tokenizer, prompt: Prompt, **kwargs) -> str:
    """The prompt as the model reads it (for printing sample completions)."""
    return tokenizer.decode(encode_prompts(tokenizer, [prompt], **kwargs)[0])
