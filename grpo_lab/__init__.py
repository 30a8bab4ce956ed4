"""grpo_lab: GRPO from a single process on a CPU to asynchronous LoRA training across jobs."""

__version__ = "0.1.0"
