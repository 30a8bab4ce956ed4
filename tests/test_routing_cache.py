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
        [sys.executable, str(ROOT / "benchmarks" / "routing_cache.py"), "--prompts", "8",
         "--rounds", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    affinity, round_robin = results["runs"]["affinity"], results["runs"]["round-robin"]
    for run in (affinity, round_robin):
        assert run["completions"] == 8 * 8 and run["failed"] == 0
        assert run["prompt_tokens"] == affinity["prompt_tokens"]  # the same requests
    assert affinity["prefill_tokens_computed"] < round_robin["prefill_tokens_computed"]
    assert affinity["prefix_cache_hit_rate"] > round_robin["prefix_cache_hit_rate"]
    # round-robin sends each prompt's 2nd request away from its 1st; affinity rarely (load only)
    assert round_robin["router_first_round"]["spilled"] == 8
    assert affinity["router_first_round"]["spilled"] < 8
