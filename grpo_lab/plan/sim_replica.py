"""The pipeline simulator's actors: a replica that decodes its sequences together, a sequence,
a group (grpo_lab.plan.simulator moves them through the client, the buffer and the trainer).

A replica's running sequences share one clock, `done`, its decode steps so far: each step takes
grpo_lab.plan.sim_model.decode_step_s for its batch and context, divided by `speed`, the share
of a core the replica gets when more busy processes than cores share a CPU machine (1.0 on a
GPU). Prefill stalls the replica; a full replica (`max_num_seqs`) queues the rest.
"""

from __future__ import annotations

import heapq

from .sim_model import StageCosts, decode_step_s


class Replica:
    """One inference server: its running sequences advance one token per decode step."""

    def __init__(self, costs: StageCosts):
        self.costs = costs
        self.done = 0.0  # decode steps made so far (the sequences' shared clock)
        self.last = 0.0  # time `done` was brought up to
        self.stall_until = 0.0  # prefill in progress: no decode step before then
        self.paused = False
        self.running: list[tuple[float, int, object]] = []  # (finish at `done`, id, request)
        self.waiting: list = []  # over max_num_seqs: queued at the replica
        self.context = 0.0  # prompt tokens + sum of starts' negatives: context = this + B*done
        self.inflight = 0  # requests routed here, not finished
        self.next = float("inf")  # when its first running sequence finishes
        self.admitted = 0
        self.speed = 1.0  # its share of a core (grpo_lab.plan.simulator's core sharing)

    def step_s(self) -> float:
        batch = len(self.running)
        return decode_step_s(self.costs, batch, self.context + batch * self.done) / self.speed

    @property
    def busy(self) -> bool:
        return bool(self.running) and not self.paused

    def finish_time(self) -> float:
        return self.next

    def advance(self, now: float) -> None:
        if not self.paused and self.running:
            start = max(self.last, self.stall_until)
            if now > start:
                self.done += (now - start) / self.step_s()
        self.last = now

    def refresh(self) -> None:
        """Set `next`, when the first running sequence finishes (after a change, at `last`)."""
        if self.paused or not self.running:
            self.next = float("inf")
        else:
            start = max(self.last, self.stall_until)
            self.next = start + max(0.0, self.running[0][0] - self.done) * self.step_s()

    def admit(self, now: float, seq) -> None:
        """Start a sequence (prefill, then decode)."""
        self.stall_until = max(self.stall_until, now) + seq.prefill * self.costs.prefill_token_s
        self.admitted += 1  # ties finish in admission order (not by id(): the same each run)
        heapq.heappush(self.running, (self.done + seq.length, self.admitted, seq))
        self.context += seq.prompt - self.done

    def finished(self, now: float) -> list:
        out = []
        while self.running and self.running[0][0] <= self.done + 1e-6:
            finish, _, seq = heapq.heappop(self.running)
            self.context -= seq.prompt - (finish - seq.length)  # it started at finish - length
            out.append(seq)
        while self.waiting and len(self.running) < self.costs.max_num_seqs:
            self.admit(now, self.waiting.pop(0))
        return out


class Seq:
    """One completion of a group, as a replica decodes it."""

    __slots__ = ("group", "prompt", "length", "prefill", "request")

    def __init__(self, group, prompt, length, prefill, request):
        self.group, self.prompt, self.length = group, prompt, length
        self.prefill, self.request = prefill, request


class Group:
    """One prompt's G completions: sampled by `version`, scored once all are done."""

    def __init__(self, prompt: int, lengths: list[int], version: int, batch: int):
        self.prompt, self.lengths, self.version, self.batch = prompt, lengths, version, batch
        self.left = len(lengths)
        self.owner: int | None = None  # the replica holding its prefix
        self.queued_at = 0.0
