"""benchmarks/routing_cache.py in a small configuration: two chat-model replicas with prefix
caches behind the proxy, the same G = 8 requests per prompt routed by KV affinity and round-robin.
Affinity must compute fewer prefill tokens and hit the prefix caches more often: outcomes that
fail if the router, the caches or their counters stop working together."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_affinity_computes_fewer_prefill_tokens_than_round_robin(chat_model_dir, tmp_path):
    out = tmp_path / "routing_cache.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "routing_cache.py"), "--workloads", "chat",
         "--replicas", "2", "--prompts", "8", "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (results,) = json.loads(out.read_text())["configurations"]
    affinity, round_robin = results["runs"]["affinity"], results["runs"]["round-robin"]
    for run in (affinity, round_robin):
        assert run["completions"] == 8 * 8 and run["failed"] == 0
        assert run["prompt_tokens"] == affinity["prompt_tokens"]  # the same requests
    assert affinity["prefill_tokens_computed"] < round_robin["prefill_tokens_computed"]
    assert affinity["prefix_cache_hit_rate"] > round_robin["prefix_cache_hit_rate"]
    # round-robin sends each prompt's 2nd request away from its 1st; affinity rarely (load only)
    assert round_robin["router_first_round"]["spilled"] == 8
    assert affinity["router_first_round"]["spilled"] < 8
    # what the replicas computed is close to the count of a one-request-at-a-time cache fill
    for routing, run in results["runs"].items():
        predicted = results["predicted_prefill_tokens"][routing]
        assert abs(run["prefill_tokens_computed"] - predicted) <= 0.15 * predicted, routing


def test_predicted_prefill_tokens_counts_blocks_per_replica():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from routing_cache import predicted_prefill_tokens
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    # 2 prompts of 10 tokens, blocks of 4: block 1 shared, block 2 their own, 2-token tails
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 15, 16, 17, 18, 19, 20]]
    # affinity, 2 replicas: each prompt computes 10 once, then 2 per request (3 more requests)
    assert predicted_prefill_tokens(prompts, "affinity", 2, 4, block_size=4) == 2 * (10 + 3 * 2)
    # round-robin: each prompt's first request on each replica computes what that replica lacks
    # (replica 0: 10, then 6 for prompt 2; replica 1: 10, then 6), the rest 2 each
    assert predicted_prefill_tokens(prompts, "round-robin", 2, 4, block_size=4) == 32 + 4 * 2
    # a 9-token prompt keeps its last token to compute: 2 full blocks usable, 1 computed
    assert predicted_prefill_tokens([list(range(9))], "affinity", 2, 3, block_size=4) == 9 + 2
