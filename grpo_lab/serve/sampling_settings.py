"""The sampling settings a run sends to inference servers, beside `temperature` and the length cap.

    GRPOConfig(top_p=0.95, top_k=20, min_p=None, repetition_penalty=1.0,
               stop_token_ids=[151645], stop=None)

TRL's names and defaults (untruncated sampling), checked as vLLM checks them
(grpo_lab.serve.protocol). `HTTPGenerator` puts them in every /v1/completions request
(grpo_lab.rollout.http_generator's `request_body`); the in-process samplers sample the whole
distribution at `temperature`. Off the defaults the sampler's logprobs are no longer
log_softmax(logits / T), the trainer's (docs/serving-api.md, "POST /v1/completions").
"""

from __future__ import annotations

import ast

SAMPLING_FIELDS = ("top_p", "top_k", "min_p", "repetition_penalty", "stop", "stop_token_ids")
"""The config's fields that a request carries as they are (vLLM's and TRL's names)."""


def sampling_settings(config) -> dict:
    """A config's sampling settings by name, for `HTTPGenerator(sampling=...)`."""
    return {name: getattr(config, name) for name in SAMPLING_FIELDS}


def truncates_sampling(config) -> bool:
    """Whether top_p, top_k, min_p or repetition_penalty change the distribution sampled from."""
    return (config.top_p < 1 or config.top_k > 0 or bool(config.min_p)
            or config.repetition_penalty != 1)


def token_id_list(value) -> list[int] | None:
    """stop_token_ids as a config takes them (`"1,2"`, `"[1, 2]"`, [1, 2] or None) -> [1, 2],
    or None when there are none."""
    if value is None:
        return None
    items = value.strip().strip("[]").split(",") if isinstance(value, str) else value
    ids = []
    for item in items if isinstance(items, list | tuple) else [items]:
        if isinstance(item, str) and item.strip().lstrip("-").isdigit():
            item = int(item)
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise ValueError(f"stop_token_ids {value!r}: write token ids (integers >= 0) "
                             "separated by commas, or a list of them")
        ids.append(item)
    return ids or None


def stop_list(value) -> list | None:
    """`stop` as a config takes it: one string, a list of them, or on the command line a Python
    list literal (`['</answer>', '###']`, what grpo_lab.util.argv's `flag_args` writes for a
    list) -> a list, or None when there are none."""
    if isinstance(value, str) and value.strip().startswith("["):
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            parsed = None
        value = parsed if isinstance(parsed, list) else value
    if isinstance(value, str):
        return [value]
    if isinstance(value, list | tuple):
        return list(value) or None
    return value  # None, or something `sampling_problems` reports


def sampling_problems(config) -> list[str]:
    """What is wrong with a config's sampling settings; makes stop_token_ids and stop lists."""
    problems = []
    if not 0 < config.top_p <= 1:
        problems.append(f"top_p must be in (0, 1] (got {config.top_p})")
    if config.top_k < -1:
        problems.append(f"top_k must be 0 or -1 (off), or at least 1 (got {config.top_k})")
    if config.min_p is not None and not 0 <= config.min_p <= 1:
        problems.append(f"min_p must be in [0, 1] or None (got {config.min_p})")
    if config.repetition_penalty <= 0:
        problems.append(f"repetition_penalty must be > 0 (got {config.repetition_penalty})")
    try:
        config.stop_token_ids = token_id_list(config.stop_token_ids)
    except ValueError as exc:
        problems.append(str(exc))
    config.stop = stop_list(config.stop)
    if config.stop is not None and not (isinstance(config.stop, list)
                                        and all(isinstance(s, str) and s for s in config.stop)):
        problems.append(f"stop must be a non-empty string or a list of them (got "
                        f"{config.stop!r})")
    return problems
