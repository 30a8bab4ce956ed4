"""What both trainer jobs share: `grpo-lab train-async` (grpo_lab's asynchronous trainer,
grpo_lab.train.async_job) and `grpo-lab train-trl-async` (TRL's AsyncGRPOTrainer,
grpo_lab.trl.async_job) take the same training flags (`AsyncGRPOConfig`) and these job
flags, then their own. docs/recipe.md, "The trainer job", describes the run folder, the bucket and
resuming.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass
class TrainerJobConfig:
    """The job flags both trainer jobs take (their training flags are `AsyncGRPOConfig`'s)."""

    command: ClassVar[str] = "the trainer job"  # named in error messages

    server_url: str = ""
    """Base URL of the proxy (or of one `grpo-lab serve` / `vllm serve`). Required."""
    bucket: str | None = None
    """Folder the servers load adapters from, at the same path (default <output-dir>/adapters)."""
    resume: bool = False
    """Continue from the newest checkpoint, if any: a preempted job restarted with the same
    command (without one it starts from step 0)."""
    checkpoint_every: int = 10
    """Save a checkpoint every N steps (0 = never): train-async into <bucket>/checkpoints,
    train-trl-async TRL's checkpoint-N into <output-dir>/trl (and one at the end)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep."""
    max_inflight: int | None = None
    """Most completion requests in flight at once. train-async: default all of a step's (a
    request is one prompt's G completions, or one completion with --request-shape single);
    train-trl-async: TRL's max_inflight_tasks, default max_staleness x samples per step."""
    check_base_model: bool = True
    """At start, ask every replica's /v1/models and refuse to train when one serves another base
    model than --model (grpo_lab.rollout.http_generator); false = skip (e.g. a replica serving a
    local copy of the hub model under another name)."""

    def __post_init__(self):
        if not self.server_url:
            raise ValueError(f"{self.command} needs --server-url (the proxy's or one server's "
                             "URL)")
        if self.checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {self.checkpoint_every}")
        if self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")


def check_trainer_settings(command: str, config) -> None:
    """The settings both jobs need (`config`: an AsyncGRPOConfig): a run folder, and LoRA (the
    adapters travel through the bucket)."""
    if not config.output_dir:
        raise ValueError(f"{command} needs --output-dir")
    if not config.use_lora:
        raise ValueError(f"{command} syncs adapters through the bucket: it needs use_lora")
