"""Tests for `grpo_lab.rollout.buffer`: blocking, staleness, metrics, and properties.

Blocking tests never rely on sleeps to know that a thread is waiting: a `FakeClock` sets an
event when the buffer reads it just before `Condition.wait`, and the lock is held until the wait
releases it, so the main thread's next call is guaranteed to find the other thread blocked. Every
join has a timeout, so a bug shows up as a failure, never as a hang.
"""

from __future__ import annotations

import itertools
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from grpo_lab.rollout.buffer import Entry, RolloutBuffer

JOIN_S = 5.0  # generous bound on any thread's exit; reaching it means a lost wake-up


class FakeClock:
    """A clock the test moves by hand; `read` is set on every reading."""

    def __init__(self) -> None:
        self.now = 0.0
        self.read = threading.Event()

    def __call__(self) -> float:
        self.read.set()
        return self.now


def start(target, *args) -> tuple[threading.Thread, dict]:
    """Run `target(*args)` in a daemon thread; its return value or exception lands in `out`."""
    out: dict = {}

    def body():
        try:
            out["result"] = target(*args)
        except BaseException as exc:  # reported by the test, not lost in the thread
            out["error"] = exc

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


def start_blocked(clock: FakeClock, target, *args) -> tuple[threading.Thread, dict]:
    """Start `target` and return once it is about to wait (it read the clock under the lock)."""
    clock.read.clear()
    thread, out = start(target, *args)
    assert clock.read.wait(JOIN_S), "thread never reached the buffer"
    return thread, out


# ---------------------------------------------------------------------------- unit tests
@pytest.mark.parametrize(
    "maxsize, max_staleness, match",
    [(0, 1, "maxsize"), (-3, 1, "maxsize"), (2, -1, "max_staleness"), (1.5, 1, "maxsize")],
)
def test_invalid_constructor_args(maxsize, max_staleness, match):
    with pytest.raises(ValueError, match=match):
        RolloutBuffer(maxsize, max_staleness)


@pytest.mark.parametrize("n", [0, -1, 4])
def test_get_rejects_batch_that_cannot_fit(n):
    with pytest.raises(ValueError, match="n must be"):
        RolloutBuffer(3, 0).get(n, trainer_version=0)


def test_fifo_order_and_entry_fields():
    clock = FakeClock()
    buf = RolloutBuffer(maxsize=4, max_staleness=2, clock=clock)
    for i in range(4):
        clock.now = float(i)
        assert buf.put(f"group{i}", version=i)
    clock.now = 10.0
    batch = buf.get(3, trainer_version=3, timeout=JOIN_S)
    assert [e.item for e in batch] == ["group1", "group2", "group3"]  # group0 lagged 3 > 2
    assert batch[0] == Entry("group1", version=1, staleness=2, time_in_queue_s=9.0)
    assert len(buf) == 0


def test_stale_items_dropped_and_counted_exactly():
    buf = RolloutBuffer(maxsize=8, max_staleness=1)
    for v in [0, 3, 1, 2, 3, 0]:
        buf.put(v, version=v)
    batch = buf.get(3, trainer_version=3, timeout=JOIN_S)  # lags 3, 0, 2, 1, 0, 3: keep lag <= 1
    assert [e.version for e in batch] == [3, 2, 3]
    stats = buf.stats()
    assert stats["sample/dropped_stale_cumulative"] == 3
    assert stats["sample/delivered"] == 3
    assert stats["sample/staleness_mean"] == pytest.approx(1 / 3)
    assert stats["sample/staleness_max"] == 1
    assert stats["sample/staleness_hist"] == {0: 2, 1: 1}


def test_staleness_metrics_cover_last_batch_and_histogram_is_cumulative():
    clock = FakeClock()
    buf = RolloutBuffer(maxsize=4, max_staleness=4, clock=clock)
    buf.put("a", 0)
    clock.now = 2.0
    buf.put("b", 1)
    clock.now = 5.0
    buf.get(2, trainer_version=2, timeout=JOIN_S)  # lags 2 and 1, queued 5 s and 3 s
    stats = buf.stats()
    assert (stats["sample/staleness_mean"], stats["sample/staleness_max"]) == (1.5, 2)
    assert stats["sample/time_in_queue_mean_s"] == 4.0
    buf.put("c", 2)
    buf.get(1, trainer_version=2, timeout=JOIN_S)
    stats = buf.stats()
    assert (stats["sample/staleness_mean"], stats["sample/staleness_max"]) == (0.0, 0)
    assert stats["sample/time_in_queue_mean_s"] == 0.0
    assert stats["sample/staleness_hist"] == {0: 1, 1: 1, 2: 1}


