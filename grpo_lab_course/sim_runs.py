"""Simulated runs read like live ones: the pipeline simulator's records as notebook 08's
`KnobRun`s, the blog's published figures beside the simulator's, and a plan's memory check drawn.

    runs = blog_runs()                         # the blog's five runs, simulated (seconds)
    print(runs_table(list(runs.values())))     # grpo_lab_course.pipeline_runs, as for live runs
    rows = predicted_vs_published(runs)        # every published figure against the prediction
    plot_predicted_vs_published(rows)
    plot_memory({"budget": forecast})          # grpo_lab.plan.planner.RunForecast's memory check

A `SimRun` is a `KnobRun` (so `plot_runs`, `runs_table`, `summarize` and `diagnose` read it) that
also keeps its `PipelineSetting`; its `seconds` are the simulated wall clock, not compute time.
The simulator and the blog's figures: grpo_lab.plan.simulator, grpo_lab.plan.sim_blog.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from grpo_lab.model.memory_model import GiB
from grpo_lab.plan.flavors import flavors
from grpo_lab.plan.run_forecast import model_shape, replica_gib
from grpo_lab.plan.sim_blog import BLOG_RUNS, blog_costs, blog_setting
from grpo_lab.plan.sim_model import PipelineSetting, StageCosts
from grpo_lab.plan.simulator import simulate
from grpo_lab.plan.simulator import summarize as simulated_summary
from grpo_lab.watch.doctor import diagnose
from grpo_lab_course.pipeline_runs import KnobRun

BLOG_RUN_NAMES = {1: "r1-baseline", 2: "r2-packing", 3: "r3-no-checkpoint",
                  4: "r4-third-replica", 5: "r5-cap-384"}
"""The blog's runs by number, named after what each changed (docs/recipe.md)."""

PUBLISHED_AS = {  # the blog's figure (BLOG_RUNS) -> grpo_lab.plan.simulator.summarize's key
    "step_s_p50": "step_s_p50", "fwd_bwd_s_p50": "fwd_bwd_s_p50", "mfu": "mfu",
    "rollout_wait_s": "rollout_wait_s_p50", "queue_size": "queue_size_mean",
    "queue_maxsize": "queue_maxsize", "generation_tokens_per_s": "generation_tokens_per_s",
    "micro_batches": "micro_batches", "samples_per_row": "samples_per_row",
    "row_fill_frac": "row_fill_frac", "weight_sync_s_p50": "weight_sync_s_p50",
    "weight_sync_share": "weight_sync_share", "staleness_mean": "staleness_mean",
    "wall_clock_s": "wall_clock_s", "backpressure_s": "backpressure_s_mean",
    "inflight": "inflight_mean", "bottleneck": "bottleneck",
}
"""As benchmarks/simulator_vs_blog.py compares them."""

GOAL = 0.15
"""The simulator's goal: a prediction within 15 % of the published figure."""
NEAR_ZERO_S = 0.1
"""A published wait under this many seconds is met by any predicted wait under it too."""


@dataclass(repr=False)
class SimRun(KnobRun):
    """A simulated run: a KnobRun (`seconds` = the simulated wall clock) with its setting."""

    setting: PipelineSetting | None = None

    def summary(self) -> dict:
        """grpo_lab.plan.simulator.summarize of its records: the blog's kind of figures."""
        return simulated_summary(self.records, self.setting)


def simulated_run(name: str, setting: PipelineSetting, costs: StageCosts | None = None, *,
                  window: int | None = None, seed: int = 0, steps: int | None = None) -> SimRun:
    """Simulate `setting` (costs default: blog_costs()) and diagnose its last `window` steps
    (default: the last 80 %, as `summarize` reads them; the first steps fill the pipeline)."""
    records = simulate(setting, costs or blog_costs(), steps=steps, seed=seed)
    window = window or len(records) - len(records) // 5
    knobs = {"replicas": setting.replicas, "max_inflight": setting.max_inflight,
             "token_budget": setting.token_budget,
             "gradient_checkpointing": setting.gradient_checkpointing,
             "weight_sync_steps": setting.weight_sync_steps,
             "max_staleness": setting.max_staleness, "request_shape": setting.request_shape}
    return SimRun(name, knobs, records, diagnose(records, window=window),
                  seconds=records[-1]["time_s"],
                  inflight_peak=max(r.get("rollout/inflight_max", 0) for r in records),
                  setting=setting)


def blog_runs(*, steps: int | None = None, seed: int = 0,
              costs: StageCosts | None = None) -> dict[int, SimRun]:
    """The blog's five runs simulated with the costs calibrated on its run 1: {run: SimRun}."""
    costs = costs or blog_costs()
    return {run: simulated_run(BLOG_RUN_NAMES[run], blog_setting(run), costs, steps=steps,
                               seed=seed) for run in BLOG_RUNS}


def predicted_vs_published(runs: dict[int, SimRun]) -> list[dict]:
    """A row per published figure of each run: run, figure, published, predicted, ratio
    (predicted / published; None for a verdict) and whether it is within GOAL."""
    rows = []
    for run, sim in runs.items():
        predicted = sim.summary()
        for figure, published in BLOG_RUNS[run].items():
            if figure not in PUBLISHED_AS:
                continue
            value = predicted[PUBLISHED_AS[figure]]
            if isinstance(published, str):
                ratio, ok = None, value == published
            else:
                ratio = value / published if published else None
                ok = (ratio is not None and abs(ratio - 1) <= GOAL) or (
                    figure == "rollout_wait_s" and max(value, published) < NEAR_ZERO_S)
            rows.append(dict(run=run, figure=figure, published=published, predicted=value,
                             ratio=ratio, within_goal=ok))
    return rows


