"""Replay a GRPO rollout workload through `PrefixRouter` in simulated time (no HTTP, no GPU).

A discrete-event simulation shaped like the blog's run: how often prefix affinity hits, for any
number of replicas, in a second (benchmarks/routing_replay.py). The workload and its
assumptions: docs/internals.md, "The routing replay".
"""

from __future__ import annotations

import dataclasses
import heapq
import random
import time
from dataclasses import dataclass, field

from grpo_lab.proxy.router import PrefixRouter, RouterConfig


@dataclass
class ReplayConfig:
    """The simulated workload; the defaults are the blog's run (docs/recipe.md)."""

    num_problems: int = 1460
    """Distinct prompts (the blog's sanity set of MATH problems)."""
    prompts_issued: int = 8091
    """Prompts sent in all, cycling through shuffled epochs (8,091 x 8 = 64,728 rollouts)."""
    group_size: int = 8
    """G: rollouts per prompt. At least 1 in G requests is cold, so unmatched >= 1/G."""
    prompts_per_step: int = 16
    """Prompts per optimizer step (16 x 8 = 128 rollouts per step)."""
    max_inflight: int = 128
    """Client cap on concurrent requests (TRL's default before the blog lifted it to 384)."""
    sync_every_steps: int = 4
    """Optimizer steps between adapter syncs (the blog: 126 syncs in 500 steps, about 4)."""
    template_tokens: int = 23
    """Chat template + system prompt shared by every prompt (the blog's data: 23 tokens)."""
    problem_median_tokens: float = 80.0
    """Median length of a problem's own tokens (lognormal)."""
    problem_sigma: float = 0.5
    """Sigma of log(problem length)."""
    problem_min_tokens: int = 30
    """Shortest problem (clip)."""
    problem_max_tokens: int = 400
    """Longest problem (clip)."""
    completion_median_s: float = 20.0
    """Median request time in simulated seconds (lognormal)."""
    completion_sigma: float = 0.8
    """Sigma of log(request time): long-tailed, like completions of up to 3,000 tokens. The
    mean (27.5 s) gives 128 rollouts per ~27 s at 128 in flight, near the blog's run 1 step."""
    train_step_s: float = 4.8
    """Trainer time per optimizer step (the blog's run 5 p50): generation stays the bottleneck."""
    sync_s: float = 8.5
    """Save + load time of one adapter sync (the blog's p50) before the new name is in use."""
    vocab_size: int = 151_936
    """Token ids are drawn uniformly below this (Qwen2.5's vocabulary)."""
    router: RouterConfig = field(default_factory=RouterConfig)
    """The router under test."""


def make_prompts(cfg: ReplayConfig, rng: random.Random) -> list[list[int]]:
    """The problem set: one shared template followed by each problem's own random tokens."""
    template = [rng.randrange(cfg.vocab_size) for _ in range(cfg.template_tokens)]
    prompts = []
    for _ in range(cfg.num_problems):
        n = round(rng.lognormvariate(0.0, cfg.problem_sigma) * cfg.problem_median_tokens)
        n = min(max(n, cfg.problem_min_tokens), cfg.problem_max_tokens)
        prompts.append(template + [rng.randrange(cfg.vocab_size) for _ in range(n)])
    return prompts


def training_order(cfg: ReplayConfig, rng: random.Random) -> list[int]:
    """Problem indices in the order the trainer asks for them: shuffled epochs, concatenated."""
    order: list[int] = []
    while len(order) < cfg.prompts_issued:
        epoch = list(range(cfg.num_problems))
        rng.shuffle(epoch)
        order.extend(epoch)
    return order[: cfg.prompts_issued]


def replay(
    num_replicas: int = 2, config: ReplayConfig | None = None, seed: int = 0, **overrides
) -> dict:
    """Simulate the workload against a `PrefixRouter` over `num_replicas` replicas.

    `overrides` replace fields of `config` (e.g. `prompts_issued=200`). Returns the router's
    stats plus the workload's shape, the 1/G floor and where the unmatched requests came from.
    """
    cfg = dataclasses.replace(config or ReplayConfig(), **overrides)
    rng = random.Random(seed)
    started = time.perf_counter()
    prompts = make_prompts(cfg, rng)
    order = training_order(cfg, rng)
    router = PrefixRouter(num_replicas, cfg.router)

    G = cfg.group_size
    total = len(order) * G
    rollouts_per_step = cfg.prompts_per_step * G
    by_rollout = {"affinity": [0] * G, "spill": [0] * G, "unmatched": [0] * G}
    version = steps = issued = finished = 0
    now = trainer_free = 0.0
    running: list[tuple[float, int, str]] = []  # heap of (finish time, request id, replica)
    syncs: list[float] = []  # times at which the next adapter name comes into use (ascending)

    def issue() -> None:
        # Stage 1: the next rollout in training order, under the current adapter name
        nonlocal issued
        prompt = prompts[order[issued // G]]
        decision = router.route(prompt, f"policy-v{version}")
        by_rollout[decision.kind][issued % G] += 1
        duration = rng.lognormvariate(0.0, cfg.completion_sigma) * cfg.completion_median_s
        heapq.heappush(running, (now + duration, issued, decision.replica))
        issued += 1

    while issued < min(total, cfg.max_inflight):
        issue()
    while running:
        # Stage 2: the earliest request finishes; syncs that completed before it take effect
        now, _, replica = heapq.heappop(running)
        router.finish(replica)
        finished += 1
        while syncs and syncs[0] <= now:
            syncs.pop(0)
            version += 1
        # Stage 3: every 128 finished rollouts the trainer runs a step; some steps end in a sync
        if finished % rollouts_per_step == 0:
            trainer_free = max(now, trainer_free) + cfg.train_step_s
            steps += 1
            if steps % cfg.sync_every_steps == 0:
                trainer_free += cfg.sync_s
                syncs.append(trainer_free)
        # Stage 4: the freed slot goes to the next rollout
        if issued < total:
            issue()

    stats = router.stats()
    floor = 100.0 / G
    return {
        "num_replicas": num_replicas,
        "seed": seed,
        "rollouts": total,
        "prompts": len(order),
        "epochs": round(len(order) / cfg.num_problems, 2),
        "group_size": G,
        "steps": steps,
        "syncs": version,  # adapter versions that came into use while requests were issued
        "unmatched_floor_pct": round(floor, 2),
        "unmatched_above_floor_pct": round(stats["unmatched_pct"] - floor, 2),
        # which rollout of its group (0 = first) each kind of decision landed on
        "by_rollout_index": by_rollout,
        "simulated_s": round(now, 1),
        "wall_s": round(time.perf_counter() - started, 2),
        **stats,
        "config": dataclasses.asdict(cfg),
    }