def test_put_blocks_when_full_and_get_unblocks_it_with_backpressure_measured():
    clock = FakeClock()
    buf = RolloutBuffer(maxsize=2, max_staleness=0, clock=clock)
    buf.put("a", 0)
    buf.put("b", 0)
    assert buf.stats()["sample/rollout_queue_size"] == buf.stats()["sample/rollout_queue_maxsize"]
    producer, out = start_blocked(clock, buf.put, "c", 0)
    clock.now = 1.5  # the producer waits 1.5 "seconds" for room
    assert [e.item for e in buf.get(1, trainer_version=0, timeout=JOIN_S)] == ["a"]
    producer.join(JOIN_S)
    assert not producer.is_alive() and out == {"result": True}
    assert buf.stats()["rollout/backpressure_cumulative_s"] == 1.5
    assert buf.stats()["perf/rollout_wait_cumulative_s"] == 0.0
    assert [e.item for e in buf.get(2, trainer_version=0, timeout=JOIN_S)] == ["b", "c"]


def test_get_blocks_until_n_items_with_rollout_wait_measured():
    clock = FakeClock()
    buf = RolloutBuffer(maxsize=4, max_staleness=0, clock=clock)
    consumer, out = start_blocked(clock, buf.get, 2, 0)
    clock.now = 0.5
    buf.put("a", 0)  # one is not enough: the consumer keeps waiting
    clock.now = 2.0
    buf.put("b", 0)
    consumer.join(JOIN_S)
    assert not consumer.is_alive() and "error" not in out
    assert [e.item for e in out["result"]] == ["a", "b"]
    assert buf.stats()["perf/rollout_wait_cumulative_s"] == 2.0
    assert buf.stats()["rollout/backpressure_cumulative_s"] == 0.0


class RealClock(FakeClock):
    """The buffer's default clock (`time.perf_counter`), with `read` set on every reading and
    the readings kept."""

    def __init__(self) -> None:
        super().__init__()
        self.readings: list[float] = []

    def __call__(self) -> float:
        self.now = time.perf_counter()
        self.readings.append(self.now)
        self.read.set()
        return self.now


def test_rollout_wait_with_the_real_clock():
    clock = RealClock()
    buf = RolloutBuffer(maxsize=1, max_staleness=0, clock=clock)
    consumer, out = start_blocked(clock, buf.get, 1, 0)  # waiting, not about to
    blocked_since = clock.readings[0]
    while time.perf_counter() <= blocked_since:  # real time passes while it waits
        pass
    buf.put("a", 0)
    consumer.join(JOIN_S)
    assert not consumer.is_alive() and [e.item for e in out["result"]] == ["a"]
    # the wait ran from the consumer's first reading to its reading after the wake-up
    waited = buf.stats()["perf/rollout_wait_cumulative_s"]
    assert waited > 0.0 and waited in [r - blocked_since for r in clock.readings]
    assert out["result"][0].time_in_queue_s >= 0.0


def test_timeouts_raise_and_take_nothing():
    buf = RolloutBuffer(maxsize=2, max_staleness=0)
    buf.put("a", 0)
    with pytest.raises(TimeoutError):
        buf.get(2, trainer_version=0, timeout=0.01)
    assert len(buf) == 1  # the timed-out get left "a" in place
    buf.put("b", 0)
    with pytest.raises(TimeoutError):
        buf.put("c", 0, timeout=0)
    assert [e.item for e in buf.get(2, 0, timeout=JOIN_S)] == ["a", "b"]
    assert buf.stats()["sample/enqueued"] == 2


