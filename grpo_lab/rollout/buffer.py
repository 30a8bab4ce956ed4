"""The bounded rollout buffer between generation and training in asynchronous GRPO.

Producers (the scorer that turns finished generations into rewarded groups) `put` items tagged
with the policy version that generated them; the trainer `get`s a batch tagged with its own
version. The buffer does three jobs of the recipe:

1. **Bounds the queue.** A full buffer blocks `put`, so generation cannot run arbitrarily far
   ahead of training; the time producers spend blocked is *backpressure*.
2. **Enforces `max_staleness`.** An item whose version lags the trainer's by more than
   `max_staleness` is dropped when the trainer asks for a batch, and counted.
3. **Measures the pipeline**, so the diagnosis in the recipe ("full queue + zero wait + high
   backpressure = trainer too slow") can be read straight off `stats()`.

`stats()` counts items (in the trainers an item is one prompt's group of G completions) and is
cumulative where the name says so; the asynchronous trainer turns it into per-step values under
TRL AsyncGRPOTrainer's names (grpo_lab.rollout.async_metrics, grpo_lab.train.glossary):

- `sample/rollout_queue_size`: items in the buffer now.
- `sample/rollout_queue_maxsize`: the bound; size == maxsize means generation is throttled.
- `rollout/backpressure_cumulative_s`: seconds producers spent blocked in `put` waiting for
  room, since the buffer was made (per step: `rollout/backpressure_total_s`).
- `perf/rollout_wait_cumulative_s`: seconds consumers spent blocked in `get` waiting for items,
  since the buffer was made (per step: `perf/rollout_wait_s`).
- `sample/enqueued`, `sample/delivered`, `sample/dropped_stale_cumulative`: item counts since
  the buffer was made; `enqueued == delivered + dropped_stale_cumulative + rollout_queue_size`
  at every moment (per step, in completions: `sample/dropped_stale_total`).
- `sample/staleness_mean`, `sample/staleness_max`: version lag (trainer version - item version)
  of the items delivered by the *last* `get` (0 before the first delivery).
- `sample/time_in_queue_mean_s`: mean seconds between `put` and delivery, *last* `get`.
- `sample/staleness_hist`: `{lag: count}` over *every* item delivered so far (cumulative).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One item as the trainer receives it."""

    item: T
    """What the producer put: usually a scored group of completions for one prompt."""
    version: int
    """Policy version that generated the item."""
    staleness: int
    """`trainer_version - version` at delivery; 0 = on-policy. Negative only if a producer is
    ahead of the trainer, which the recipe never does (the trainer owns the version)."""
    time_in_queue_s: float
    """Seconds between `put` and delivery."""


@dataclass
class _Slot(Generic[T]):
    """An item while it waits in the buffer."""

    item: T
    version: int
    enqueued_at: float


