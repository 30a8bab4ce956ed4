"""Benchmark synchronous against asynchronous GRPO on this machine, same task, same samples.

    python benchmarks/async_vs_sync.py            # ~2-3 minutes on 2 cores
    python benchmarks/async_vs_sync.py --quick    # fewer steps, one repeat (a smoke run)

Every run trains the same tiny model on the default task (2-digit addition, 16 prompts x 8
samples per step) for the same number of steps, so every run sees the same number of samples.

1. **Pipeline limit.** The synchronous loop with the asynchronous run's thread allocation (one
   torch thread for generation, one for training) gives the per-step generation time G and
   training time T (medians). Overlapping the two can at best turn G + T into max(G, T):
   limit = (G + T) / max(G, T).
2. **Asynchronous speedup at that allocation** = sync wall time / async wall time, and its
   ratio to the limit (goal >= 0.9).
3. **Against the synchronous loop at its own best thread count** (1 or 2 threads for both
   stages, the best of the two): the asynchronous run with the same 1 + 1 threads, and with
   `trainer_idle_threads=2`: the trainer borrows the generator's core for the micro-batches that
   start while the worker is blocked (goal: > 1).
4. **Packing**: forward+backward throughput (real tokens/s: prompt + completion, padding not
   counted) on the same batches, one pass per step vs token-budget micro-batches (sorted, padded)
   vs packed rows with a block-diagonal mask; on the default task and on a batch of mixed lengths.

What we chose and why (measured on the 2-core machine this was written on):
- **1 + 1 threads** for the asynchronous run: one core each, so the two threads never fight for
  a core. A process whose torch threads outnumber its free cores collapses (a 2-thread run
  went from 0.18 to 3.2 s per step while another process held one core); 1 + 1 degrades
  gracefully. Threads of one process still share the GIL: the trainer's step is ~10 % slower
  while the generator thread runs (not at all with the generator in another process, the next
  issue's design), which is most of the gap between the speedup and the limit.
- **Borrowing** (`trainer_idle_threads=2`): on this workload G is ~40 % of T, so 1 + 1 alone
  cannot beat the synchronous loop at 2 threads (max(G1, T1) > G2 + T2). The only headroom is
  the generator's core while it is idle, which the trainer takes for the micro-batches that
  start then. Two micro-batches per step (token budget 768) worked best: smaller ones cost
  more per token and more thread switches than they gain.
- **LoRA merged into the generator's copy** (`LocalGenerator(merge_lora=True)`): G drops ~25 %.

Wall times exclude evaluation. Runs alternate sync and async and repeat, and the best of the
repeats is kept, because other processes on a shared machine slow single runs by 2-3x.
Results go to benchmarks/results/async_vs_sync.json and are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch: threads are set per run below
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from grpo_lab.rollout.async_trainer import AsyncGRPOTrainer  # noqa: E402
from grpo_lab.rollout.config import AsyncGRPOConfig  # noqa: E402
from grpo_lab.train.packing import accumulate_grpo_loss, make_micro_batches  # noqa: E402
from grpo_lab.train.trainer import RolloutBatch, pad_left, pad_right  # noqa: E402

GOALS = {"speedup_over_limit": 0.9, "speedup_over_best_sync": 1.0}
QUIET = 0.1  # a run counts only if other processes used < 10 % of the cores meanwhile
TOKEN_BUDGET = 768  # forward tokens per micro-batch: 64 sequences of ~12 tokens, 2 per step
ROW_TOKENS = 48  # packed row length: 4 sequences of the default task per row


def cpu_busy_s() -> float:
    """CPU seconds every process on the machine has used (all cores), from /proc/stat."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def wait_for_quiet(max_wait_s: float, threshold: float = 0.25) -> float:
    """Wait (up to max_wait_s) until other processes use < threshold of the cores for 1 s.
    Returns the share they used in the last second."""
    deadline = time.monotonic() + max_wait_s
    while True:
        busy, own, start = cpu_busy_s(), own_cpu_s(), time.monotonic()
        time.sleep(1.0)
        others = (cpu_busy_s() - busy - (own_cpu_s() - own)) / (
            (time.monotonic() - start) * (os.cpu_count() or 1))
        if others < threshold or time.monotonic() > deadline:
            return max(others, 0.0)