def test_a_put_wakes_every_consumer_not_just_the_first_waiter():
    # Each consumer waits for its own n; waking only the first (who wants 2) would strand B.
    # No timeouts on the blocked calls (a timed-out wait re-checks and would hide a lost
    # wake-up); the join is bounded and `close()` in `finally` frees any straggler.
    clock = FakeClock()
    buf = RolloutBuffer(maxsize=4, max_staleness=0, clock=clock)
    try:
        a, out_a = start_blocked(clock, buf.get, 2, 0)
        b, out_b = start_blocked(clock, buf.get, 1, 0)
        buf.put("x", 0)
        b.join(JOIN_S)
        assert not b.is_alive(), "the put woke only the first waiting consumer"
        assert [e.item for e in out_b["result"]] == ["x"]
    finally:
        buf.close()  # releases A with nothing
    a.join(JOIN_S)
    assert out_a == {"result": []}


def test_a_get_wakes_every_producer_it_made_room_for():
    clock = FakeClock()
    buf = RolloutBuffer(maxsize=2, max_staleness=0, clock=clock)
    buf.put("a", 0)
    buf.put("b", 0)
    try:
        producers = [start_blocked(clock, buf.put, item, 0) for item in "cd"]
        buf.get(2, trainer_version=0, timeout=JOIN_S)
        for thread, out in producers:
            thread.join(JOIN_S)
            assert not thread.is_alive(), "the get woke only one of the producers"
            assert out == {"result": True}
    finally:
        buf.close()
    assert len(buf) == 2


def test_dropping_stale_items_makes_room_for_a_blocked_producer():
    clock = FakeClock()
    buf = RolloutBuffer(maxsize=2, max_staleness=1, clock=clock)
    buf.put("old0", 0)
    buf.put("old1", 0)
    try:
        producer, out = start_blocked(clock, buf.put, "new", 5)
        # The trainer at v5 drops both old items; only then is there room for "new".
        batch = buf.get(1, trainer_version=5, timeout=JOIN_S)
        assert [(e.item, e.staleness) for e in batch] == [("new", 0)]
        producer.join(JOIN_S)
        assert out == {"result": True}
    finally:
        buf.close()
    assert buf.stats()["sample/dropped_stale_cumulative"] == 2


def test_close_wakes_a_blocked_producer():
    clock = FakeClock()
    buf = RolloutBuffer(maxsize=1, max_staleness=0, clock=clock)
    buf.put("a", 0)
    producer, out = start_blocked(clock, buf.put, "b", 0)
    buf.close()
    producer.join(JOIN_S)
    assert not producer.is_alive() and out == {"result": False}
    assert buf.closed and len(buf) == 1


def test_close_wakes_a_blocked_consumer_which_gets_the_rest():
    clock = FakeClock()
    buf = RolloutBuffer(maxsize=4, max_staleness=0, clock=clock)
    buf.put("a", 0)
    consumer, out = start_blocked(clock, buf.get, 3, 0)
    buf.close()
    consumer.join(JOIN_S)
    assert not consumer.is_alive() and "error" not in out
    assert [e.item for e in out["result"]] == ["a"]  # fewer than n: what was left


def test_after_close_put_fails_and_get_drains_without_blocking():
    buf = RolloutBuffer(maxsize=4, max_staleness=1)
    for i in range(3):
        buf.put(i, version=i)
    buf.close()
    buf.close()  # idempotent
    assert buf.put("late", 2) is False
    # Item 0 lags 2 > 1: dropped even after close.
    assert [e.item for e in buf.get(1, trainer_version=2, timeout=JOIN_S)] == [1]
    assert [e.item for e in buf.get(4, trainer_version=2, timeout=JOIN_S)] == [2]
    assert buf.get(4, trainer_version=2, timeout=JOIN_S) == []
    assert buf.stats()["sample/dropped_stale_cumulative"] == 1
    assert "closed" in repr(buf)


