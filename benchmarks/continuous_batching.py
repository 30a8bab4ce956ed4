"""Benchmark continuous batching: tokens/s of `grpo-lab serve` at 64 concurrent requests vs 1,
and vs transformers' batched `generate` on the same model at the same batch size.

    python benchmarks/continuous_batching.py            # ~1-2 min on 2 cores
    python benchmarks/continuous_batching.py --quick    # fewer rounds

The server runs as its own process with one torch thread; the client sends one request per
sequence (n = 1, the tiny model's addition prompts, `max_tokens` tokens each with `ignore_eos`,
so every request costs the same), `concurrency` at a time. `generate` runs in this process, also
with one thread, with the same sampling (T = 1, logprobs from output_scores).

The three measurements are interleaved round by round and the medians compared, so that load
from other processes on a shared machine hits all three alike. CPU seconds (of the server
process; of this process for `generate`) are reported too: tokens per CPU second do not depend
on how much of a core the process got.
Goals: 64 concurrent >= 4x one at a time; >= 0.7x `generate` at batch 64.
Results go to benchmarks/results/continuous_batching.json and are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from grpo_lab.core.generation import sampling_config  # noqa: E402
from grpo_lab.core.models import load_model_and_tokenizer  # noqa: E402
from grpo_lab.core.tasks import make_task  # noqa: E402
from grpo_lab.core.tiny_model import tiny_model_path  # noqa: E402
from grpo_lab.serving.client import InferenceClient  # noqa: E402
from grpo_lab.serving.process import start_server_process  # noqa: E402

GOALS = {"speedup_64_vs_1": 4.0, "vs_generate_at_64": 0.7}


def prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
    task = make_task("addition")
    return [tokenizer(p.prompt)["input_ids"] for p in task.sample_batch(random.Random(seed), count)]


def process_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
    config = sampling_config(tokenizer, max_tokens, temperature=1.0)
    config.min_new_tokens = max_tokens  # the same token count as ignore_eos
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(x)) + x for x in rows])
    mask = (ids != tokenizer.pad_token_id).long()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        torch.stack(out.scores, 1).log_softmax(-1)  # the logprobs, as the server computes
    return (out.sequences.shape[1] - width) * len(rows), time.perf_counter() - start


def summarize(runs: list[tuple[int, float, float]]) -> dict:
    """Per-round (tokens, wall s, cpu s) -> medians of tokens/s and tokens per CPU second."""
    return {"rounds": len(runs), "tokens": sum(r[0] for r in runs),
            "tokens_per_s": round(statistics.median(r[0] / r[1] for r in runs), 1),
            "tokens_per_cpu_s": round(statistics.median(r[0] / max(r[2], 1e-9) for r in runs), 1)}


async def measure(url, pid, model, tokenizer, ids, rounds, concurrency, max_tokens):
    """Interleaved rounds: 1 at a time, `concurrency` at a time, `generate` at that batch."""
    single, batched, generate = [], [], []
    async with InferenceClient(url) as client:
        await client.completions(ids[0], max_tokens=2)  # warm the connection and the engine
        for r in range(rounds):
            chunk = ids[r * 3 * concurrency:(r + 1) * 3 * concurrency]
            cpu = process_cpu_s(pid)
            tokens, seconds = await run_clients(client, chunk[:8], 1, max_tokens)
            single.append((tokens, seconds, process_cpu_s(pid) - cpu))
            cpu = process_cpu_s(pid)
            tokens, seconds = await run_clients(client, chunk[:2 * concurrency], concurrency,
                                                max_tokens)
            batched.append((tokens, seconds, process_cpu_s(pid) - cpu))
            cpu = time.process_time()
            tokens, seconds = run_generate(model, tokenizer, chunk[:concurrency], max_tokens)
            generate.append((tokens, seconds, time.process_time() - cpu))
    return summarize(single), summarize(batched), summarize(generate)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", type=Path,
                        default=Path(__file__).parent / "results" / "continuous_batching.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds = 2 if args.quick else args.rounds

    model, tokenizer = load_model_and_tokenizer(tiny_model_path(progress=False))
    ids = prompts(tokenizer, 3 * args.concurrency * rounds)
    run_generate(model, tokenizer, ids[:8], 4)  # warm-up
    with start_server_process("tiny", logprobs_mode="processed_logprobs") as server:
        single, batched, generate = asyncio.run(measure(
            server.url, server.pid, model, tokenizer, ids, rounds, args.concurrency, args.max_tokens))

    c = args.concurrency
    results = {
        "quick": args.quick, "max_tokens": args.max_tokens, "goals": GOALS,
        "server_1": single, f"server_{c}": batched, f"generate_{c}": generate,
        "speedup_64_vs_1": round(batched["tokens_per_s"] / single["tokens_per_s"], 2),
        "vs_generate_at_64": round(batched["tokens_per_s"] / generate["tokens_per_s"], 2),
        "vs_generate_at_64_per_cpu_s": round(batched["tokens_per_cpu_s"]
                                             / generate["tokens_per_cpu_s"], 2),
    }
    results["goals_met"] = all(results[k] >= v for k, v in GOALS.items())
    print(f"{'':28}{'tokens/s':>10}{'tokens/CPU s':>14}")
    for label, r in (("server, 1 at a time", single), (f"server, {c} concurrent", batched),
                     (f"generate, batch {c}", generate)):
        print(f"{label:28}{r['tokens_per_s']:>10.1f}{r['tokens_per_cpu_s']:>14.1f}")
    print(f"{c} concurrent vs 1: {results['speedup_64_vs_1']}x (goal >= "
          f"{GOALS['speedup_64_vs_1']}x); vs generate: {results['vs_generate_at_64']} (goal >= "
          f"{GOALS['vs_generate_at_64']}; per CPU second {results['vs_generate_at_64_per_cpu_s']})")
    print("goals met:", results["goals_met"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    return 0 if results["goals_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
