"""What one optimizer step forwarded, and how fast, under TRL AsyncGRPOTrainer's names.

TRL packs each process's share of a micro-batch into one "row" (a prefix tree, no padding);
grpo_lab's micro-batch is one process's forward pass, padded or packed rows (grpo_lab.train.
packing). So TRL's `batch/row_*` and `batch/samples_per_row` are read here per micro-batch:
its tokens padding included (`input_tokens`, what `token_budget` bounds) and its sequences.
`sample/*` are per completion, prompt included, unpadded, as TRL counts a sample's tokens.
Throughput and MFU (grpo_lab.watch.flops) are on TRL's two bases: `_fwd_bwd` divides by the
forward and backward seconds, `_wall_clock` by the whole step's.
"""

from __future__ import annotations

import torch

from ..algo.packing import MicroBatch
from .flops import mfu


def layout_metrics(batch, micro_batches: list[MicroBatch], token_budget: int | None,
                   processes) -> tuple[dict[str, float], tuple[int, int]]:
    """The step's `batch/*` and `sample/*` metrics over every process's share, and (tokens the
    model needs, sequences): the unpadded work that MFU counts."""
    trained = batch.completion_mask.sum(1)  # (B,) loss terms of each completion
    local = dict(forwarded=(batch.prompt_mask.sum(1) + trained).tolist(),
                 trained=trained.tolist(),
                 rows=[mb.input_tokens for mb in micro_batches],
                 real=[mb.real_tokens for mb in micro_batches],
                 samples=[mb.num_sequences for mb in micro_batches])
    everyone = processes.gather(local)  # one process: [local]
    forwarded, trained, rows, real, samples = (
        [v for share in everyone for v in share[key]] for key in local)
    metrics = {
        "batch/forwarded_tokens_per_step": sum(rows),
        "batch/trained_tokens_per_step": sum(trained),
        "batch/samples_per_step": len(forwarded),
        "batch/samples_per_row": sum(samples) / len(samples),
        "batch/row_tokens_mean": sum(rows) / len(rows),
        "batch/row_tokens_max": max(rows),
        "batch/pad_frac": (sum(rows) - sum(real)) / max(sum(rows), 1),
        "batch/masked_token_frac": (sum(forwarded) - sum(trained)) / max(sum(forwarded), 1),
        "sample/forwarded_tokens_mean": sum(forwarded) / len(forwarded),
        "sample/forwarded_tokens_max": max(forwarded),
        "sample/trained_tokens_mean": sum(trained) / len(trained),
    }
    if token_budget:
        metrics["batch/row_fill_frac"] = sum(rows) / (token_budget * len(rows))
    return metrics, (sum(real), len(forwarded))


def throughput_metrics(metrics: dict, passes: int, fwd_bwd_s: float, step_s: float,
                       flops: float | None, peak: float | None, processes: int = 1
                       ) -> dict[str, float]:
    """Tokens per second and MFU (percent, TRL's unit) of a step whose `metrics` hold
    `layout_metrics`'s; `passes` training passes over the batch (num_iterations), `flops` the
    model FLOPs they took (None: unknown), `peak` one process's peak FLOP/s (None: unknown)."""
    forwarded = metrics["batch/forwarded_tokens_per_step"] * passes
    trained = metrics["batch/trained_tokens_per_step"] * passes
    out = {"perf/forwarded_tok_s_fwd_bwd": forwarded / fwd_bwd_s,
           "perf/forwarded_tok_s_wall_clock": forwarded / step_s,
           "perf/trained_tok_s_wall_clock": trained / step_s}
    if flops and peak:
        out["perf/mfu_fwd_bwd"] = mfu(flops, fwd_bwd_s, peak, processes)
        out["perf/mfu_wall_clock"] = mfu(flops, step_s, peak, processes)
    return out


# -------------------------------- the asynchronous trainer's pipeline and rewards
# The asynchronous trainer's step record under TRL AsyncGRPOTrainer's names: what the rollout
# buffer counted since the previous step, and the step's rewards reduced as TRL's asynchronous
# trainer reduces them. Every name is explained once in grpo_lab.watch.metric_names.METRICS; which
# of TRL's names each one is, or why it is not, is grpo_lab.watch.metric_names.TRL_ASYNC_NAMES.
#
# TRL's queue holds single completions (its "samples"); grpo_lab's RolloutBuffer holds a prompt's
# group of G, and its `stats()` are cumulative. A step record holds what happened since the
# previous step, counted in completions, as TRL logs it (TRL every `logging_steps` steps,
# grpo_lab every step).


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
