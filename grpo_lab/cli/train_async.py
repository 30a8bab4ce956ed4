"""`grpo-lab train-async`: the trainer job with grpo_lab's asynchronous trainer
(grpo_lab.train.async_job; under `accelerate launch`, on several processes)."""

from __future__ import annotations

import json

from ..train.async_config import AsyncGRPOConfig
from ..train.async_job import TrainAsyncJobConfig, run_train_async
from ..train.distributed import is_main_process
from .flags import add_config_flags, config_from_args


def add_parser(sub) -> None:
    parser = sub.add_parser("train-async", help="the trainer job: asynchronous LoRA GRPO against "
                            "inference servers (a proxy or one server), adapters through a bucket")
    add_config_flags(parser, TrainAsyncJobConfig)
    # the job checkpoints with --checkpoint-every / --keep-checkpoints and resumes with --resume
    add_config_flags(parser, AsyncGRPOConfig, exclude=("save_steps", "save_total_limit"))
    parser.set_defaults(func=run)


def run(args) -> int:
    summary = run_train_async(config_from_args(args, AsyncGRPOConfig),
                              config_from_args(args, TrainAsyncJobConfig))
    if is_main_process():
        print(json.dumps(summary, indent=2), flush=True)
    return 0
