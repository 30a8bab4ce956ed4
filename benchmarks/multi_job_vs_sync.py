"""Benchmark synchronous GRPO in one process against the multi-job asynchronous run.

    python benchmarks/multi_job_vs_sync.py            # ~5 minutes on 2 cores
    python benchmarks/multi_job_vs_sync.py --quick    # fewer steps (a smoke run)

Same task (2-digit addition), same samples (steps x 16 prompts x 8 completions), same machine,
one run of this script; the configurations run one after the other, alternating, so each has
the machine to itself:

1. **Synchronous, one process** (`AsyncGRPOConfig(asynchronous=False)`: generate, then train, in
   one thread), at 1 and at 2 torch threads. Its own per-step medians give the generation time
   G and the rest of the step T (training, weight sync, collating); overlapping the two can at
   best turn G + T into max(G, T): **pipeline limit = (G + T) / max(G, T)**.
2. **Multi-job** (`grpo-lab demo --jobs local`'s code, grpo_lab.cli.multi_job): the trainer,
   the proxy and 1 or 2 replicas, each its own OS process, adapters through a bucket folder,
   rollouts over HTTP on loopback.

How the cores are shared (2 here): the synchronous run has the machine to itself, with 1 or 2
torch threads. In the multi-job run every process has one torch thread (OMP_NUM_THREADS=1):
with one replica the trainer and the replica each have a core, and the proxy (every completion
passes through it) and this script (it reads the trainer's metrics every 0.5 s) take a little of
them; with two replicas three torch threads share two cores.

Reported: training wall time (first step to last, from the trainer's own `time_s`: no
evaluation, no start-up; the replicas' and proxy's start-up is reported apart, the trainer
process's own start-up and evaluations only in `total_wall_s`), samples/s, the speedup over
each synchronous run, and its ratio to the pipeline limit computed from that synchronous run's
own G and T; reward over the first and last 20 steps and greedy accuracy before and after show
that both kinds of run learn alike from the same samples. The best of `--repeats` is kept for
each configuration (other processes on a shared machine slow single runs).
Results go to benchmarks/results/multi_job_vs_sync.json and are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from grpo_lab.cli.multi_job import run_multi_job_demo  # noqa: E402
from grpo_lab.train.async_config import AsyncGRPOConfig  # noqa: E402
from grpo_lab.train.async_trainer import AsyncGRPOTrainer  # noqa: E402
from grpo_lab.watch.metrics import read_metrics  # noqa: E402

PROMPTS, GENERATIONS = 16, 8


def median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records)


def sync_run(steps: int, threads: int, seed: int, eval_size: int = 256) -> dict:
    """Generate then train in one thread of this process; per-step G and T from its metrics."""
    config = AsyncGRPOConfig(steps=steps, seed=seed, asynchronous=False, eval_every=0,
                             eval_size=eval_size, progress=False, log_every=10 ** 6,
                             generator_threads=threads, trainer_threads=threads)
    trainer = AsyncGRPOTrainer(config)
    records = [r for r in trainer.train() if r["step"] > 0]
    history = trainer.accuracy_history
    G = median(records, "perf/generate_s")
    T = median(records, "perf/step_s") - G  # everything else: collate, fwd+bwd, weight sync
    wall = records[-1]["time_s"]
    return {"kind": f"sync, 1 process, {threads} thread{'s' * (threads > 1)}",
            "threads": threads, "wall_s": wall,
            "samples_per_s": steps * PROMPTS * GENERATIONS / wall,
            "G_s": G, "T_s": T, "step_s": median(records, "perf/step_s"),
            "pipeline_limit": (G + T) / max(G, T),
            "accuracy_before": history[0][1], "accuracy_after": history[-1][1],
            **reward_trend(records)}


def multi_job_run(steps: int, replicas: int, seed: int, eval_size: int = 256) -> dict:
    """The main job's processes; training time from the trainer's own metrics."""
    with tempfile.TemporaryDirectory(prefix="bench-multi-job-") as tmp:
        config = AsyncGRPOConfig(steps=steps, seed=seed, eval_every=0, eval_size=eval_size,
                                 progress=False, max_staleness=1, output_dir=tmp)
        with contextlib.redirect_stdout(io.StringIO()):  # the demo's summary table
            summary = run_multi_job_demo(config, replicas=replicas, min_gain=0.0, timeout_s=900)
        records = [r for r in read_metrics(Path(tmp) / "bucket" / "train") if r.get("step", 0) > 0]
    wall = records[-1]["time_s"]
    return {"kind": f"multi-job: trainer + proxy + {replicas} replica{'s' * (replicas > 1)}",
            "replicas": replicas, "wall_s": wall,
            "samples_per_s": steps * PROMPTS * GENERATIONS / wall,
            "step_s": median(records, "perf/step_s"),
            "rollout_wait_s": median(records, "perf/rollout_wait_s"),
            "fwd_bwd_s": median(records, "perf/fwd_bwd_s"),
            "weight_sync_s": median(records, "perf/weight_sync_s"),
            "staleness_mean": statistics.fmean(r["sample/staleness_mean"] for r in records),
            "startup_s": summary["startup_s"], "total_wall_s": summary["wall_s"],
            "accuracy_before": summary["accuracy_before"],
            "accuracy_after": summary["accuracy_after"], **reward_trend(records)}


def reward_trend(records: list[dict]) -> dict:
    """Mean reward of the first and last 20 steps: both kinds of run must learn alike."""
    return {"reward_first20": statistics.fmean(r["reward"] for r in records[:20]),
            "reward_last20": statistics.fmean(r["reward"] for r in records[-20:])}


def best(runs: list[dict]) -> dict:
    return min(runs, key=lambda r: r["wall_s"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--eval-size", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="30 steps, one repeat")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" /
                                             "multi_job_vs_sync.json"))
    args = parser.parse_args(argv)
    steps, repeats = (30, 1) if args.quick else (args.steps, args.repeats)

    runs: dict[str, list[dict]] = {}
    for repeat in range(repeats):  # alternate the configurations: drift hits all of them
        for name, make in (("sync1", lambda: sync_run(steps, 1, args.seed, args.eval_size)),
                           ("sync2", lambda: sync_run(steps, 2, args.seed, args.eval_size)),
                           ("jobs1", lambda: multi_job_run(steps, 1, args.seed, args.eval_size)),
                           ("jobs2", lambda: multi_job_run(steps, 2, args.seed, args.eval_size))):
            result = make()
            runs.setdefault(name, []).append(result)
            print(f"[{repeat + 1}/{repeats}] {result['kind']}: {result['wall_s']:.1f} s, "
                  f"{result['samples_per_s']:.0f} samples/s", file=sys.stderr, flush=True)
    kept = {name: best(rs) for name, rs in runs.items()}
    comparisons = {}
    for jobs in ("jobs1", "jobs2"):
        for sync in ("sync1", "sync2"):
            speedup = kept[sync]["wall_s"] / kept[jobs]["wall_s"]
            comparisons[f"{jobs}_vs_{sync}"] = {
                "speedup": speedup, "pipeline_limit": kept[sync]["pipeline_limit"],
                "speedup_over_limit": speedup / kept[sync]["pipeline_limit"]}
    result = {
        "machine": {"cpus": os.cpu_count(), "omp_num_threads": os.environ["OMP_NUM_THREADS"]},
        "steps": steps, "samples": steps * PROMPTS * GENERATIONS, "repeats": repeats,
        "cores": "sync: the whole machine, 1 or 2 torch threads in one process; multi-job: one "
                 "torch thread per process (trainer, each replica), the proxy beside them, all "
                 "on the same 2 cores",
        "runs": kept, "all_runs": runs, "comparisons": comparisons,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))

    print(f"\n{steps} steps x {PROMPTS} prompts x {GENERATIONS} samples = "
          f"{result['samples']} samples per run, best of {repeats}")
    print(f"{'run':<44} {'wall s':>7} {'samples/s':>10} {'G s':>6} {'T s':>6} {'limit':>6} "
          f"{'reward first/last 20 steps':>27} {'accuracy':>15}")
    for r in kept.values():
        g, t, lim = (f"{r[k]:.3f}" if k in r else "" for k in ("G_s", "T_s", "pipeline_limit"))
        print(f"{r['kind']:<44} {r['wall_s']:>7.1f} {r['samples_per_s']:>10.0f} {g:>6} {t:>6} "
              f"{lim:>6} {r['reward_first20']:>13.3f} / {r['reward_last20']:.3f} "
              f"{r['accuracy_before']:>7.1%} -> {r['accuracy_after']:.1%}")
    print()
    for name, c in comparisons.items():
        print(f"{name:<16} speedup {c['speedup']:.3f}  limit {c['pipeline_limit']:.3f}  "
              f"speedup / limit {c['speedup_over_limit']:.3f}")
    for jobs in ("jobs1", "jobs2"):
        r = kept[jobs]
        print(f"{r['kind']}: start-up {r['startup_s']:.0f} s (not in wall), "
              f"step {r['step_s']:.3f} s = fwd+bwd {r['fwd_bwd_s']:.3f} + wait "
              f"{r['rollout_wait_s']:.3f} + sync {r['weight_sync_s']:.3f} (medians), "
              f"staleness {r['staleness_mean']:.2f}")
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
