"""The run doctor's pipeline finding: which side of the rollout buffer holds the run back.

A note, not a problem: some side always sets the pace (on 2 CPU cores, the trainer does).

`bottleneck` is a check of grpo_lab.watch.doctor's kind, made of `diagnose` (this stage's
reading of the queue, the waits and the backpressure); `pipeline_doctor()` is a Doctor with it.
"""

from __future__ import annotations

from .diagnose import diagnose
from .doctor import CHECKS, Doctor, Finding

KNOBS = {"trainer": "speed up the step: packing, a bigger token budget, no gradient "
                    "checkpointing; adding replicas will not help",
         "generation": "add replicas or lift the client's in-flight cap"}


def bottleneck(d: Doctor) -> Finding | None:
    """The existing diagnosis over the last two windows, once it names a side."""
    if len(d.records) < 2 * d.window:
        return None
    diagnosis = diagnose(d.records, window=2 * d.window)
    if diagnosis.bottleneck not in KNOBS:
        return None
    numbers = {k: round(v, 3) for k, v in diagnosis.numbers.items() if isinstance(v, float)}
    return d.finding(
        f"bottleneck_{diagnosis.bottleneck}", f"the {diagnosis.bottleneck} holds the run back",
        {"metric": "sample/rollout_queue_size", "window": 2 * d.window, **numbers},
        diagnosis.verdict, KNOBS[diagnosis.bottleneck],
        "a balanced pipeline: the queue neither full nor empty, little waiting on either side",
        kind="note")


def pipeline_doctor(**kwargs) -> Doctor:
    """A Doctor that also names the pipeline's bottleneck."""
    return Doctor(checks=CHECKS + (bottleneck,), **kwargs)