def run(kind: str, steps: int, seed: int, **overrides) -> dict:
    """One training run; returns its wall time (steps only) and per-step medians."""
    busy, own, started = cpu_busy_s(), own_cpu_s(), time.perf_counter()
    cfg = AsyncGRPOConfig(steps=steps, seed=seed, eval_every=0, eval_size=256, progress=False,
                          log_every=10**6, **overrides)
    trainer = AsyncGRPOTrainer(cfg)
    records = [r for r in trainer.train() if r["step"] > 0]
    history = trainer.accuracy_history
    med = lambda key: statistics.median(r[key] for r in records)  # noqa: E731
    elapsed = time.perf_counter() - started
    others = (cpu_busy_s() - busy - (own_cpu_s() - own)) / (elapsed * (os.cpu_count() or 1))
    return {
        "kind": kind,
        "wall_s": records[-1]["time_s"],
        "G_s": med("perf/generate_s") if "perf/generate_s" in records[0] else None,
        "T_s": med("perf/fwd_bwd_s"),
        "step_s": med("perf/step_s"),
        "rollout_wait_s": med("perf/rollout_wait_s"),
        "staleness_mean": statistics.mean(r["sample/staleness_mean"] for r in records),
        "ratio_max_dev": max(abs(r["ratio"] - 1) for r in records),
        "reward_first10": statistics.mean(r["reward"] for r in records[:10]),
        "reward_last10": statistics.mean(r["reward"] for r in records[-10:]),
        "accuracy_before": history[0][1],
        "accuracy_after": history[-1][1],
        "others_cpu_share": max(others, 0.0),  # other processes' share of the cores meanwhile
        "config": {k: overrides[k] for k in sorted(overrides)},
    }


def throughput(model_batches, model, layout: dict, repeats: int = 3) -> dict:
    """Real tokens per second of forward+backward over the batches with one layout."""
    real = sum(int(b.prompt_mask.sum() + b.completion_mask.sum()) for b in model_batches)
    best = float("inf")
    fwd_tokens = 0
    for _ in range(repeats):
        start = time.perf_counter()
        fwd_tokens = 0
        for batch in model_batches:
            mbs = make_micro_batches(batch, **layout)
            fwd_tokens += sum(mb.input_tokens for mb in mbs)
            accumulate_grpo_loss(model, mbs, temperature=1.0)
            model.zero_grad(set_to_none=True)
        best = min(best, time.perf_counter() - start)
    return {"real_tok_s": real / best, "forward_tokens": fwd_tokens, "real_tokens": real,
            "padding_frac": 1 - real / fwd_tokens}


