"""Counters read from live servers: the proxy's router (`GET /proxy/stats`) and the replicas'
prefix caches (Prometheus `GET /metrics`, as `grpo-lab serve` and `vllm serve` write it).

The dashboard shows them, `grpo-lab demo` summarizes them, notebook 06 compares routings with them.
"""

from __future__ import annotations

import json
import urllib.request


def proxy_stats(url: str, token: str | None = None, timeout_s: float = 2.0) -> dict:
    """The proxy's router counters (`GET <url>/proxy/stats`), for `Dashboard(stats=...)`."""
    request = urllib.request.Request(url.rstrip("/") + "/proxy/stats")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


PREFIX_CACHE_METRICS = {"vllm:prefix_cache_queries_total": "cache_queries",
                        "vllm:prefix_cache_hits_total": "cache_hits"}
"""vLLM's prefix-cache counters (in prompt tokens), as `grpo-lab serve` and `vllm serve` write
them in `GET /metrics`."""


def replica_cache_stats(urls: list[str], token: str | None = None,
                        timeout_s: float = 2.0) -> dict:
    """Prefix-cache counters summed over the replicas, read from each one's Prometheus
    `/metrics`: queried and hit tokens, and the hit rate (hits / queries; None before any
    query). The proxy routes by prefix so that this rate is high. A replica that does not
    answer (it died, or is not up yet) is listed under `unreachable` and counts nothing."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = dict.fromkeys(PREFIX_CACHE_METRICS.values(), 0.0)
    unreachable = []
    for url in urls:
        request = urllib.request.Request(url.rstrip("/") + "/metrics")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                text = response.read().decode()
        except OSError:  # refused, reset, timed out, or an HTTP error status
            unreachable.append(url)
            continue
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in PREFIX_CACHE_METRICS:
                    totals[PREFIX_CACHE_METRICS[sample.name]] += sample.value
    queries = totals["cache_queries"]
    return {**totals, "cache_hit_rate": totals["cache_hits"] / queries if queries else None,
            "unreachable": unreachable}


def router_counters(stats: dict) -> dict:
    """affinity / spilled / unmatched / routed, at the top level or under `router`, and the
    replicas' prefix-cache hit rate when the stats carry it (`replica_cache_stats`)."""
    source = stats.get("router", stats) if isinstance(stats.get("router"), dict) else stats
    counters = {k: source[k] for k in ("affinity", "spilled", "unmatched", "routed")
                if k in source}
    if stats.get("cache_hit_rate") is not None:
        counters["cache_hit_rate"] = round(stats["cache_hit_rate"], 3)
    return counters
