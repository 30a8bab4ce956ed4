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
so grpo_lab.watch.doctor and the plots read a simulated run like a real one. The blog's runs
and the calibration: grpo_lab.plan.sim_blog.

In reading order: the run (`simulate`), its actors (a replica that decodes its sequences
together, a sequence, a group), and its records under the real trainer's names (`step_record`)
with a run's summary as the blog publishes it (`summarize`).
"""

from __future__ import annotations

import heapq
import random
import statistics
from collections import deque
from dataclasses import replace

from .sim_model import (
    LengthSampler,
    PipelineSetting,
    StageCosts,
    decode_step_s,
    fwd_bwd_s,
    micro_batches,
    sync_s,
    train_flops,
)

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


# ------------------------------------------------------------ the actors
# A replica that decodes its sequences together, a sequence, a group (`Simulation` moves them
# through the client, the buffer and the trainer). A replica's running sequences share one
# clock, `done`, its decode steps so far: each step takes sim_model.decode_step_s for its batch
# and context, divided by `speed`, the share of a core the replica gets when more busy processes
# than cores share a CPU machine (1.0 on a GPU). Prefill stalls the replica; a full replica
# (`max_num_seqs`) queues the rest.


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


# ------------------------------------------------------------ the records
# `step_record` writes what grpo_lab.train.async_trainer logs per step (docs/metrics.md; the
# pipeline's names as grpo_lab.watch.step_metrics writes them) from a simulation's state, so the
# dashboard, the plots and grpo_lab.watch.doctor read a simulated run as a real one. The
# learning metrics (reward, loss, kl, ...) are left out: the simulator knows times, not rewards.
# `summarize` reduces a run (simulated or real) to the figures the blog publishes.


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def step_record(sim, sync_seconds: float) -> dict:
    """The record of the step `sim` (a Simulation) just ended."""
    s, costs, c, t = sim.s, sim.costs, sim.c, sim.taken
    G = s.num_generations
    step_s = sim.now - sim.step_start
    samples = t["samples"]
    mbs = [mb for layout in t["layouts"] for mb in layout]
    rows, real = [mb["tokens"] for mb in mbs], [mb["real"] for mb in mbs]
    completions = [n for _, n in samples]
    unpadded = sum(p + n for p, n in samples)
    held_back = c["backpressure"] + c["version_wait"]
    record = {
        "step": sim.step, "version": sim.version, "time_s": sim.now,
        "perf/step_s": step_s, "perf/fwd_bwd_s": t["fwd_bwd"],
        "perf/optimizer_s": costs.optimizer_s,
        "perf/rollout_wait_s": c["wait"], "perf/weight_sync_s": sync_seconds,
        "rollout/backpressure_total_s": c["backpressure"],
        "rollout/version_wait_s": c["version_wait"],
        "rollout/generated_tok_s_busy": c["tokens"] / max(step_s - held_back, 1e-9),
        "rollout/inflight_max": c["inflight_max"],
        # the replicas' prefix cache (vLLM's prefix_cache_queries / _hits, in prompt tokens): a
        # prompt's later completions, and a group routed back to its replica, skip its prefill
        "rollout/prefix_cache_queries": c["cache_queries"],
        "rollout/prefix_cache_hits": c["cache_hits"],
        "sample/rollout_queue_size": sim.queue_seen * G,
        "sample/rollout_queue_maxsize": s.buffer_size * G,
        "sample/dropped_stale_total": c["dropped"],
        "sample/time_in_queue_s": _mean(t["in_queue"]),
        "sample/staleness_mean": _mean(t["staleness"]),
        "sample/staleness_max": max(t["staleness"]),
        "batch/microbatches_per_step": max(len(layout) for layout in t["layouts"]),
        "batch/groups_per_step": len(t["groups"]), "batch/samples_per_step": len(samples),
        "batch/samples_per_row": len(samples) / len(mbs),
        "batch/row_tokens_mean": _mean(rows), "batch/row_tokens_max": max(rows),
        "batch/pad_frac": (sum(rows) - sum(real)) / max(sum(rows), 1),
        "batch/forwarded_tokens_per_step": sum(rows),
        "batch/trained_tokens_per_step": sum(completions),
        "batch/masked_token_frac": (unpadded - sum(completions)) / max(unpadded, 1),
        "sample/forwarded_tokens_mean": unpadded / len(samples),
        "sample/forwarded_tokens_max": max(p + n for p, n in samples),
        "sample/trained_tokens_mean": _mean(completions),
        "completions/mean_length": _mean(completions),
        "completions/min_length": min(completions), "completions/max_length": max(completions),
        "completions/clipped_ratio": _mean(n >= s.max_completion_tokens for n in completions),
        "perf/forwarded_tok_s_fwd_bwd": sum(rows) / t["fwd_bwd"],
        "perf/forwarded_tok_s_wall_clock": sum(rows) / step_s,
        "perf/trained_tok_s_wall_clock": sum(completions) / step_s,
    }
    if s.token_budget:
        record["batch/row_fill_frac"] = sum(rows) / (s.token_budget * len(rows))
    if costs.trainer_peak_flops:
        peak = costs.trainer_peak_flops * costs.trainer_gpus
        record["perf/mfu_fwd_bwd"] = 100 * t["flops"] / t["fwd_bwd"] / peak
        record["perf/mfu_wall_clock"] = 100 * t["flops"] / step_s / peak
    return record


def summarize(records: list[dict], setting=None, *, idle: float = 0.05) -> dict:
    """A run's figures: medians (`_p50`) over its steps, means where the blog gives means, and
    its bottleneck over the last 80 % of the steps (the first fill the pipeline): "trainer" when
    the trainer waits at most `idle` of its step time, else "generation", or "client_cap" when
    the client's in-flight cap (`setting.max_inflight`) was reached in most of those steps."""
    if not records:
        raise ValueError("no records to summarize")
    steady = records[len(records) // 5:]

    def p50(key):
        return statistics.median(r.get(key, 0.0) for r in records)

    def mean(key, rows=steady):
        return _mean(r.get(key, 0.0) for r in rows)

    syncs = [r["perf/weight_sync_s"] for r in records if r.get("perf/weight_sync_s")]
    wall = records[-1].get("time_s") or sum(r["perf/step_s"] for r in records)
    generated = sum(r.get("rollout/generated_tok_s_busy", 0.0) * max(
        r["perf/step_s"] - r.get("rollout/backpressure_total_s", 0.0)
        - r.get("rollout/version_wait_s", 0.0), 0.0) for r in records)
    wait_share = (sum(r.get("perf/rollout_wait_s", 0.0) for r in steady)
                  / max(sum(r["perf/step_s"] for r in steady), 1e-9))
    cap = getattr(setting, "max_inflight", None)
    capped = cap is not None and _mean(r.get("rollout/inflight_max", 0) >= cap
                                       for r in steady) > 0.5
    bottleneck = "trainer" if wait_share <= idle else "client_cap" if capped else "generation"
    out = {
        "steps": len(records),
        "step_s_p50": p50("perf/step_s"), "fwd_bwd_s_p50": p50("perf/fwd_bwd_s"),
        "rollout_wait_s_p50": p50("perf/rollout_wait_s"),
        "rollout_wait_s_mean": mean("perf/rollout_wait_s"),
        "weight_sync_s_p50": statistics.median(syncs) if syncs else 0.0,
        "weight_sync_share": sum(syncs) / max(wall, 1e-9),
        "wall_clock_s": wall,
        "staleness_mean": _mean(r.get("sample/staleness_mean", 0.0) for r in records),
        "queue_size_p50": p50("sample/rollout_queue_size"),
        "queue_size_mean": mean("sample/rollout_queue_size"),
        "queue_maxsize": records[-1].get("sample/rollout_queue_maxsize", 0),
        "backpressure_s_mean": mean("rollout/backpressure_total_s"),
        "version_wait_s_mean": mean("rollout/version_wait_s"),
        "generation_tokens_per_s": generated / max(wall, 1e-9),
        "inflight_mean": mean("rollout/inflight_max"),
        "micro_batches": p50("batch/microbatches_per_step"),
        "samples_per_row": p50("batch/samples_per_row"),
        "row_fill_frac": p50("batch/row_fill_frac"),
        "mfu": p50("perf/mfu_fwd_bwd"),
        "prefix_cache_hit_rate": sum(r.get("rollout/prefix_cache_hits", 0) for r in records)
        / max(sum(r.get("rollout/prefix_cache_queries", 0) for r in records), 1),
        "wait_share": wait_share,
        "bottleneck": bottleneck,
    }
    return out
