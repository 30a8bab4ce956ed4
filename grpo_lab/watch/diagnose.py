"""Which side of the rollout buffer holds a run back: `diagnose`, from the per-step metrics.

`diagnose` applies docs/recipe.md's rule ("Reading the pipeline"):
    full queue  + zero wait   + high backpressure  = the trainer is too slow
    empty queue + rising wait + no backpressure    = generation is too slow
Generation is held back by a full buffer (`rollout/backpressure_total_s`) or, in grpo_lab's
async trainer, by the admission rule that keeps samples within max_staleness
(`rollout/version_wait_s`): both mean generation is ahead, so both count as backpressure.
The metric names below are the ones the asynchronous trainer logs (grpo_lab.rollout; how they
map to TRL's: grpo_lab.watch.metric_names.TRL_ASYNC_NAMES).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

QUEUE, QUEUE_MAX = "sample/rollout_queue_size", "sample/rollout_queue_maxsize"
WAIT, BACKPRESSURE = "perf/rollout_wait_s", "rollout/backpressure_total_s"
VERSION_WAIT = "rollout/version_wait_s"
INFLIGHT = "rollout/inflight_max"
STEP, FWD_BWD, SYNC = "perf/step_s", "perf/fwd_bwd_s", "perf/weight_sync_s"
STALE_MEAN, STALE_MAX = "sample/staleness_mean", "sample/staleness_max"


class Diagnosis(NamedTuple):
    bottleneck: str
    """`trainer`, `generation`, `balanced`, or `unknown` (no queue metrics)."""
    verdict: str
    """One sentence, with the numbers that decided it."""
    numbers: dict
    """steps, queue_fill, rollout_wait_s, wait_share, wait_slope_s, backpressure_s,
    version_wait_s, held_back_share, fwd_bwd_share (per-step means or shares of step time,
    over the window)."""


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys against xs (0 for fewer than 2 points)."""
    if len(xs) < 2:
        return 0.0
    mx, my = _mean(xs), _mean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def diagnose(records: Iterable[dict], window: int = 20, *, full: float = 0.75,
             empty: float = 0.25, idle: float = 0.05, busy: float = 0.2) -> Diagnosis:
    """Which side of the rollout buffer holds the run back, over the last `window` steps.

    `full`/`empty`: queue fill (size / max size) that counts as full / empty. Waits are compared
    to the step time: a share under `idle` is "zero" / "no", a share over `busy` is "high".
    """
    rows = [r for r in records if r.get(QUEUE_MAX) and STEP in r][-window:]
    if not rows:
        return Diagnosis("unknown", "no pipeline metrics yet (a synchronous run has no queue)", {})
    step_time = sum(r[STEP] for r in rows) or 1e-9
    waits = [r.get(WAIT, 0.0) for r in rows]
    n = {
        "steps": len(rows),
        "queue_fill": _mean([r[QUEUE] / r[QUEUE_MAX] for r in rows]),
        "rollout_wait_s": _mean(waits),
        "wait_share": sum(waits) / step_time,
        "wait_slope_s": _slope([r.get("step", i) for i, r in enumerate(rows)], waits),
        "backpressure_s": _mean([r.get(BACKPRESSURE, 0.0) for r in rows]),
        "version_wait_s": _mean([r.get(VERSION_WAIT, 0.0) for r in rows]),
        "held_back_share": sum(r.get(BACKPRESSURE, 0.0) + r.get(VERSION_WAIT, 0.0)
                               for r in rows) / step_time,
        "fwd_bwd_share": sum(r.get(FWD_BWD, 0.0) for r in rows) / step_time,
    }
    facts = (f"queue {n['queue_fill']:.0%} full, trainer waits {n['rollout_wait_s']:.2f} s/step "
             f"({n['wait_share']:.0%} of a step), generation held back "
             f"{n['backpressure_s'] + n['version_wait_s']:.2f} s/step ({n['held_back_share']:.0%})")
    if n["queue_fill"] >= full and n["wait_share"] <= idle and n["held_back_share"] >= busy:
        return Diagnosis("trainer", f"trainer too slow: {facts}. Generation is throttled by a "
                         "full buffer; speed up the step (packing, no gradient checkpointing) "
                         "before adding replicas.", n)
    rising = n["wait_share"] >= busy or (n["wait_slope_s"] > 0 and n["wait_share"] > idle)
    if n["queue_fill"] <= empty and rising and n["held_back_share"] <= idle:
        return Diagnosis("generation", f"generation too slow: {facts}. The trainer starves; "
                         "add replicas or lift the client's cap on in-flight requests.", n)
    return Diagnosis("balanced", f"neither side clearly waits for the other: {facts}.", n)
