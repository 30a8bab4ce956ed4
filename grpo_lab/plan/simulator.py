"""A simulator of the asynchronous GRPO pipeline: the blog's (or this course's) run, in seconds.

Discrete events over replicas, the client, the rollout buffer, the trainer and the weight syncs
(docs/recipe.md, "Reading the pipeline"), with the stage costs of grpo_lab.plan.sim_model:
- replicas decode their sequences together (continuous batching): a step's time grows with the
  batch and its context, so a replica's tokens/s saturates; prefill stalls it, the prefix cache
  spares the later completions of a group most of their prompt;
- the client keeps at most `max_inflight` requests out; the proxy sends a prompt's requests to
  the replica that has its prefix unless that one has `PROXY_IMBALANCE` more than the least
  busy (then the least busy: a spill);
- the buffer holds `buffer_size` groups: a full one blocks the worker (backpressure), the
  trainer drops groups more than `max_staleness` versions old;
- the trainer's step is its micro-batches' forward and backward (grpo_lab.plan.sim_model);
  every `weight_sync_steps` steps a sync pauses the replicas and the trainer;
- on a CPU machine (`StageCosts.cores`) the busy single-thread processes (the training trainer,
  each decoding replica, the proxy while requests are in flight) share the cores: each runs at
  min(1, cores / busy) of its speed, re-set at every change of who is busy (`reshare`); an
  approximation: a process is busy or not, and threads inside one process are not counted.
`simulate` returns one record per step under the names the real trainer logs (docs/metrics.md),
so grpo_lab.watch.diagnose and the plots read a simulated run like a real one. The blog's runs
and the calibration: grpo_lab.plan.sim_blog.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import replace

from .sim_model import (
    LengthSampler,
    PipelineSetting,
    StageCosts,
    fwd_bwd_s,
    micro_batches,
    sync_s,
    train_flops,
)
from .sim_records import step_record
from .sim_replica import Group, Replica, Seq

PROXY_IMBALANCE = 8
"""The proxy's PROXY_IMBALANCE: the affinity replica is kept while it has at most this many
more requests in flight than the least busy one."""


def simulate(setting: PipelineSetting, costs: StageCosts, *, steps: int | None = None,
             seed: int = 0) -> list[dict]:
    """Simulate `steps` (default `setting.steps`) trainer steps; one record per step."""
    return Simulation(replace(setting, steps=steps or setting.steps), costs, seed).run()


class Simulation:
    def __init__(self, setting: PipelineSetting, costs: StageCosts, seed: int):
        s = self.s = setting
        self.costs, self.rng = costs, random.Random(seed)
        self.lengths = LengthSampler(s, self.rng)
        self.replicas = [Replica(costs) for _ in range(s.replicas)]
        self.events: list = []  # (time, order, callback)
        self.order = 0
        self.now = 0.0
        self.version = 0
        self.buffer: list[Group] = []
        self.blocked: list[Group] = []  # scored, waiting for room (backpressure)
        self.blocked_since: float | None = None
        self.requests: deque[list[Seq]] = deque()  # not yet sent, oldest first
        self.inflight = 0
        self.batch_index = 0
        self.batch_left = 0  # groups of the current batch not yet put ("batch" worker)
        self.admission_since: float | None = None
        self.batch_done: list[Group] = []  # generated groups of the current batch
        self.records: list[dict] = []
        self.step = 0
        self.waiting_since: float | None = 0.0  # the trainer waits for a batch
        self.step_start = 0.0
        self.queue_seen = 0
        self.c = dict(backpressure=0.0, version_wait=0.0, tokens=0, dropped=0, inflight_max=0,
                      wait=0.0, cache_queries=0, cache_hits=0)
        self.proxy = setting.replicas > 1 if setting.proxy is None else setting.proxy
        self.speed, self.training, self.ticket = 1.0, False, 0  # cores shared: reshare

    # ---------------------------------------------------------------- event plumbing
    def at(self, time: float, callback) -> None:
        self.order += 1
        heapq.heappush(self.events, (time, self.order, callback))

    def run(self) -> list[dict]:
        self.new_batch() if self.s.worker == "batch" else self.fill()
        while len(self.records) < self.s.steps:
            t_ev = self.events[0][0] if self.events else float("inf")
            rep = min(self.replicas, key=Replica.finish_time)
            t_rep = rep.next
            if min(t_ev, t_rep) == float("inf"):
                raise RuntimeError("the pipeline stalled (no event left): check the setting")
            if t_rep <= t_ev:
                self.now = t_rep
                self.finish(rep)
            else:
                self.now, _, callback = heapq.heappop(self.events)
                callback()
        return self.records

    # ---------------------------------------------------------------- the client and the proxy
    def new_group(self) -> Group:
        G = self.s.num_generations
        group = Group(self.lengths.prompt(), [self.lengths.completion() for _ in range(G)],
                      self.version, self.batch_index)
        if self.s.request_shape == "group":
            self.requests.append([Seq(group, group.prompt, n, 0, None) for n in group.lengths])
        else:
            self.requests.extend([Seq(group, group.prompt, n, 0, None)] for n in group.lengths)
        return group

    def fill(self) -> None:
        """Send requests while the cap allows (the stream worker also makes new prompts)."""
        # no cap: grpo_lab's batch is bounded anyway; TRL's worker, by a full buffer's worth
        cap = self.s.max_inflight or self.s.buffer_size * self.s.num_generations
        while self.inflight < cap and self.blocked_since is None:
            if not self.requests:
                if self.s.worker == "batch":
                    return
                self.new_group()
            self.send(self.requests.popleft())
        self.c["inflight_max"] = max(self.c["inflight_max"], self.inflight)

    def send(self, request: list[Seq]) -> None:
        group = request[0].group
        loads = [rep.inflight for rep in self.replicas]
        least = loads.index(min(loads))
        owner = group.owner
        cached = owner is not None and loads[owner] <= loads[least] + PROXY_IMBALANCE
        k = owner if cached else least
        group.owner = k if owner is None else owner
        rep = self.replicas[k]
        rep.advance(self.now)
        for i, seq in enumerate(request):  # a prompt's later completions hit its prefix cache
            seq.prefill = self.costs.prefix_tail_tokens if (cached or i) else seq.prompt
            self.c["cache_queries"] += seq.prompt  # vLLM's prefix cache counts prompt tokens
            self.c["cache_hits"] += max(seq.prompt - seq.prefill, 0)
            seq.request = request
            if len(rep.running) < self.costs.max_num_seqs:
                rep.admit(self.now, seq)
            else:
                rep.waiting.append(seq)
        rep.refresh()
        rep.inflight += 1
        self.inflight += 1
        self.reshare()

    def finish(self, rep: Replica) -> None:
        rep.advance(self.now)
        done = rep.finished(self.now)
        rep.refresh()
        for seq in done:
            self.c["tokens"] += seq.length
            seq.request.remove(seq)
            if not seq.request:
                rep.inflight -= 1
                self.inflight -= 1
            seq.group.left -= 1
            if seq.group.left == 0:
                self.generated(seq.group)
        self.fill()
        self.reshare()

    def generated(self, group: Group) -> None:
        """A group is done: TRL's worker scores and queues it alone; grpo_lab's waits for the
        whole batch (one generate call), scores it, then puts its groups in order."""
        score = self.costs.score_group_s
        if self.s.worker != "batch":
            return self.at(self.now + score, lambda: self.put(group))
        self.batch_done.append(group)
        if len(self.batch_done) == self.s.prompts_per_step:
            done, self.batch_done = self.batch_done, []
            self.at(self.now + score * len(done), lambda: [self.put(g) for g in done])

    # ---------------------------------------------------------------- the buffer
    def put(self, group: Group) -> None:
        if self.blocked or len(self.buffer) >= self.s.buffer_size:
            if self.blocked_since is None:
                self.blocked_since = self.now
            self.blocked.append(group)
        else:
            self.enqueue(group)
        self.trainer_try()

    def enqueue(self, group: Group) -> None:
        group.queued_at = self.now
        self.buffer.append(group)
        if self.s.worker == "batch":
            self.batch_left -= 1
            if self.batch_left == 0:
                self.batch_index += 1
                self.new_batch()

    def unblock(self) -> None:
        while self.blocked and len(self.buffer) < self.s.buffer_size:
            self.enqueue(self.blocked.pop(0))
        if not self.blocked and self.blocked_since is not None:
            self.c["backpressure"] += self.now - self.blocked_since
            self.blocked_since = None
            self.fill()

    def new_batch(self) -> None:
        """grpo_lab's worker: admit batch j once the policy is recent enough, then send it."""
        needed = self.batch_index // self.s.weight_sync_steps - self.s.max_staleness
        if self.version < needed:
            if self.admission_since is None:
                self.admission_since = self.now
            return
        if self.admission_since is not None:
            self.c["version_wait"] += self.now - self.admission_since
            self.admission_since = None
        self.batch_left = self.s.prompts_per_step
        for _ in range(self.s.prompts_per_step):
            self.new_group()
        self.fill()

    # ---------------------------------------------------------------- the trainer
    def trainer_try(self) -> None:
        s = self.s
        if self.waiting_since is None:
            return
        fresh = [g for g in self.buffer if self.version - g.version <= s.max_staleness]
        self.c["dropped"] += (len(self.buffer) - len(fresh)) * s.num_generations
        self.buffer = fresh
        self.unblock()
        if len(self.buffer) < s.prompts_per_step:
            return
        taken, self.buffer = self.buffer[:s.prompts_per_step], self.buffer[s.prompts_per_step:]
        self.c["wait"] += self.now - self.waiting_since
        self.waiting_since = None
        self.unblock()
        self.train(taken)

    def train(self, groups: list[Group]) -> None:
        s, costs = self.s, self.costs
        samples = [(g.prompt, n) for g in groups for n in g.lengths]
        rows = samples
        if s.shared_prompt:  # a row per group: the prompt once, then its G completions
            rows = [(g.prompt + sum(g.lengths), 0) for g in groups]
        shares = [rows[k::costs.trainer_gpus] for k in range(costs.trainer_gpus)]
        layouts = [micro_batches(share, s) for share in shares if share]
        fwd_bwd = max(fwd_bwd_s(costs, s, mbs) for mbs in layouts)
        passes = max(len(mbs) for mbs in layouts)
        other = costs.optimizer_s + passes * costs.step_micro_batch_s
        self.taken = dict(groups=groups, samples=samples, layouts=layouts, fwd_bwd=fwd_bwd,
                          flops=train_flops(costs, sum(p + c for p, c in samples), len(samples)),
                          staleness=[self.version - g.version for g in groups],
                          in_queue=[self.now - g.queued_at for g in groups])
        self.work = self.work_total = fwd_bwd + other
        self.work_since = self.train_start = self.now
        self.training = True
        if self.costs.cores is None:  # no sharing: its own device, a fixed time
            return self.at(self.now + fwd_bwd + other, self.trained)
        self.reshare(force=True)

    # ---------------------------------------------------------------- cores shared (CPU runs)
    def reshare(self, force: bool = False) -> None:
        """With `costs.cores`: each busy process (the training trainer, each decoding replica,
        the proxy while requests are in flight) gets min(1, cores / busy) of a core, from now
        until the next change; the trainer's remaining work and the replicas' steps stretch."""
        cores = self.costs.cores
        busy = self.training + sum(rep.busy for rep in self.replicas)
        busy += bool(self.proxy and self.inflight)
        speed = min(1.0, cores / busy) if cores and busy else 1.0
        if speed == self.speed and not force:
            return
        for rep in self.replicas if speed != self.speed else ():
            rep.advance(self.now)
            rep.speed = speed
            rep.refresh()
        if self.training:  # reschedule its end; an older end event is ignored (its ticket)
            self.work -= (self.now - self.work_since) * self.speed if not force else 0.0
            self.work_since, self.ticket = self.now, self.ticket + 1
            self.at(self.now + self.work / speed, lambda k=self.ticket: k == self.ticket
                    and self.trained())
        self.speed = speed

    def trained(self) -> None:
        self.training = False
        if self.costs.cores is not None:  # what the trainer's clock measured, stretched
            self.taken["fwd_bwd"] *= (self.now - self.train_start) / max(self.work_total, 1e-12)
            self.reshare()
        self.step += 1
        if self.step % self.s.weight_sync_steps:
            return self.end_step(0.0)
        seconds, _ = sync_s(self.costs, self.s.replicas, self.rng)
        for rep in self.replicas:  # the replicas stop decoding while the adapter is loaded
            rep.advance(self.now)
            rep.paused = True
            rep.refresh()
        self.reshare()
        self.at(self.now + seconds, lambda: self.synced(seconds))

    def synced(self, seconds: float) -> None:
        for rep in self.replicas:
            rep.last, rep.paused = self.now, False
            rep.stall_until = max(rep.stall_until, self.now)
            rep.refresh()
        self.reshare()
        self.version += 1
        if self.s.worker == "batch" and self.admission_since is not None:
            self.new_batch()
        self.end_step(seconds)

    def end_step(self, sync_seconds: float) -> None:
        c = self.c
        for name, since in (("backpressure", "blocked_since"), ("version_wait", "admission_since")):
            if getattr(self, since) is not None:  # count what is still going on up to now
                c[name] += self.now - getattr(self, since)
                setattr(self, since, self.now)
        record = step_record(self, sync_seconds)
        self.records.append(record)
        for name in ("backpressure", "version_wait", "tokens", "dropped", "wait", "cache_queries",
                     "cache_hits"):
            c[name] = 0.0 if isinstance(c[name], float) else 0
        c["inflight_max"] = self.inflight
        self.step_start = self.now
        self.queue_seen = len(self.buffer)
        self.waiting_since = self.now
        self.trainer_try()

