"""Short asynchronous runs against live inference servers, one knob at a time (notebook 08).

Find the stage that waits, change the one knob that feeds it, run again, read again:
`run_with_knobs` is one such run (max_inflight, request_shape, server_url, token_budget,
weight_sync_steps), `summarize` turns it into one row of numbers and `plot_runs` draws runs side
by side (docs/internals.md, "One knob at a time"; docs/recipe.md, "Reading the pipeline").
"""

from __future__ import annotations

import re
import time
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from grpo_lab.bucket.adapters import AdapterBucket
from grpo_lab.rollout.http_generator import REQUEST_SHAPES, HTTPGenerator
from grpo_lab.serve.sampling_settings import sampling_settings
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.async_trainer import AsyncGRPOTrainer
from grpo_lab.watch.doctor import (
    BACKPRESSURE,
    FWD_BWD,
    INFLIGHT,
    QUEUE,
    QUEUE_MAX,
    STALE_MAX,
    STALE_MEAN,
    STEP,
    SYNC,
    VERSION_WAIT,
    WAIT,
    Diagnosis,
    diagnose,
)


@dataclass
class KnobRun:
    """One short run: its knobs, its per-step metrics, and what `diagnose` made of them."""

    name: str
    knobs: dict
    records: list[dict]
    """Step records (step >= 1) with TRL's metric names (grpo_lab.train.async_trainer)."""
    diagnosis: Diagnosis
    """Over the last `window` steps: the first steps fill the pipeline and are left out."""
    seconds: float
    inflight_peak: int
    """The most completion requests that were in flight at once."""
    syncs: list[dict] = field(default_factory=list)

    def __repr__(self) -> str:  # a notebook cell ending on a run shows one line, not its records
        return (f"KnobRun({self.name!r}, {len(self.records)} steps, {self.seconds:.1f} s, "
                f"bottleneck {self.diagnosis.bottleneck!r})")

    def mean(self, key: str) -> float:
        """Mean of `key` over the diagnosed window."""
        rows = self.records[-self.diagnosis.numbers.get("steps", len(self.records)):]
        values = [r.get(key, 0.0) for r in rows]
        return sum(values) / len(values) if values else 0.0


def run_with_knobs(name: str, server_url: str, bucket_root: str | Path, *, steps: int = 24,
                   window: int = 16, max_inflight: int | None = None,
                   request_shape: str = "group", replicas: int = 1,
                   progress: bool = True, **config_fields) -> KnobRun:
    """Train `steps` asynchronous LoRA GRPO steps against `server_url` and diagnose the run.

    `config_fields` go to AsyncGRPOConfig (e.g. `token_budget=32`, `weight_sync_steps=4`).
    The run publishes its adapters as `<name>-<id>-vN` (a new id per call: servers key their
    prefix caches by adapter name, so a re-run never reuses one) into `<bucket_root>`, and
    unloads them from the servers at the end, even after an error, so runs can follow each
    other on the same replicas. `replicas` is only recorded (how many replicas `server_url`
    leads to).
    """
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise ValueError(f"a run name is also its adapters' name: use letters, digits, - _ . "
                         f"(got {name!r})")
    if not 1 <= window <= steps:
        raise ValueError(f"need 1 <= window <= steps (got window {window}, steps {steps})")
    if request_shape not in REQUEST_SHAPES:
        raise ValueError(f"request_shape must be one of {REQUEST_SHAPES} (got {request_shape!r})")
    config = AsyncGRPOConfig(**{"eval_every": 0, "eval_size": 16, "log_every": 10 ** 9,
                                "progress": progress, **config_fields, "steps": steps})
    prefix = f"{name}-{uuid.uuid4().hex[:6]}"
    bucket = AdapterBucket(Path(bucket_root) / prefix, prefix=prefix,
                           max_staleness=config.max_staleness)
    generator = HTTPGenerator(server_url, bucket, max_staleness=config.max_staleness,
                              seed=config.seed, max_inflight=max_inflight,
                              request_shape=request_shape, sampling=sampling_settings(config))
    start = time.perf_counter()
    try:
        trainer = AsyncGRPOTrainer(config, generator=generator)  # publishes v0 when it starts
        records = [r for r in trainer.train() if r.get("step", 0) > 0]
    finally:
        try:
            for version in list(generator.loaded):  # free the servers' adapter slots
                try:
                    generator.client.unload_lora_adapter(generator.name(version))
                except Exception as exc:  # keep the run's own error, if any, in front
                    warnings.warn(f"could not unload {generator.name(version)}: {exc}",
                                  stacklevel=2)
        finally:
            generator.close()
    knobs = {"replicas": replicas, "max_inflight": max_inflight, "request_shape": request_shape,
             "token_budget": config.token_budget, "weight_sync_steps": config.weight_sync_steps,
             "max_staleness": config.max_staleness}
    return KnobRun(name, knobs, records, diagnose(records, window=window),
                   time.perf_counter() - start, generator.inflight_peak, generator.syncs)


