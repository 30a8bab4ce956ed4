"""Plan before you pay: which HF Jobs flavors, how many replicas, what in-flight cap, token
budget and `max_staleness`, and the wall clock and bill the pipeline simulator predicts.

    plan_run("qwen2.5-math-1.5b", deadline_h=2)   the cheapest plan that ends within 2 hours
    plan_run(1.5e9, budget_usd=40)                 the fastest plan that costs at most $40
    forecast_plan(preset_config("blog"))           the forecast of one exact plan (no search)

The search, every point through grpo_lab.plan.simulator (steps 2-4 of plan_run):
1. memory first (grpo_lab.plan.run_forecast): each trainer flavor's largest token budget
   (TOKEN_BUDGETS_X) within TRAINER_MEMORY_FRACTION of a GPU, checkpointing off if it can; each
   replica flavor's caps whose KV cache fits `gpu_memory_utilization`; flavors another beats on
   every count (price, speed, memory) are dropped;
2. a screen: each trainer fed by the fastest replicas, each replica set drained by the fastest
   trainer: a pair's step is about the slower of the two;
3. the pairs the screen cannot rule out, simulated at their largest cap and staleness;
4. the cost-time front of those again at every cap in INFLIGHT_CAPS, then every STALENESS.
Each candidate is estimated from SEARCH_STEPS simulated steps; the best few are then simulated
over every step and ranked again (step 5), so the plan chosen and the budget and deadline it meets
are the figures printed. Then the cheapest candidate that meets the deadline, or the fastest
within the budget. The candidates never depend on the budget or deadline, so a tighter budget
never picks a dearer plan. Cost: every job's hourly price x (the wall clock + STARTUP_S); the
proxy runs inside the trainer job (grpo_lab.launch.recipe_plan); each replica pays for its
exposed port.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

from ..launch.recipe_config import BLOG_TRAINING, HF_BLOG_MODEL, RecipeConfig
from ..model.memory_model import num_parameters
from ..model.shaped_models import ModelShape
from .flavors import EXPOSED_PORT_USD_PER_H, Flavor, flavor, flavors
from .run_forecast import (
    STARTUP_S,
    RunForecast,
    hours_text,
    largest_token_budget,
    model_shape,
    replica_gib,
    trainer_gib,
    trainer_limit,
)
from .sim_blog import blog_costs, blog_setting, costs_for
from .sim_model import PipelineSetting
from .simulator import simulate, summarize

INFLIGHT_CAPS = (64, 128, 256, 384, 512)
"""The client's in-flight caps tried (the blog's runs: 128, then 384)."""
STALENESS = (1, 2, 4)
"""`max_staleness` values tried (the blog's: 4)."""
REPLICA_COUNTS = (1, 2, 3, 4)
SEARCH_STEPS = 30
"""Steps simulated per candidate, its wall clock scaled to the run's (the chosen plan is then
simulated over every step)."""
SCREEN_MARGIN = 1.15
"""The screen keeps every pair that no other beats by this factor on both cost and time."""


@dataclass
class _Search:
    """What every candidate of one plan_run shares."""

    shape: ModelShape
    base: PipelineSetting
    gpu_memory_utilization: float
    lora_rank: int
    sync_s: float | None
    mount_lag_s: float | None = None
    """A preflight's measured mount lag (grpo_lab.launch.preflight): the sync's load retries."""

    @property
    def lengths(self) -> tuple[int, int]:
        """The longest prompt and completion: what memory must hold."""
        return self.base.max_prompt_tokens, self.base.max_completion_tokens

    def token_budget(self, trainer: Flavor) -> tuple[int, bool] | None:
        return largest_token_budget(self.shape, trainer.gpus, trainer.gpu_memory_gib,
                                    self.lengths, self.lora_rank)

    def trainer_gib(self, trainer: Flavor, budget: int, checkpointing: bool) -> float:
        return trainer_gib(self.shape, trainer.gpus, budget, checkpointing, self.lengths,
                           self.lora_rank)

    def replica_gib(self, replicas: int, cap: int) -> float:  # its share of the cap
        return replica_gib(self.shape, math.ceil(cap / replicas), sum(self.lengths))

    def forecast(self, replica: Flavor, replicas: int, trainer: Flavor, setting: PipelineSetting,
                 steps: int) -> RunForecast:
        """Simulate `steps` of `setting`; the wall clock scaled to the run's steps."""
        costs = costs_for(model_params=num_parameters(self.shape), trainer_gpus=trainer.gpus,
                          trainer_peak_flops=trainer.peak_flops,
                          replica_memory_bandwidth=replica.memory_bandwidth,
                          replica_peak_flops=replica.peak_flops, sync_s=self.sync_s,
                          mount_lag_s=self.mount_lag_s, base=blog_costs())
        summary = dict(_summary(setting, costs, steps))
        wall = summary["wall_clock_s"] * setting.steps / steps + STARTUP_S
        hourly = replicas * (replica.hourly_usd + EXPOSED_PORT_USD_PER_H) + trainer.hourly_usd
        return RunForecast(
            model=self.shape.name, parameters=num_parameters(self.shape),
            replica_flavor=replica.name, replicas=replicas, trainer_flavor=trainer.name,
            setting=setting, step_s=summary["step_s_p50"], wall_clock_s=wall,
            hourly_usd=hourly, cost_usd=hourly * wall / 3600, bottleneck=summary["bottleneck"],
            trainer_memory_gib=self.trainer_gib(trainer, setting.token_budget,
                                                setting.gradient_checkpointing),
            trainer_limit_gib=trainer_limit(trainer.gpu_memory_gib),
            replica_memory_gib=self.replica_gib(replicas, setting.max_inflight),
            replica_limit_gib=replica.gpu_memory_gib * self.gpu_memory_utilization,
            summary=summary, mount_lag_s=self.mount_lag_s)


@functools.lru_cache(maxsize=4096)
def _summary(setting: PipelineSetting, costs, steps: int) -> dict:
    """The simulator's summary of `steps` steps (cached: the budget's and deadline's searches
    share their candidates)."""
    return summarize(simulate(setting, costs, steps=steps, seed=0), setting)


def _undominated(candidates: list[Flavor], counts) -> list[Flavor]:
    """The flavors no other beats or equals on every one of `counts(f)` (higher is better)."""
    return [a for a in candidates if not any(counts(b) != counts(a) and all(
        x >= y for x, y in zip(counts(b), counts(a))) for b in candidates)]


# ---------------------------------------------------------------- the search

def plan_run(model, *, steps: int = 500, budget_usd: float | None = None,
             deadline_h: float | None = None, flavors_table: dict[str, Flavor] | None = None,
             replica_flavors=None, trainer_flavors=None, replica_counts=REPLICA_COUNTS,
             inflight_caps=INFLIGHT_CAPS, staleness=STALENESS,
             gpu_memory_utilization: float = 0.85, lora_rank: int = 1,
             sync_s: float | None = None, mount_lag_s: float | None = None,
             **settings) -> RunForecast:
    """The plan to run: the cheapest that ends within `deadline_h`, else the fastest that costs
    at most `budget_usd`, else the cheapest (module docstring). `replica_flavors` and
    `trainer_flavors` (names) narrow the flavors; `settings` replace PipelineSetting fields
    (`prompts_per_step`, `num_generations`, `max_completion_tokens`, `weight_sync_steps`, ...).
    `mount_lag_s`: the bucket mount's lag measured by a preflight (`grpo-lab launch
    --preflight`), in place of the blog's 2-4 s. Raises ValueError, naming the fix, when
    nothing fits."""
    table = flavors_table or flavors()
    replica_pool = [flavor(n, table) for n in replica_flavors or [
        f.name for f in table.values() if f.gpus == 1]]  # `vllm serve` on one GPU, as planned
    trainer_pool = [f for f in (flavor(n, table) for n in trainer_flavors or table)
                    if f.spec.bf16]  # the trainer computes in bfloat16 (T4: fp16 only)
    if not trainer_pool:
        raise ValueError(f"no trainer flavor computes in bfloat16 among {trainer_flavors}")
    base = replace(blog_setting(5), steps=steps, **settings)
    search = _Search(model_shape(model), base, gpu_memory_utilization, lora_rank, sync_s,
                     mount_lag_s)

    # 1. memory: each trainer flavor's largest token budget; the caps each replica count holds
    budgets = {t.name: search.token_budget(t) for t in trainer_pool}
    too_small = {t.name: f"{search.trainer_gib(t, sum(search.lengths), True):.1f} GiB per GPU "
                 f"for one sequence with checkpointing > {trainer_limit(t.gpu_memory_gib):.1f}"
                 " usable" for t in trainer_pool if budgets[t.name] is None}
    trainers = _undominated([t for t in trainer_pool if budgets[t.name]], lambda f: (
        -f.hourly_usd, f.gpus * f.peak_flops, budgets[f.name][0], not budgets[f.name][1]))
    replica_caps = {(r.name, n): [c for c in inflight_caps if search.replica_gib(n, c)
                                  <= r.gpu_memory_gib * gpu_memory_utilization]
                    for r in replica_pool for n in replica_counts}
    replica_caps = {k: caps for k, caps in replica_caps.items() if caps}
    n, cap = max(replica_counts), min(inflight_caps)
    small = {r.name: f"weights + KV cache of {math.ceil(cap / n)} sequences "
             f"{search.replica_gib(n, cap):.1f} GiB > {r.gpu_memory_gib:.1f} x "
             f"{gpu_memory_utilization}" for r in replica_pool
             if not any(k[0] == r.name for k in replica_caps)}
    replicas = _undominated([r for r in replica_pool if r.name not in small], lambda f: (
        -f.hourly_usd, f.memory_bandwidth, f.peak_flops, f.gpu_memory_gib))
    rejected = [f"too small for the {role}: {', '.join(names)}" for role, names in
                (("trainer", too_small), ("replicas", small)) if names]
    if not trainers or not replicas:
        role, pool, small = (("trainer", trainer_pool, too_small) if not trainers
                             else ("replica", replica_pool, small))
        largest = max(pool, key=lambda f: (f.gpu_memory_gib * f.gpus, f.gpu_memory_gib))
        raise ValueError(f"no {role} flavor holds {search.shape.name}: even {largest.name} needs "
                         f"{small[largest.name]}. Fix: a smaller model, shorter completions "
                         "(--max-completion-tokens) or more GPU memory")

    def candidate(r: Flavor, n: int, t: Flavor, cap: int, stale: int) -> RunForecast:
        budget, checkpointing = budgets[t.name]
        setting = replace(base, replicas=n, max_inflight=cap, max_staleness=stale,
                          buffer_size=max(1, stale) * base.prompts_per_step,
                          token_budget=budget, gradient_checkpointing=checkpointing)
        return search.forecast(r, n, t, setting, min(SEARCH_STEPS, steps))

    # 2. the screen: a pair's step is about the slower of its trainer's and its replicas'
    pools = [(r, n) for r in replicas for n in replica_counts if (r.name, n) in replica_caps]
    fast_r, fast_n = max(pools, key=lambda p: (p[0].memory_bandwidth * p[1], p[1]))
    fast_t = max(trainers, key=lambda t: (t.gpus * t.peak_flops, budgets[t.name]))
    stale = max(staleness)
    fed = {t.name: candidate(fast_r, fast_n, t, replica_caps[fast_r.name, fast_n][-1],
                             stale).step_s for t in trainers}
    drained = {(r.name, n): candidate(r, n, fast_t, replica_caps[r.name, n][-1], stale).step_s
               for r, n in pools}
    guess = {}
    for (r, n), t in ((p, t) for p in pools for t in trainers):
        wall = steps * max(fed[t.name], drained[r.name, n]) + STARTUP_S
        guess[r, n, t] = (wall * (n * (r.hourly_usd + EXPOSED_PORT_USD_PER_H) + t.hourly_usd),
                          wall)
    # 3. simulated: every pair no other beats by SCREEN_MARGIN on both cost and time
    first = [candidate(r, n, t, replica_caps[r.name, n][-1], stale)
             for (r, n, t), (cost, wall) in guess.items() if not any(
                 c * SCREEN_MARGIN < cost and w * SCREEN_MARGIN < wall for c, w in guess.values())]
    # 4. the cost-time front again at every cap, then every staleness
    front = [f for f in first if not any(
        g.cost_usd <= f.cost_usd and g.wall_clock_s <= f.wall_clock_s
        and (g.cost_usd, g.wall_clock_s) != (f.cost_usd, f.wall_clock_s) for g in first)]
    tried = {_key(f) for f in first}
    candidates = list(first)
    for f in front:
        r, t = table[f.replica_flavor], table[f.trainer_flavor]
        pairs = [(cap, f.setting.max_staleness) for cap in replica_caps[r.name, f.replicas]]
        pairs += [(f.setting.max_inflight, s) for s in staleness]
        for cap, s in pairs:
            if _key(f, cap, s) not in tried:
                tried.add(_key(f, cap, s))
                candidates.append(candidate(r, f.replicas, t, cap, s))
    # 5. the estimates' best few, simulated over every step and ranked again on those figures:
    #    the plan chosen, the budget and the deadline all compare what is printed
    def full(f: RunForecast) -> RunForecast:
        return search.forecast(table[f.replica_flavor], f.replicas, table[f.trainer_flavor],
                               f.setting, steps)
    finals = _finalists(candidates, budget_usd, deadline_h, full)
    best = choose(finals, budget_usd, deadline_h)
    best.rejected = rejected + _losers(candidates, finals, best, budget_usd, deadline_h)
    return best


FINALISTS = 4
"""How many of the estimates' best plans are simulated over every step at a time."""
ESTIMATE_MARGIN = 1.15
"""A SEARCH_STEPS estimate is within this factor of the full run's wall clock and cost (measured
up to 1.10 on the planner's tests' plans): a plan this far over the budget or deadline on its
estimate may still meet it over every step."""


def _finalists(candidates, budget_usd, deadline_h, full) -> list[RunForecast]:
    """Full runs of the estimates' best FINALISTS (choose's order) among those within
    ESTIMATE_MARGIN of the budget and deadline; the next FINALISTS while none meets them; with
    none left, the cheapest and the fastest estimate's full runs (choose then names the gap)."""
    near = sorted((f for f in candidates if _meets(f, budget_usd and budget_usd * ESTIMATE_MARGIN,
                                                   deadline_h and deadline_h * ESTIMATE_MARGIN)),
                  key=_order(budget_usd, deadline_h))
    finals: list[RunForecast] = []
    for start in range(0, len(near), FINALISTS):
        finals += [full(f) for f in near[start:start + FINALISTS]]
        if any(_meets(f, budget_usd, deadline_h) for f in finals):
            return finals
    ends = {_key(f): f for f in (min(candidates, key=lambda f: f.cost_usd),
                                 min(candidates, key=lambda f: f.wall_clock_s))}
    return finals + [full(f) for k, f in ends.items() if k not in {_key(g) for g in finals}]


def _key(f: RunForecast, cap: int | None = None, stale: int | None = None) -> tuple:
    return (f.replica_flavor, f.replicas, f.trainer_flavor, cap or f.setting.max_inflight,
            stale or f.setting.max_staleness)


def _meets(f: RunForecast, budget_usd, deadline_h) -> bool:
    return ((budget_usd is None or f.cost_usd <= budget_usd)
            and (deadline_h is None or f.wall_clock_s <= deadline_h * 3600))


def _bucket(x: float) -> int:
    """1 % buckets: figures closer than that count as equal, the next keys decide."""
    return round(math.log(max(x, 1e-9)) / math.log(1.01))


def choose(candidates: list[RunForecast], budget_usd: float | None = None,
           deadline_h: float | None = None) -> RunForecast:
    """The cheapest candidate that meets the deadline (and budget); with a budget only, the
    fastest within it; then fresher samples (lower staleness), then a lower cap."""
    ok = [f for f in candidates if _meets(f, budget_usd, deadline_h)]
    if not ok:
        f = min(candidates, key=lambda f: f.wall_clock_s)
        plan = f"({f.replicas} x {f.replica_flavor} + {f.trainer_flavor})"
        if deadline_h is not None and f.wall_clock_s > deadline_h * 3600:
            raise ValueError(
                f"no plan meets the deadline of {deadline_h:g} h: the fastest {plan} takes "
                f"{f.wall_clock_s / 3600:.2f} h for ${f.cost_usd:,.2f}; raise --deadline-h to "
                f"{math.ceil(f.wall_clock_s / 360) / 10:g} or run fewer --steps")
        f = min(candidates, key=lambda f: f.cost_usd)
        raise ValueError(
            f"no plan fits the budget of ${budget_usd:,.2f}"
            + (f" within {deadline_h:g} h" if deadline_h is not None else "")
            + f": the cheapest ({f.replicas} x {f.replica_flavor} + {f.trainer_flavor}) costs "
            f"${f.cost_usd:,.2f}; raise --budget-usd to {math.ceil(f.cost_usd):,} or run fewer "
            "--steps")

    return min(ok, key=_order(budget_usd, deadline_h))


def _order(budget_usd: float | None, deadline_h: float | None):
    """choose's ranking: by cost then speed (by speed then cost with a budget only), each in
    1 % buckets; then fresher samples (lower staleness), then a lower cap."""
    def order(f: RunForecast) -> tuple:
        speed, price = _bucket(f.wall_clock_s), _bucket(f.cost_usd)
        first = (speed, price) if budget_usd is not None and deadline_h is None else (price, speed)
        return (*first, f.setting.max_staleness, f.setting.max_inflight, f.cost_usd,
                f.wall_clock_s, _key(f))
    return order


def _losers(candidates, finals, best, budget_usd, deadline_h) -> list[str]:
    """A line each: how many of the estimated plans the deadline and the budget ruled out; the
    fastest other plan among those simulated over every step (figures as printed)."""
    late = sum(deadline_h is not None and f.wall_clock_s > deadline_h * 3600 for f in candidates)
    dear = sum(budget_usd is not None and f.cost_usd > budget_usd for f in candidates)
    lines = [f"{k} of {len(candidates)} plans {why}" for k, why in (
        (late, "end after the deadline"), (dear, "cost over the budget")) if k]
    faster = [f for f in finals if f.wall_clock_s < best.wall_clock_s * 0.99
              and _meets(f, budget_usd, deadline_h)]
    if faster:
        f = min(faster, key=lambda f: f.wall_clock_s)
        lines.append(f"faster: {f.replicas} x {f.replica_flavor} + {f.trainer_flavor}, "
                     f"{hours_text(f.wall_clock_s)} for ${f.cost_usd:,.2f}")
    return lines


def forecast_plan(config: RecipeConfig, training: dict | None = None,
                  flavors_table: dict[str, Flavor] | None = None,
                  mount_lag_s: float | None = None) -> RunForecast:
    """The forecast of one exact plan (grpo_lab.launch.recipe_plan's RecipeConfig on GPU flavors,
    the trainer's settings from `training`, default BLOG_TRAINING, and the config's own `steps`,
`max_inflight` and `token_budget` over both): no search. `mount_lag_s`: a
    preflight's measured mount lag (plan_run)."""
    training = {**BLOG_TRAINING, **(training or {}), **config.trainer_knobs()}
    table = flavors_table or flavors()
    replica = flavor(config.replica_flavor or "h200", table)
    trainer = flavor(config.trainer_flavor or "h200", table)
    setting = replace(blog_setting(5), replicas=config.replicas, steps=training["steps"],
                      max_completion_tokens=config.max_completion_length,
                      max_prompt_tokens=config.max_prompt_length,
                      max_staleness=config.max_staleness, **{k: training[k] for k in (
                          "max_inflight", "buffer_size", "token_budget", "prompts_per_step",
                          "gradient_checkpointing", "num_generations", "weight_sync_steps")})
    search = _Search(model_shape(config.base_model or HF_BLOG_MODEL), setting,
                     config.gpu_memory_utilization, config.lora_rank, None, mount_lag_s)
    f = search.forecast(replica, config.replicas, trainer, setting, setting.steps)
    f.rejected = [why for why, over in (
        ("the trainer's step does not fit its GPU: lower token_budget",
         f.trainer_memory_gib > f.trainer_limit_gib),
        ("a replica's KV cache does not hold its in-flight requests: vLLM will preempt (lower "
         "max_inflight or add replicas)", f.replica_memory_gib > f.replica_limit_gib)) if over]
    return f
