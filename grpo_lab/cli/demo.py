"""`grpo-lab demo`: the main job, GRPO on the tiny offline model with a summary.

`--jobs local` (the default, `make demo`) runs the recipe's separate jobs: grpo_lab.cli.multi_job.
`--jobs none` (`run_demo`) runs the same budget as synchronous LoRA GRPO in one process: build or
load the tiny model, train a rank-1 adapter, and leave a run folder with the metrics, the
adapter, a plot and a summary.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

from ..train.async_config import AsyncGRPOConfig
from ..train.config import GRPOConfig
from .flags import add_config_flags, config_from_args
from .multi_job import DEFAULT_MIN_GAIN


def add_parser(sub) -> None:
    demo = sub.add_parser("demo",
                          help="the main job: GRPO on the tiny offline model, with a summary")
    demo.add_argument("--min-gain", type=float, default=None,
                      help="exit with status 1 unless greedy accuracy rises by this much "
                      "(e.g. 0.2); "
                      f"the summary reports against it (default {DEFAULT_MIN_GAIN:g})")
    demo.add_argument("--jobs", choices=("none", "local"), default="local",
                      help="local: the recipe's jobs (a trainer, replicas, the proxy, a bucket "
                      "folder) as local processes; none: synchronous GRPO in this process")
    demo.add_argument("--replicas", type=int, default=2, help="inference replicas (--jobs local)")
    demo.add_argument("--engine", choices=("grpo-lab", "vllm"), default="grpo-lab",
                      help="the replicas' server (--jobs local): grpo-lab (`grpo-lab serve`) or "
                      "vllm (real vLLM; its CPU build on a CPU, `make vllm`)")
    add_config_flags(demo, AsyncGRPOConfig, defaults={"log_every": 20, "output_dir": None})
    demo.set_defaults(func=run)


def run(args) -> int:
    """Run the demo as local jobs or in this process; 1 if the gain misses `--min-gain`."""
    min_gain = DEFAULT_MIN_GAIN if args.min_gain is None else args.min_gain
    if args.output_dir is None:  # named now: `--report-to` names the run after it
        args.output_dir = default_run_dir(args.jobs)
    if args.jobs == "local":
        from .multi_job import multi_job_config, run_multi_job_demo  # the jobs, not the trainer

        summary = run_multi_job_demo(multi_job_config(args), replicas=args.replicas,
                                     min_gain=min_gain, engine=args.engine)
    else:
        summary = run_demo(config_from_args(args), min_gain=min_gain)
    if args.min_gain is not None and summary["accuracy_gain"] < args.min_gain:
        print(f"FAILED: gain {summary['accuracy_gain']:+.1%} < {args.min_gain:.0%}")
        return 1
    return 0


def default_run_dir(jobs: str) -> str:
    """`runs/demo-<date>-<time>` (`runs/demo-jobs-...` for `--jobs local`)."""
    name = "demo-jobs-%Y%m%d-%H%M%S" if jobs == "local" else "demo-%Y%m%d-%H%M%S"
    return str(Path("runs") / datetime.now().strftime(name))


def run_demo(config: GRPOConfig, min_gain: float = DEFAULT_MIN_GAIN) -> dict:
    """Train, then print and return the summary; everything lands in `config.output_dir`."""
    from ..train.trainer import GRPOTrainer  # torch and transformers: only for this job
    from ..watch.metrics import plot_training

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the default path never touches the hub
    if config.output_dir is None:
        config.output_dir = default_run_dir("none")
    run_dir = Path(config.output_dir)
    trainer = GRPOTrainer(config)  # builds the tiny model first if it is not cached
    start = time.perf_counter()
    records = trainer.train()
    grpo_seconds = time.perf_counter() - start

    history = trainer.accuracy_history
    before, after = history[0][1], history[-1][1]
    fig = plot_training(records, title=f"grpo-lab demo: {config.task}, "
                        f"{'LoRA r=' + str(config.lora_rank) if config.use_lora else 'full'}",
                        keys=("reward", "eval/accuracy", "completions/mean_length"))
    fig.savefig(run_dir / "training.png", dpi=110)
    summary = {
        "model": config.model, "task": config.task, "steps": trainer.step_count,
        "samples": trainer.step_count * config.prompts_per_step * config.num_generations,
        "trainable_parameters": trainer.num_trainable,
        "accuracy_before": before, "accuracy_after": after, "accuracy_gain": after - before,
        "grpo_seconds": round(grpo_seconds, 1), "run_dir": str(run_dir),
        "findings": [f.as_dict() for f in trainer.logger.findings],  # the run doctor's
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print()
    print("=" * 64)
    print(f"grpo-lab demo: {summary['steps']} GRPO steps, {summary['samples']} samples, "
          f"{summary['trainable_parameters']:,} trainable parameters")
    print(f"greedy accuracy on {config.eval_size} held-out problems: "
          f"{before:.1%} -> {after:.1%} ({100 * (after - before):+.1f} points) "
          f"in {grpo_seconds:.0f} s of GRPO")
    verdict = "met" if after - before >= min_gain else "NOT met"
    print(f"target: greedy accuracy gain >= {100 * min_gain:+.0f} points: "
          f"{100 * (after - before):+.1f} ({verdict})")
    codes = [f["code"] for f in summary["findings"]]
    print("run doctor: " + (", ".join(codes) if codes else "no findings"))
    print(f"run folder: {run_dir}  (metrics.jsonl, training.png, adapter/, summary.json)")
    print("=" * 64)
    return summary
