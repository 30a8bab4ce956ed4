"""grpo_lab: GRPO from a single process on a CPU to asynchronous LoRA training across jobs.

Stage folders in import order: a module imports its own stage and those above (docs/internals.md).

    core/      tiny models, tasks, rewards, sampling, the GRPO loss, GRPOConfig, processes
    train/     the synchronous trainer (full or LoRA), packing, metrics.jsonl
    bucket/    the folder all jobs share: adapters published atomically, checkpoints
    serving/   `grpo-lab serve`: vLLM's HTTP API on a CPU, its client, its process
    rollout/   the rollout buffer, generators (local and over HTTP), the async trainer
    proxy/     `grpo-lab proxy`: replicas behind one URL, KV-prefix routing
    jobs/      the recipe's jobs as a plan, run locally or on HF Jobs; the two trainer jobs
    observe/   diagnose, the pipeline plots, the live dashboard, one-knob runs
    cli/       the `grpo-lab` command and the demos
"""

__version__ = "0.1.0"

STAGES = ("core", "train", "bucket", "serving", "rollout", "proxy", "jobs", "observe", "cli")
"""The stage folders in import order: a module may import its own stage and those before it."""
