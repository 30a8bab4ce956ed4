"""`grpo-lab train`: a GRPO run (grpo_lab.train.trainer) with every GRPOConfig field as a flag.

On several processes: `accelerate launch ... -m grpo_lab.cli train ...`.
"""

from __future__ import annotations

from .flags import add_config_flags, config_from_args


def add_parser(sub) -> None:
    train = sub.add_parser("train", help="a GRPO run; every GRPOConfig field is a flag")
    add_config_flags(train)
    train.add_argument("--resume-from-checkpoint", default=None, metavar="PATH|latest",
                       help="continue from a checkpoint folder, or `latest`: the newest under "
                            "<output-dir>/checkpoints (written every --save-steps), up to --steps "
                            "in all")
    train.set_defaults(func=run)


def run(args) -> int:
    from ..train.trainer import GRPOTrainer  # torch and transformers: only when training

    trainer = GRPOTrainer(config_from_args(args))  # any number of processes
    resume = args.resume_from_checkpoint
    trainer.train(resume_from_checkpoint=True if resume == "latest" else resume)
    if trainer.processes.is_main:
        print("greedy accuracy by step:", trainer.accuracy_history)
    return 0