# ---------------------------------------------------------------------------- properties
class BufferMatchesModel(RuleBasedStateMachine):
    """Single-threaded, non-blocking ops (`timeout=0`) checked against a list-based model."""

    @initialize(maxsize=st.integers(1, 5), max_staleness=st.integers(0, 3))
    def make(self, maxsize, max_staleness):
        self.buf = RolloutBuffer(maxsize, max_staleness)
        self.queue: list[tuple[int, int]] = []  # model: (item id, version), oldest first
        self.trainer_version = 0
        self.next_id = 0
        self.delivered: list[int] = []
        self.dropped = 0
        self.closed = False

    @rule(lag=st.integers(0, 5))
    def put(self, lag):
        item, version = self.next_id, self.trainer_version - lag
        self.next_id += 1
        if self.closed:
            assert self.buf.put(item, version, timeout=0) is False
        elif len(self.queue) >= self.buf.maxsize:
            with pytest.raises(TimeoutError):
                self.buf.put(item, version, timeout=0)
        else:
            assert self.buf.put(item, version, timeout=0) is True
            self.queue.append((item, version))

    @rule(step=st.integers(1, 3))
    def bump_version(self, step):
        self.trainer_version += step

    @rule(data=st.data())
    def get(self, data):
        n = data.draw(st.integers(1, self.buf.maxsize))
        lag_ok = self.buf.max_staleness
        fresh = [(i, v) for i, v in self.queue if self.trainer_version - v <= lag_ok]
        self.dropped += len(self.queue) - len(fresh)
        self.queue = fresh
        if not self.closed and len(fresh) < n:
            with pytest.raises(TimeoutError):
                self.buf.get(n, self.trainer_version, timeout=0)
            return
        batch = self.buf.get(n, self.trainer_version, timeout=0)
        expected, self.queue = self.queue[:n], self.queue[n:]
        assert [(e.item, e.version) for e in batch] == expected  # FIFO, nothing skipped
        assert all(e.staleness == self.trainer_version - e.version for e in batch)
        assert all(e.staleness <= self.buf.max_staleness for e in batch)
        self.delivered += [e.item for e in batch]

    @precondition(lambda self: not self.closed)
    @rule()
    def close(self):
        self.buf.close()
        self.closed = True

    @invariant()
    def conserved_and_bounded(self):
        stats = self.buf.stats()
        assert len(self.buf) == len(self.queue) <= self.buf.maxsize
        assert stats["sample/dropped_stale_cumulative"] == self.dropped
        assert stats["sample/delivered"] == len(self.delivered) == len(set(self.delivered))
        assert stats["sample/enqueued"] == len(self.delivered) + self.dropped + len(self.queue)
        assert sum(stats["sample/staleness_hist"].values()) == len(self.delivered)


BufferMatchesModel.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
test_buffer_matches_model = BufferMatchesModel.TestCase


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    maxsize=st.integers(1, 4),
    max_staleness=st.integers(0, 2),
    producers=st.lists(st.lists(st.integers(0, 4), max_size=15), min_size=1, max_size=3),
    consumers=st.lists(
        st.tuples(st.integers(1, 4), st.lists(st.integers(0, 4), min_size=1, max_size=4)),
        min_size=1,
        max_size=3,
    ),
)
def test_concurrent_producers_and_consumers_conserve_items(
    maxsize, max_staleness, producers, consumers
):
    """Each producer puts its list of versions; each consumer cycles its trainer versions."""
    buf = RolloutBuffer(maxsize, max_staleness)

    def produce(p, versions):
        return sum(buf.put((p, seq), v, timeout=JOIN_S) for seq, v in enumerate(versions))

    def consume(n, trainer_versions):
        got, n = [], min(n, maxsize)
        for k in itertools.count():
            batch = buf.get(n, trainer_versions[k % len(trainer_versions)], timeout=JOIN_S)
            if not batch:  # only once closed and drained
                return got
            got += batch

    prod = [start(produce, p, versions) for p, versions in enumerate(producers)]
    cons = [start(consume, n, tvs) for n, tvs in consumers]
    for thread, _ in prod:
        thread.join(JOIN_S)
    buf.close()
    for thread, _ in prod + cons:
        thread.join(JOIN_S)
    assert not any(thread.is_alive() for thread, _ in prod + cons)
    assert not [out["error"] for _, out in prod + cons if "error" in out]

    put_ok = sum(out["result"] for _, out in prod)
    delivered = [e for _, out in cons for e in out["result"]]
    stats = buf.stats()
    assert put_ok == len(delivered) + stats["sample/dropped_stale_cumulative"] + len(buf)
    assert len(buf) == 0  # consumers drain the closed buffer before they stop
    assert len({e.item for e in delivered}) == len(delivered)  # nothing delivered twice
    assert all(e.staleness <= max_staleness for e in delivered)
    for _, out in cons:  # FIFO: each consumer sees each producer's items in put order
        for p in range(len(producers)):
            seqs = [e.item[1] for e in out["result"] if e.item[0] == p]
            assert seqs == sorted(seqs)
