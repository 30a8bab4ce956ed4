"""Reading the pipeline: which side of an asynchronous GRPO run is the bottleneck.

The recipe's rule, on TRL's metric names:

- full queue + (near) zero `perf/rollout_wait_s` + high `rollout/backpressure_s`
  = **trainer-bound**: generation is throttled, waiting for the trainer. Speed up training
  (token-budget packing, more threads or devices for the trainer), or generate less often.
- empty queue + high `perf/rollout_wait_s` + no backpressure
  = **generation-bound**: the trainer starves. Add generation capacity (replicas, threads).

Generation can be held back in two places: the buffer is full (`rollout/backpressure_s`) or the
admission rule makes it wait for a newer policy so that samples stay within `max_staleness`
(`rollout/version_wait_s`). Both mean the same thing, generation is ahead of the trainer, so
both count as backpressure here. A synchronous loop has no queue and waits for every generation:
it always reads generation-bound, which is exactly the idle time asynchrony removes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Diagnosis:
    verdict: str
    """`trainer-bound`, `generation-bound` or `balanced` (neither rule fires)."""
    queue_fullness: float
    """Mean of queue size / max size when the trainer asked for a batch (0 without a buffer)."""
    wait_share: float
    """Share of the trainer's step time spent waiting for samples."""
    backpressure_share: float
    """Generation's throttled time (buffer full or waiting for a version), per step time."""

    def __str__(self) -> str:
        return (f"{self.verdict}: queue {self.queue_fullness:.0%} full, trainer waits "
                f"{self.wait_share:.0%} of its time, generation held back "
                f"{self.backpressure_share:.0%} of it")


def diagnose(records: list[dict], threshold: float = 0.1, skip: int = 2) -> Diagnosis:
    """Apply the rule to a run's step records (the first `skip` steps are start-up, ignored).

    A share counts as "high" at `threshold` or more of the step time, "zero" below it; the
    queue counts as full when it was at least half full on average.
    """
    steps = [r for r in records if "perf/step_s" in r][skip:] or [
        r for r in records if "perf/step_s" in r]
    if not steps:
        raise ValueError("no step records (need perf/step_s) to diagnose")
    total = sum(r["perf/step_s"] for r in steps)
    fullness = sum(r.get("sample/rollout_queue_size", 0) / r["sample/rollout_queue_maxsize"]
                   if r.get("sample/rollout_queue_maxsize") else 0.0 for r in steps) / len(steps)
    wait = sum(r.get("perf/rollout_wait_s", 0.0) for r in steps) / total
    held = sum(r.get("rollout/backpressure_s", 0.0) + r.get("rollout/version_wait_s", 0.0)
               for r in steps) / total
    if fullness >= 0.5 and wait < threshold and held >= threshold:
        verdict = "trainer-bound"
    elif fullness < 0.5 and wait >= threshold and held < threshold:
        verdict = "generation-bound"
    else:
        verdict = "balanced"
    return Diagnosis(verdict, fullness, wait, held)
