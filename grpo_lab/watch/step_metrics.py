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