class RolloutBuffer(Generic[T]):
    """Bounded, thread-safe FIFO of rollout items, each tagged with its policy version.

    `put` blocks while the buffer is full; `get` blocks until `n` fresh items are there, dropping
    the stale ones. `close()` wakes every waiter: later `put`s return False and `get` returns what
    is left without blocking. Blocking uses `threading.Condition` (no polling).

    `clock` is only used for the time metrics (inject a fake one to make them deterministic);
    timeouts always use the real monotonic clock.
    """

    def __init__(
        self,
        maxsize: int,
        max_staleness: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not isinstance(maxsize, int) or maxsize < 1:
            raise ValueError(f"maxsize must be an integer >= 1, got {maxsize!r}")
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(
                f"max_staleness must be an integer >= 0 (0 = on-policy only), got {max_staleness!r}"
            )
        self.maxsize = maxsize
        self.max_staleness = max_staleness
        self._clock = clock
        self._slots: deque[_Slot[T]] = deque()
        self._closed = False
        # One lock, two conditions: producers wait for room, consumers wait for items.
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._not_empty = threading.Condition(self._lock)
        # Cumulative counters (see the module docstring for what each metric means).
        self._backpressure_s = 0.0
        self._rollout_wait_s = 0.0
        self._enqueued = 0
        self._delivered = 0
        self._dropped_stale = 0
        self._staleness_hist: dict[int, int] = {}
        # Summary of the last `get`.
        self._last_staleness_mean = 0.0
        self._last_staleness_max = 0
        self._last_time_in_queue_mean_s = 0.0

    # ------------------------------------------------------------------ producer side
    def put(self, item: T, version: int, timeout: float | None = None) -> bool:
        """Add `item`, generated by policy `version`, blocking while the buffer is full.

        Returns True once added, False if the buffer is (or becomes, while waiting) closed: the
        item is then not added. Raises `TimeoutError` if there is still no room after `timeout`
        seconds (`timeout=0` never blocks; `None` waits for ever). Blocked time, whatever the
        outcome, counts as backpressure.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            blocked_since = None
            try:
                while not self._closed and len(self._slots) >= self.maxsize:
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(f"rollout buffer still full after {timeout}s")
                    if blocked_since is None:
                        blocked_since = self._clock()
                    self._not_full.wait(remaining)
            finally:
                if blocked_since is not None:
                    self._backpressure_s += self._clock() - blocked_since
            if self._closed:
                return False
            self._slots.append(_Slot(item, version, self._clock()))
            self._enqueued += 1
            # Wake every consumer: each wants its own `n`, so waking just one could miss.
            self._not_empty.notify_all()
            return True

    # ------------------------------------------------------------------ consumer side
    def get(self, n: int, trainer_version: int, timeout: float | None = None) -> list[Entry[T]]:
        """Take the `n` oldest fresh items for a trainer at `trainer_version`, in FIFO order.

        Items lagging more than `max_staleness` versions are dropped (and counted) first. Blocks
        until `n` fresh items are there; after `close()` returns what is left (up to `n`, maybe
        none) without blocking. Raises `TimeoutError` after `timeout` seconds without `n` items,
        taking nothing (stale items found meanwhile stay dropped). `n` must fit in the buffer.
        """
        if not isinstance(n, int) or not 1 <= n <= self.maxsize:
            raise ValueError(f"n must be an integer in [1, maxsize={self.maxsize}], got {n!r}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            blocked_since = None
            try:
                while True:
                    self._drop_stale(trainer_version)
                    if self._closed or len(self._slots) >= n:
                        break
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        raise TimeoutError(
                            f"only {len(self._slots)} of {n} fresh rollouts after {timeout}s"
                        )
                    if blocked_since is None:
                        blocked_since = self._clock()
                    self._not_empty.wait(remaining)
            finally:
                if blocked_since is not None:
                    self._rollout_wait_s += self._clock() - blocked_since
            now = self._clock()
            taken = [self._slots.popleft() for _ in range(min(n, len(self._slots)))]
            if taken:
                self._not_full.notify_all()
            batch = [
                Entry(s.item, s.version, trainer_version - s.version, now - s.enqueued_at)
                for s in taken
            ]
            self._record_delivery(batch)
            return batch

    def _drop_stale(self, trainer_version: int) -> None:
        """Remove every item lagging `trainer_version` by more than `max_staleness` (lock held)."""
        fresh = deque(s for s in self._slots if trainer_version - s.version <= self.max_staleness)
        dropped = len(self._slots) - len(fresh)
        if dropped:
            self._slots = fresh
            self._dropped_stale += dropped
            self._not_full.notify_all()  # dropping made room for producers

    def _record_delivery(self, batch: list[Entry[T]]) -> None:
        """Update the staleness and time-in-queue metrics for a delivered batch (lock held)."""
        self._delivered += len(batch)
        for e in batch:
            self._staleness_hist[e.staleness] = self._staleness_hist.get(e.staleness, 0) + 1
        if batch:
            self._last_staleness_mean = sum(e.staleness for e in batch) / len(batch)
            self._last_staleness_max = max(e.staleness for e in batch)
            self._last_time_in_queue_mean_s = sum(e.time_in_queue_s for e in batch) / len(batch)
        else:
            self._last_staleness_mean = 0.0
            self._last_staleness_max = 0
            self._last_time_in_queue_mean_s = 0.0

    # ------------------------------------------------------------------ lifecycle and metrics
    def close(self) -> None:
        """Stop accepting items and wake every blocked producer and consumer. Idempotent."""
        with self._lock:
            self._closed = True
            self._not_full.notify_all()
            self._not_empty.notify_all()

    @property
    def closed(self) -> bool:
        """True once `close()` has been called."""
        with self._lock:
            return self._closed

    def __len__(self) -> int:
        with self._lock:
            return len(self._slots)

    def stats(self) -> dict[str, Any]:
        """A snapshot of the metrics listed in the module docstring; reading resets nothing."""
        with self._lock:
            return {
                "sample/rollout_queue_size": len(self._slots),
                "sample/rollout_queue_maxsize": self.maxsize,
                "rollout/backpressure_cumulative_s": self._backpressure_s,
                "perf/rollout_wait_cumulative_s": self._rollout_wait_s,
                "sample/enqueued": self._enqueued,
                "sample/delivered": self._delivered,
                "sample/dropped_stale_cumulative": self._dropped_stale,
                "sample/staleness_mean": self._last_staleness_mean,
                "sample/staleness_max": self._last_staleness_max,
                "sample/time_in_queue_mean_s": self._last_time_in_queue_mean_s,
                "sample/staleness_hist": dict(sorted(self._staleness_hist.items())),
            }

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"RolloutBuffer({len(self)}/{self.maxsize} items, "
            f"max_staleness={self.max_staleness}, {state})"
        )