def comparison_table(rows: list[dict]) -> str:
    """`predicted_vs_published`'s rows as text: run 1 is the calibration, runs 2-5 predictions."""
    def text(x) -> str:
        return x if isinstance(x, str) else f"{x:,.3g}" if abs(x) < 1000 else f"{x:,.0f}"

    lines = [f"{'run':>3}  {'figure':<24}{'published':>11}{'predicted':>11}{'error':>8}"]
    for r in rows:
        error = "" if r["ratio"] is None else f"{r['ratio'] - 1:+.0%}"
        mark = "" if r["within_goal"] else ("  (fit)" if r["run"] == 1 else "  miss")
        lines.append(f"{r['run']:>3}  {r['figure']:<24}{text(r['published']):>11}"
                     f"{text(r['predicted']):>11}{error:>8}{mark}")
    return "\n".join(lines)


def plot_predicted_vs_published(rows: list[dict]):
    """Each numeric figure's predicted / published, one dot a figure, grouped by run, on a log
    axis with the GOAL band shaded; run 1 (the calibration) in grey. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    shown = [r for r in rows if r["ratio"] is not None]
    fig, ax = plt.subplots(figsize=(9, 0.24 * len(shown) + 1.4))
    ax.axvspan(1 - GOAL, 1 + GOAL, color="tab:green", alpha=0.15,
               label=f"within {GOAL:.0%} (the goal)")
    ax.axvline(1, color="black", linewidth=0.8)
    low, high = 0.3, 3.0
    for y, r in enumerate(shown):
        colour = ("tab:gray" if r["run"] == 1 else "tab:green" if r["within_goal"]
                  else "tab:orange")
        x = min(max(r["ratio"], low), high)
        ax.plot([1, x], [y, y], color=colour, linewidth=1)
        ax.plot(x, y, color=colour, marker="<" if r["ratio"] < low else "o")
    ax.set_yticks(range(len(shown)), [f"run {r['run']} · {r['figure']}" for r in shown],
                  fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlim(low * 0.9, high)
    ax.set_xticks([0.5, 0.85, 1, 1.15, 2], ["0.5x", "0.85", "1", "1.15", "2x"])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("predicted / published (grey: run 1, the calibration; orange: a miss)")
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    return fig


def max_sequences(model, gpu_memory_gib: float, sequence_tokens: int,
                  gpu_memory_utilization: float = 0.85) -> int:
    """The most full-length sequences one replica holds at once: bfloat16 weights + their KV
    cache within `gpu_memory_utilization` of the GPU (grpo_lab.plan.run_forecast.replica_gib)."""
    shape = model_shape(model)
    limit = gpu_memory_gib * gpu_memory_utilization
    one = replica_gib(shape, 1, sequence_tokens) - replica_gib(shape, 0, sequence_tokens)
    n = max(0, math.floor((limit - replica_gib(shape, 0, sequence_tokens)) / one))
    while n and replica_gib(shape, n, sequence_tokens) > limit:  # float rounding at the edge
        n -= 1
    return n


def plot_memory(forecasts: dict):
    """Each plan's memory check (grpo_lab.plan.planner.RunForecast by label): the trainer's GiB
    per GPU, and a replica's weights and KV cache, each against the limit the planner holds it
    to (black tick). Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(forecasts), figsize=(4.2 * len(forecasts), 3.9),
                             squeeze=False)
    for ax, (label, f) in zip(axes[0], forecasts.items()):
        weights = f.parameters * 2 / GiB
        ax.bar(0, f.trainer_memory_gib, color="tab:orange", label="trainer step (per GPU)")
        ax.bar(1, weights, color="tab:blue", label="replica: weights")
        ax.bar(1, f.replica_memory_gib - weights, bottom=weights, color="tab:cyan",
               label="replica: KV cache of its requests")
        ax.plot([0, 1], [f.trainer_limit_gib, f.replica_limit_gib], "k_", markersize=40,
                markeredgewidth=2, label="limit (85 % of the GPU)")
        ax.set_xticks([0, 1], [f"trainer\n{f.trainer_flavor}",
                               f"replica\n{f.replica_flavor}"], fontsize=8)
        ax.set_title(f"{label}: {f.model}", fontsize=9)
        ax.set_ylabel("GiB")
        ax.grid(alpha=0.3, axis="y")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8,
               markerscale=0.4, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def run_record(run: SimRun | None) -> dict | None:
    """What a notebook records of a simulated run (None stays None: a run not made)."""
    if run is None:
        return None
    s = run.summary()
    return {**run.knobs, "bottleneck": run.diagnosis.bottleneck, "step_s_p50": s["step_s_p50"],
            "wall_clock_s": run.seconds, "staleness_mean": s["staleness_mean"]}


def plan_record(forecast) -> dict:
    """What a notebook records of a planner's RunForecast: the choice, its price, its memory."""
    s, table = forecast.setting, flavors()
    gpus = {role: table[name].gpus if name in table else None for role, name in (
        ("replica_gpus", forecast.replica_flavor), ("trainer_gpus", forecast.trainer_flavor))}
    return {"model": forecast.model, "replicas": forecast.replicas, **gpus,
            "replica_flavor": forecast.replica_flavor, "trainer_flavor": forecast.trainer_flavor,
            "max_inflight": s.max_inflight, "token_budget": s.token_budget,
            "max_staleness": s.max_staleness, "step_s": forecast.step_s,
            "wall_clock_s": forecast.wall_clock_s, "cost_usd": forecast.cost_usd,
            "bottleneck": forecast.bottleneck,
            "memory_fits": forecast.trainer_memory_gib <= forecast.trainer_limit_gib
            and forecast.replica_memory_gib <= forecast.replica_limit_gib}