def packing_benchmark(num_batches: int) -> dict:
    torch.set_num_threads(1)
    trainer = AsyncGRPOTrainer(AsyncGRPOConfig(asynchronous=False, progress=False, seed=1))
    task_batches = []
    for _ in range(num_batches):
        batch, _ = trainer.collate(trainer.produce(trainer.version))
        task_batches.append(batch)
    rng = random.Random(0)  # mixed lengths: prompts 4-30 tokens, completions 1-24

    def mixed_batch():
        prompts = [[1] + [rng.randrange(4, 20) for _ in range(rng.randrange(3, 30))]
                   for _ in range(128)]
        comps = [[rng.randrange(4, 20) for _ in range(rng.randrange(0, 23))] + [2]
                 for _ in range(128)]
        p, pm = pad_left(prompts, 0)
        c, cm = pad_right(comps, 0)
        old, _ = pad_right([[-1.0] * len(x) for x in comps], 0.0)
        return RolloutBatch(p, pm, c, cm, old.float(), torch.zeros(128), torch.randn(128))

    mixed = [mixed_batch() for _ in range(max(2, num_batches // 2))]
    layouts = {
        "one_pass": dict(token_budget=None),
        "token_budget_sorted": dict(token_budget=TOKEN_BUDGET),
        "packed_block_diagonal": dict(token_budget=TOKEN_BUDGET, packed=True,
                                      row_tokens=ROW_TOKENS),
    }
    mixed_layouts = {
        "one_pass": dict(token_budget=None),
        "token_budget_sorted": dict(token_budget=1024),
        "packed_block_diagonal": dict(token_budget=1024, packed=True, row_tokens=64),
    }
    out = {"default_task": {}, "mixed_lengths": {}}
    for name, layout in layouts.items():
        out["default_task"][name] = throughput(task_batches, trainer.model, layout)
    for name, layout in mixed_layouts.items():
        out["mixed_lengths"][name] = throughput(mixed, trainer.model, layout)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps per run")
    parser.add_argument("--repeats", type=int, default=2, help="alternating repeats per config")
    parser.add_argument("--quick", action="store_true", help="20 steps, 1 repeat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--token-budget", type=int, default=TOKEN_BUDGET,
                        help="forward tokens per micro-batch in every training run")
    parser.add_argument("--max-quiet-wait-s", type=float, default=60.0,
                        help="before each run, wait up to this long for other processes to idle")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "async_vs_sync.json"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 20, 1
    # Every run micro-batches the same way (token budget), so only the pipeline differs.
    one = dict(generator_threads=1, trainer_threads=1, token_budget=args.token_budget)
    configs = {  # name -> AsyncGRPOConfig overrides
        "sync_1_thread": dict(asynchronous=False, **one),
        "async_1+1": dict(asynchronous=True, max_staleness=1, **one),
        "sync_2_threads": dict(asynchronous=False, generator_threads=2, trainer_threads=2,
                               token_budget=args.token_budget),
        "async_1+1_borrow": dict(asynchronous=True, max_staleness=1, trainer_idle_threads=2,
                                 **one),
    }
    started = time.perf_counter()
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for repeat in range(args.repeats):
        for name, overrides in configs.items():
            wait_for_quiet(args.max_quiet_wait_s)
            result = run(name, args.steps, args.seed, **overrides)
            runs[name].append(result)
            print(f"[repeat {repeat + 1}] {name:18s} wall {result['wall_s']:6.2f}s  "
                  f"T {result['T_s']:.3f}s  G {result['G_s'] or 0:.3f}s  "
                  f"acc {result['accuracy_before']:.3f}->{result['accuracy_after']:.3f}  "
                  f"others {result['others_cpu_share']:.0%} CPU",
                  flush=True)
    # Best of the repeats, among those that ran while other processes stayed off the cores.
    clean = {name: [r for r in rs if r["others_cpu_share"] < QUIET] or rs
             for name, rs in runs.items()}
    best = {name: min(rs, key=lambda r: r["wall_s"]) for name, rs in clean.items()}
    disturbed = sorted(name for name, r in best.items() if r["others_cpu_share"] >= QUIET)
    if disturbed:
        print(f"WARNING: every run of {disturbed} shared the cores with other processes; "
              "their numbers are not this machine's", flush=True)

    sync1, async1 = best["sync_1_thread"], best["async_1+1"]
    G, T = sync1["G_s"], sync1["T_s"]
    limit = (G + T) / max(G, T)
    speedup = sync1["wall_s"] / async1["wall_s"]
    best_sync_name = min(("sync_1_thread", "sync_2_threads"), key=lambda n: best[n]["wall_s"])
    best_sync = best[best_sync_name]
    borrow = best["async_1+1_borrow"]
    summary = {
        "steps": args.steps,
        "samples": args.steps * 16 * 8,
        "G_s": G,
        "T_s": T,
        "pipeline_limit": limit,
        "async_speedup_same_allocation": speedup,
        "speedup_over_limit": speedup / limit,
        "best_sync": best_sync_name,
        "async_speedup_over_best_sync": best_sync["wall_s"] / async1["wall_s"],
        "async_borrow_speedup_over_best_sync": best_sync["wall_s"] / borrow["wall_s"],
        "async_borrow_speedup_same_allocation": sync1["wall_s"] / borrow["wall_s"],
        # Same samples: greedy accuracy gain (eval_size 256) of the 1 + 1 runs.
        "accuracy_gain_sync": sync1["accuracy_after"] - sync1["accuracy_before"],
        "accuracy_gain_async": async1["accuracy_after"] - async1["accuracy_before"],
    }
    print(f"\nG = {G:.3f} s, T = {T:.3f} s per step (sync, 1 + 1 threads): "
          f"limit (G+T)/max(G,T) = {limit:.3f}")
    print(f"async speedup at 1 + 1 threads: {speedup:.3f}  "
          f"speedup / limit = {speedup / limit:.3f} (goal >= {GOALS['speedup_over_limit']})")
    print(f"best sync: {best_sync_name} ({best_sync['wall_s']:.2f} s); "
          f"async 1 + 1 over it: {summary['async_speedup_over_best_sync']:.3f}; "
          f"async 1 + 1 borrowing idle core: {summary['async_borrow_speedup_over_best_sync']:.3f} "
          f"(goal > {GOALS['speedup_over_best_sync']})")

    print(f"accuracy gain with the same {summary['samples']} samples: sync "
          f"{summary['accuracy_gain_sync']:+.3f}, async {summary['accuracy_gain_async']:+.3f}")

    packing = packing_benchmark(num_batches=4 if args.quick else 8)
    for workload, layouts in packing.items():
        base = layouts["one_pass"]["real_tok_s"]
        for name, r in layouts.items():
            print(f"packing [{workload}] {name:22s} {r['real_tok_s']:8.0f} real tok/s "
                  f"(x{r['real_tok_s'] / base:.2f}), padding {r['padding_frac']:.1%}")
    summary["disturbed_runs"] = disturbed
    result = {"summary": summary, "goals": GOALS, "best_runs": best, "all_runs": runs,
              "packing": packing, "threads": {"cpu_count": os.cpu_count()},
              "benchmark_s": time.perf_counter() - started}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} in {result['benchmark_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
