"""`grpo-lab demo --jobs none`: the main job's budget as synchronous LoRA GRPO in one process.

Build or load the tiny model, train a rank-1 adapter, and leave a run folder with the metrics,
the adapter, a plot and a summary. The default main job (`grpo-lab demo`, `make demo`) runs the
recipe's separate jobs instead: grpo_lab.cli.multi_job.
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path

from ..core.config import GRPOConfig
from ..train.metrics import plot_training
from ..train.trainer import GRPOTrainer


def run_demo(config: GRPOConfig, min_gain: float = 0.20) -> dict:
    """Train, then print and return the summary; everything lands in `config.output_dir`."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the default path never touches the hub
    if config.output_dir is None:
        config.output_dir = str(Path("runs") / datetime.now().strftime("demo-%Y%m%d-%H%M%S"))
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
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print()
    print("=" * 64)
    print(f"grpo-lab demo: {summary['steps']} GRPO steps, {summary['samples']} samples, "
          f"{summary['trainable_parameters']:,} trainable parameters")
    print(f"greedy accuracy on {config.eval_size} held-out problems: "
          f"{before:.1%} -> {after:.1%} ({100 * (after - before):+.1f} points) in {grpo_seconds:.0f} s of GRPO")
    verdict = "met" if after - before >= min_gain else "NOT met"
    print(f"target: greedy accuracy gain >= {100 * min_gain:+.0f} points: "
          f"{100 * (after - before):+.1f} ({verdict})")
    print(f"run folder: {run_dir}  (metrics.jsonl, training.png, adapter/, summary.json)")
    print("=" * 64)
    return summary
