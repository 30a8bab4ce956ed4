"""grpo_lab: GRPO from a single process on a CPU to asynchronous LoRA training across jobs.

One folder per stage of the course. The stages are in import order: a module imports from its
own stage and the stages above it, never from one below (tests/test_layout.py checks this).

    stage      what it is                                                      notebooks
    core/      the tiny model and tokenizer, tasks, rewards, sampling,
               evaluation, the GRPO loss, GRPOConfig; the process-group
               toolkit the later stages start processes with                   00, 01
    train/     the synchronous trainer (full or LoRA), packing, metrics.jsonl  01, 02, 03
    bucket/    the folder all jobs share: adapters published atomically,
               trainer checkpoints                                             05, 07
    serving/   `grpo-lab serve`: vLLM's HTTP API on a CPU (protocol, sampling,
               continuous batching, LoRA adapters), its client, its process    05
    rollout/   the rollout buffer, generators (local and over HTTP), the
               asynchronous trainer                                            04, 05
    proxy/     `grpo-lab proxy`: replicas behind one URL, KV-prefix routing    06
    jobs/      the recipe's jobs as a plan, run locally or on HF Jobs; the
               two trainer jobs (grpo_lab's trainer or TRL's)                  07
    observe/   diagnose, the pipeline plots, the live dashboard, one-knob runs 08
    cli/       the `grpo-lab` command and the demos                            07

Why this order and not the notebooks' exactly: rollout's `HTTPGenerator` (notebook 05) talks to
a server through serving's client and publishes adapters into the bucket, so bucket and serving
come before rollout although notebook 04 (the rollout buffer) comes first in the course. The
asynchronous trainer extends train's trainer; the proxy starts like a server (serving/process);
observe reads what rollout logs and runs it; cli imports every stage.
"""

__version__ = "0.1.0"

STAGES = ("core", "train", "bucket", "serving", "rollout", "proxy", "jobs", "observe", "cli")
"""The stage folders in import order: a module may import its own stage and those before it."""