def summarize(run: KnobRun) -> dict:
    """One row per run: the knobs, then per-step means over the diagnosed window (staleness_max
    and dropped_stale, the completions dropped for staleness: over the whole run)."""
    step = run.mean(STEP) or 1e-9
    held_back = run.mean(BACKPRESSURE) + run.mean(VERSION_WAIT)
    return {
        "run": run.name, **run.knobs,
        "micro_batches": run.mean("batch/microbatches_per_step"),
        "step_s": run.mean(STEP), "fwd_bwd_s": run.mean(FWD_BWD),
        "rollout_wait_s": run.mean(WAIT), "wait_share": run.mean(WAIT) / step,
        "backpressure_s": run.mean(BACKPRESSURE), "version_wait_s": run.mean(VERSION_WAIT),
        "held_back_share": held_back / step,
        "queue": run.mean(QUEUE), "queue_max": run.mean(QUEUE_MAX),
        "staleness_mean": run.mean(STALE_MEAN),
        "staleness_max": max((r.get(STALE_MAX, 0) for r in run.records), default=0),
        "dropped_stale": sum(r.get("sample/dropped_stale_total", 0) for r in run.records),
        "weight_sync_s": run.mean(SYNC), "inflight_mean": run.mean(INFLIGHT),
        "inflight_peak": run.inflight_peak,
        "bottleneck": run.diagnosis.bottleneck,
    }


def plot_runs(runs: list[KnobRun]):
    """Side by side: where each run's step time goes, how full the queue was, and how long
    generation was held back, with each run's diagnosis under its name. Returns the figure."""
    import matplotlib.pyplot as plt

    rows = [summarize(r) for r in runs]
    labels = [f"{r['run'].replace('-', chr(10), 1)}\n({r['bottleneck']})" for r in rows]
    xs = range(len(rows))
    fig, axes = plt.subplots(1, 3, figsize=(12.5, 4.8))
    bottom = [0.0] * len(rows)
    parts = (("fwd_bwd_s", "forward+backward"), ("rollout_wait_s", "waiting for rollouts"),
             ("weight_sync_s", "weight sync"))
    for key, label in parts:
        values = [r[key] for r in rows]
        axes[0].bar(xs, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[0].plot(xs, [r["step_s"] for r in rows], "k_", markersize=30, label="step time")
    axes[0].set_title("where a trainer step goes (s)", fontsize=10)
    axes[0].legend(fontsize=8, loc="upper right", framealpha=0.9)
    axes[1].bar(xs, [r["queue"] / (r["queue_max"] or 1) for r in rows], color="tab:green")
    axes[1].set_ylim(0, 1.05)
    axes[1].set_title("rollout queue when the trainer asks\n(share of its max)", fontsize=10)
    axes[2].bar(xs, [r["held_back_share"] for r in rows], color="tab:red", label="held back")
    axes[2].bar(xs, [-r["wait_share"] for r in rows], color="tab:blue", label="trainer waits")
    axes[2].axhline(0, color="black", linewidth=0.8)
    axes[2].set_title("generation held back (+) /\ntrainer waiting (-), share of a step",
                      fontsize=10)
    axes[2].legend(fontsize=8, loc="lower left", framealpha=0.9)
    for ax in axes:
        ax.set_xticks(list(xs), labels, fontsize=8, rotation=30, ha="right")
    fig.tight_layout()
    return fig


TABLE_COLUMNS = ("replicas", "max_inflight", "token_budget", "weight_sync_steps",
                 "micro_batches", "step_s", "fwd_bwd_s", "rollout_wait_s", "backpressure_s",
                 "version_wait_s", "queue", "staleness_mean", "weight_sync_s", "inflight_mean",
                 "bottleneck")


def runs_table(runs: list[KnobRun], columns=TABLE_COLUMNS) -> str:
    """`summarize` of each run as a text table: one row per run, seconds to 3 decimals."""
    rows = [summarize(r) for r in runs]

    def cell(value) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    header = ["run", *columns]
    body = [[row["run"], *(cell(row[c]) for c in columns)] for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]
    return "\n".join("  ".join(text.rjust(w) if i else text.ljust(w)
                               for i, (text, w) in enumerate(zip(line, widths)))
                     for line in [header, *body])
