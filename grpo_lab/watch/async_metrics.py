"""The asynchronous trainer's step record under TRL AsyncGRPOTrainer's names: what the rollout
buffer counted since the previous step, and the step's rewards reduced as TRL's asynchronous
trainer reduces them. Every name is explained once in grpo_lab.watch.metric_names.METRICS; which
of TRL's names each one is, or why it is not, is grpo_lab.watch.metric_names.TRL_ASYNC_NAMES.

TRL's queue holds single completions (its "samples"); grpo_lab's RolloutBuffer holds a prompt's
group of G, and its `stats()` are cumulative. A step record holds what happened since the
previous step, counted in completions, as TRL logs it (TRL every `logging_steps` steps,
grpo_lab every step).
"""

from __future__ import annotations

import torch


def buffer_metrics(stats: dict, last: dict, queue_size: int, group_size: int) -> dict:
    """One step's pipeline metrics from the buffer's `stats()` right after the trainer's `get`.

    `last` holds the cumulative counters at the previous step and is updated; `queue_size` is
    the groups in the buffer when the trainer came for its batch.
    """

    def since_last_step(name: str) -> float:
        value, last[name] = stats[name] - last.get(name, 0), stats[name]
        return value

    return {
        "perf/rollout_wait_s": since_last_step("perf/rollout_wait_cumulative_s"),
        "rollout/backpressure_total_s": since_last_step("rollout/backpressure_cumulative_s"),
        "sample/rollout_queue_size": queue_size * group_size,
        "sample/rollout_queue_maxsize": stats["sample/rollout_queue_maxsize"] * group_size,
        "sample/dropped_stale_total": since_last_step("sample/dropped_stale_cumulative")
                                      * group_size,
        "sample/time_in_queue_s": stats["sample/time_in_queue_mean_s"],
    }


def inline_metrics(generate_s: float) -> dict:
    """The same names in synchronous mode (`asynchronous=False`): no buffer, and the trainer
    waits for the whole generation."""
    return {"perf/rollout_wait_s": generate_s, "perf/generate_s": generate_s,
            "rollout/backpressure_total_s": 0.0, "sample/rollout_queue_size": 0,
            "sample/rollout_queue_maxsize": 0, "sample/dropped_stale_total": 0,
            "sample/time_in_queue_s": 0.0}


def async_reward_names(metrics: dict, rewards: torch.Tensor, group_size: int) -> dict:
    """`rollout_metrics` (GRPOTrainer's names) as TRL's AsyncGRPOTrainer logs them: each reward
    function's mean is `rewards/<name>`, not `rewards/<name>/mean`, and `reward_std` is the mean
    over completions of their group's reward std (population std, as TRL's rollout worker
    computes it), not the std over the whole step."""
    out = {(name.removesuffix("/mean") if name.startswith("rewards/") else name): value
           for name, value in metrics.items()}
    out["reward_std"] = rewards.view(-1, group_size).std(dim=1, correction=0).mean().item()
    return out
