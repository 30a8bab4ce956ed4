"""What `grpo-lab serve` says about itself: /server_info's config and /metrics' counters.

`vllm_config` is the body of `GET /server_info`: the parts of vLLM's config that clients read,
plus a `grpo_lab` key (flags, engine and prefix-cache counters). `prometheus_text` is
`GET /metrics` with vLLM's names and labels. Both: docs/serving-api.md, "Endpoints" and
"Prefix caching in grpo-lab serve".
"""

from __future__ import annotations

from dataclasses import asdict

PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

COUNTERS = (  # (name, help as vLLM writes it, where grpo-lab serve counts it)
    ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
     "queries"),
    ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", "hits"),
    ("vllm:prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens"),
    ("vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
     "cached_prompt_tokens"),
    ("vllm:generation_tokens", "Number of generation tokens processed.", "generated_tokens"),
)


def prefix_cache_stats(server) -> dict | None:
    cache = server.engine.prefix_cache
    return cache.stats() if cache is not None else None


def peak_gpu_memory(device: str) -> int | None:
    """Most bytes torch has held on this GPU at once (None on the CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.max_memory_allocated(device)


def vllm_config(server) -> dict:
    cfg = server.config
    lora = None
    if cfg.enable_lora:
        lora = {"max_lora_rank": cfg.max_lora_rank, "max_loras": cfg.max_loras,
                "max_cpu_loras": server.lora.max_cpu_loras if server.lora else None,
                "lora_dtype": "auto", "fully_sharded_loras": False}
    return {
        "model_config": {"model": server.model_path, "served_model_name": server.base_name,
                         "tokenizer": server.model_path, "dtype": str(server.dtype),
                         "max_model_len": server.max_model_len,
                         "max_logprobs": cfg.max_logprobs, "logprobs_mode": cfg.logprobs_mode},
        "cache_config": {"block_size": cfg.block_size,
                         "enable_prefix_caching": cfg.enable_prefix_caching},
        "parallel_config": {"data_parallel_size": 1, "tensor_parallel_size": 1,
                            "pipeline_parallel_size": 1},
        "scheduler_config": {"max_num_seqs": cfg.max_num_seqs,
                             "max_num_batched_tokens": cfg.max_num_batched_tokens,
                             "max_model_len": server.max_model_len},
        "device_config": {"device": server.device},
        "lora_config": lora,
        "grpo_lab": {"engine": dict(server.engine.stats), "paused": server.engine.paused,
                     "prefix_cache": prefix_cache_stats(server),
                     "peak_gpu_memory_bytes": peak_gpu_memory(server.device),
                     **{k: v for k, v in asdict(cfg).items() if k != "api_key"}},
    }


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus_text(server) -> str:
    """The counters above, then grpo_lab's gauge of cached blocks, in Prometheus' text format."""
    counts = dict(server.engine.stats)
    cache = prefix_cache_stats(server)
    counts.update(queries=cache["queries"] if cache else 0, hits=cache["hits"] if cache else 0)
    labels = f'{{model_name="{_label(server.base_name)}",engine="0"}}'
    lines = []
    for name, help_text, key in COUNTERS:
        lines += [f"# HELP {name}_total {help_text}", f"# TYPE {name}_total counter",
                  f"{name}_total{labels} {float(counts[key])}"]
    lines += ["# HELP grpo_lab:prefix_cache_blocks KV blocks held by the prefix cache.",
              "# TYPE grpo_lab:prefix_cache_blocks gauge",
              f"grpo_lab:prefix_cache_blocks{labels} {float(cache['blocks'] if cache else 0)}"]
    return "\n".join(lines) + "\n"
