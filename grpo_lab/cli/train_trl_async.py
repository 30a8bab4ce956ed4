"""`grpo-lab train-trl-async`: the trainer job with TRL's AsyncGRPOTrainer (trl/async_job).

    grpo-lab train-trl-async --server-url http://127.0.0.1:8000 --output-dir runs/trl \\
        --model tiny-chat --dataset <chat model>/data --reward math_answer --steps 50

Takes `grpo-lab train-async`'s training flags (grpo_lab's `AsyncGRPOConfig`) and the job's own
(`TrlAsyncJobConfig`); writes `metrics.jsonl` (TRL's metric names), `summary.json` and the final
`adapter/` into `--output-dir`, TRL's `checkpoint-N` every `--checkpoint-every` steps into
`--output-dir`/trl, the adapters `trl-policy-vN` into `--bucket`. `--resume` (a restarted job,
e.g. after a preemption) continues from the newest checkpoint; the same command works on a first
start.
"""

from __future__ import annotations

import json

from ..train.async_config import AsyncGRPOConfig
from ..trl.async_job import TrlAsyncJobConfig, run_train_trl_async
from .flags import add_config_flags, config_from_args


def add_parser(sub) -> None:
    parser = sub.add_parser("train-trl-async", help="the trainer job with TRL's "
                            "AsyncGRPOTrainer: same data, rewards and flags as train-async, "
                            "LoRA adapters through the bucket, against a proxy or one server")
    add_config_flags(parser, TrlAsyncJobConfig)
    # the job checkpoints with --checkpoint-every / --keep-checkpoints and resumes with --resume
    add_config_flags(parser, AsyncGRPOConfig, exclude=("save_steps", "save_total_limit"))
    parser.set_defaults(func=run)


def run(args) -> int:
    summary = run_train_trl_async(config_from_args(args, AsyncGRPOConfig),
                                  config_from_args(args, TrlAsyncJobConfig))
    print(json.dumps(summary, indent=2), flush=True)
    return 0
