"""Benchmark the reason for the proxy: KV-affinity routing against round-robin, prefix caches on.

    python benchmarks/routing_cache.py                 # ~1.5 minutes on 2 cores
    python benchmarks/routing_cache.py --prompts 8 --rounds 1   # the test's configuration

What runs, each in its own process with one torch thread: two `grpo-lab serve` replicas of the
offline chat model (prefix caching on, as by default) and `grpo-lab proxy` in front of them,
started with `--routing affinity` and with `--routing round-robin` in turn (3 rounds of each,
alternating which goes first). Each run is `grpo_lab.observe.routing_runs.routing_run` (notebook
06 runs it on the tiny model): a fresh proxy, both replicas' prefix caches flushed through it
(`POST /reset_prefix_cache`), so each run starts cold with the same requests. Token counts are
summed over the rounds; completions per second is the median round.

The workload is the blog's request shape: each prompt is sent as G = 8 requests of n = 1 (as
TRL's rollout worker does), prompt after prompt, with a bounded number in flight. Prompts are
chat-templated word problems (the system prompt is a shared prefix), sent as token ids.

What is measured per routing, from the replicas' own counters (their Prometheus `/metrics`,
vLLM's `vllm:prefix_cache_queries_total` and `_hits_total`, summed):
- prefill tokens computed = prompt tokens - prompt tokens read from the prefix cache;
- prefix-cache hit rate = hit tokens / queried tokens;
- completions per second, end to end through the proxy;
and the ratios affinity / round-robin.

Why the prefill ratio cannot reach 1/2 with 2 replicas: a prompt's own full blocks (U tokens)
are computed once per replica that sees the prompt, and the partial block at its end (t tokens,
never cached) by every request. Affinity computes U + G*t per prompt, round-robin 2U + G*t, so
the ratio is above 1/2 and tends to it only as t/U shrinks. These prompts are ~41 tokens: one
template block, one block of their own, ~9 tokens uncached at the end.
Results go to benchmarks/results/routing_cache.json and are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

from grpo_lab.observe.routing_runs import ROUTINGS, routing_run, send_groups

GOALS = {"prefill_ratio_max": 0.5}


def make_prompts(n_prompts: int) -> tuple[str, list[list[int]]]:
    """(model path, token ids of the first `n_prompts` training word problems, chat-templated)."""
    from transformers import AutoTokenizer

    from grpo_lab.core.chat_model import SYSTEM_PROMPT, chat_model_path
    from grpo_lab.core.prompts import encode_prompts

    path = chat_model_path(progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with open(path / "data" / "train.jsonl") as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(n_prompts), f)]
    return str(path), encode_prompts(tokenizer, questions, system_prompt=SYSTEM_PROMPT)


def summarize(results: list[dict]) -> dict:
    """Token counts summed over the rounds, completions per second their median."""
    total = {k: sum(r[k] for r in results)
             for k in ("completions", "failed", "prompt_tokens", "cached_prompt_tokens",
                       "prefill_tokens_computed")}
    queries = total["prompt_tokens"]  # every prompt token is looked up in the prefix cache
    return {**total,
            "prefix_cache_hit_rate": round(total["cached_prompt_tokens"] / queries, 4)
            if queries else 0.0,
            "completions_per_s": statistics.median(r["completions_per_s"] for r in results),
            "completions_per_s_rounds": [r["completions_per_s"] for r in results],
            "router_first_round": results[0]["router"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=48, help="word problems sent")
    parser.add_argument("--group-size", type=int, default=8, help="G: requests of n=1 per prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-inflight", type=int, default=32, help="requests in flight at most")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each routing")
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "routing_cache.json")
    args = parser.parse_args(argv)

    import tempfile

    from grpo_lab.serving.client import BlockingClient
    from grpo_lab.serving.process import start_server_process

    model_path, prompts = make_prompts(args.prompts)
    log_dir = Path(tempfile.mkdtemp(prefix="routing-cache-"))
    replicas = []
    try:
        for k in range(2):
            replicas.append(start_server_process(model_path, num_threads=1, dev_mode=True,
                                                 log_path=log_dir / f"replica{k}.log"))
        urls = [r.url for r in replicas]
        with BlockingClient(urls[0]) as client:
            model = client.models()[0]["id"]
        for url in urls:  # first forward passes are slow: keep them out of the timing
            send_groups(url, model, prompts[:1], group_size=2, max_tokens=args.max_tokens,
                        max_inflight=2)
        rounds = {routing: [] for routing in ROUTINGS}
        for r in range(args.rounds):  # alternate which routing goes first
            for routing in ROUTINGS if r % 2 == 0 else ROUTINGS[::-1]:
                rounds[routing].append(routing_run(
                    urls, model, prompts, routing=routing, group_size=args.group_size,
                    max_tokens=args.max_tokens, max_inflight=args.max_inflight,
                    log_path=log_dir / f"proxy-{routing}.log"))
                print(f"round {r + 1} {routing}: " + json.dumps(rounds[routing][-1]))
    finally:
        for replica in replicas:
            replica.stop()

    runs = {routing: summarize(results) for routing, results in rounds.items()}
    aff, rr = runs["affinity"], runs["round-robin"]
    prefill_ratio = round(aff["prefill_tokens_computed"] / rr["prefill_tokens_computed"], 3)
    results = {
        "what": "2 grpo-lab serve replicas of the chat model (prefix caching on) behind grpo-lab "
                "proxy, --routing affinity vs round-robin, same requests, caches flushed between",
        "machine": {"cpus": os.cpu_count(), "loadavg_after": [round(x, 2)
                                                              for x in os.getloadavg()]},
        "workload": {"prompts": args.prompts, "group_size": args.group_size,
                     "requests": args.prompts * args.group_size, "max_tokens": args.max_tokens,
                     "max_inflight": args.max_inflight,
                     "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1)},
        "rounds": args.rounds,
        "runs": runs,
        "ratios_affinity_over_round_robin": {
            "prefill_tokens_computed": prefill_ratio,
            "prefix_cache_hit_rate": round(aff["prefix_cache_hit_rate"]
                                           / rr["prefix_cache_hit_rate"], 3),
            "completions_per_s": round(aff["completions_per_s"] / rr["completions_per_s"], 3),
        },
        "goals": {"prefill ratio <= 0.5": prefill_ratio <= GOALS["prefill_ratio_max"],
                  "affinity faster end to end":
                      aff["completions_per_s"] > rr["completions_per_s"]},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results["ratios_affinity_over_round_robin"], indent=2))
    print(json.dumps(results["goals"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
