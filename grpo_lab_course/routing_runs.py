"""Affinity routing against round-robin on live replicas: the same requests, counted by the caches.

    run = routing_run(replica_urls, "tiny", prompts, routing="round-robin", group_size=8)
    run["prefix_cache_hit_rate"], run["prefill_tokens_computed"], run["completions_per_s"]

Each run starts cold (a fresh proxy, every prefix cache reset) and sends the blog's request
shape; the replicas' own prefix-cache counters say what it saved (notebook 06,
benchmarks/routing_cache.py; docs/internals.md, "Affinity against round-robin").
"""

from __future__ import annotations

import asyncio
import os
import time

from grpo_lab.proxy.config import start_proxy_process
from grpo_lab.serve.block_hashes import DEFAULT_BLOCK_SIZE
from grpo_lab.serve.client import BlockingClient, InferenceClient, ServerError
from grpo_lab.watch.live_stats import proxy_stats, replica_cache_stats

ROUTINGS = ("affinity", "round-robin")
"""The proxy's `--routing` choices, in the order notebook 06 shows them."""


async def _send_groups(client: InferenceClient, model: str, prompts: list[list[int]],
                       group_size: int, max_tokens: int, max_inflight: int) -> tuple[float, int]:
    slots = asyncio.Semaphore(max_inflight)
    failed = 0

    async def one(prompt: list[int], seed: int) -> None:
        nonlocal failed
        try:
            await client.completions(prompt, model=model, max_tokens=max_tokens,
                                     temperature=1.0, seed=seed)
        except ServerError:
            failed += 1
        finally:
            slots.release()

    tasks = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        for g in range(group_size):  # G requests of n = 1: the router sees the prompt G times
            await slots.acquire()  # TRL's cap: a new request only when one has ended
            tasks.append(asyncio.create_task(one(prompt, i * group_size + g)))
    await asyncio.gather(*tasks)
    return time.perf_counter() - start, failed


def send_groups(url: str, model: str, prompts: list[list[int]], *, group_size: int = 8,
                max_tokens: int = 16, max_inflight: int = 32) -> tuple[float, int]:
    """Send every prompt as `group_size` requests of n = 1, in order, at most `max_inflight` at
    once -> (seconds from the first request to the last answer, requests that failed).
    Runs its own event loop in a thread, so it works in a notebook as in a script."""
    if group_size < 1 or max_inflight < 1 or max_tokens < 1:
        raise ValueError(f"group_size, max_inflight and max_tokens must be >= 1 (got "
                         f"{group_size}, {max_inflight}, {max_tokens})")
    with BlockingClient(url, timeout_s=600.0) as client:
        return client.call(_send_groups(client.client, model, prompts, group_size, max_tokens,
                                        max_inflight))


def cache_counters(replica_urls: list[str]) -> dict:
    """The replicas' prefix-cache counters, summed; an unreachable replica is an error here (a
    comparison with a replica missing would be wrong, not smaller)."""
    stats = replica_cache_stats(replica_urls, timeout_s=10.0)
    if stats["unreachable"]:
        raise RuntimeError(f"replicas did not answer /metrics: {stats['unreachable']}")
    return stats


def routing_run(replica_urls: list[str], model: str, prompts: list[list[int]], *,
                routing: str, group_size: int = 8, max_tokens: int = 16, max_inflight: int = 32,
                block_size: int = DEFAULT_BLOCK_SIZE,
                log_path: str | os.PathLike | None = None) -> dict:
    """One cold run of the same traffic through a new proxy with `routing` (docs/internals.md,
    "Affinity against round-robin")."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {ROUTINGS} (got {routing!r})")
    if not prompts:
        raise ValueError("no prompts to send")
    with start_proxy_process(replica_urls, routing=routing, block_size=block_size,
                             stats_every_s=0, log_path=log_path,
                             env={"OMP_NUM_THREADS": "1"}) as proxy:
        with BlockingClient(proxy.url) as client:
            client.request("POST", "/reset_prefix_cache")  # broadcast: every replica starts cold
            before = cache_counters(replica_urls)
            seconds, failed = send_groups(proxy.url, model, prompts, group_size=group_size,
                                          max_tokens=max_tokens, max_inflight=max_inflight)
            after = cache_counters(replica_urls)
            router = proxy_stats(proxy.url)
    queried = int(after["cache_queries"] - before["cache_queries"])
    cached = int(after["cache_hits"] - before["cache_hits"])
    completions = len(prompts) * group_size
    return {
        "routing": routing,
        "seconds": round(seconds, 2),
        "completions": completions,
        "failed": failed,
        "completions_per_s": round(completions / seconds, 2),
        "prompt_tokens": queried,
        "cached_prompt_tokens": cached,
        "prefill_tokens_computed": queried - cached,
        "prefix_cache_hit_rate": round(cached / queried, 4) if queried else 0.0,
        "router": {k: router[k] for k in ("routed", "affinity", "spilled", "unmatched",
                                          "cached_everywhere")},
    }
