"""One plan and what the pipeline simulator predicts for it (grpo_lab.plan.planner makes them):
its flavors and settings, step time, wall clock, bill, bottleneck and memory check, printed by
`grpo-lab plan` and `grpo-lab launch --dry-run`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .sim_model import PipelineSetting

STARTUP_S = 600.0
"""Billed seconds before the first step (image pull, model download, vLLM's start): an assumed
10 minutes, not a measurement."""

FORECAST_BAND = 0.16
"""Every forecast's band, as a share of its step time, wall clock and cost: the simulator's
largest error on the step times and wall clocks of the blog's runs it was not calibrated on
(run 5's step time, 4.0 s predicted, 4.8 s published; benchmarks/simulator_vs_blog.py, whose
results tests/test_planner.py reads to hold this figure to them)."""


@dataclass
class RunForecast:
    """One plan and what the simulator predicts for it."""

    model: str
    parameters: int
    replica_flavor: str
    replicas: int
    trainer_flavor: str
    setting: PipelineSetting
    """The simulated setting: cap (`max_inflight`), token budget, `max_staleness`, ..."""
    step_s: float
    """Predicted `perf/step_s`, p50."""
    wall_clock_s: float
    """Every step plus STARTUP_S."""
    hourly_usd: float
    cost_usd: float
    bottleneck: str
    trainer_memory_gib: float
    """Per trainer GPU (and below: the limits the memory check holds them to)."""
    trainer_limit_gib: float
    replica_memory_gib: float
    replica_limit_gib: float
    summary: dict = field(default_factory=dict)
    """grpo_lab.plan.simulator.summarize's figures."""
    rejected: list[str] = field(default_factory=list)
    """Why other plans lost, a line each."""
    mount_lag_s: float | None = None
    """The mount lag simulated: a preflight's measurement, or None for the blog's 2-4 s."""

    def describe(self) -> str:
        s, fwd_bwd = self.setting, self.summary.get("fwd_bwd_s_p50", float("nan"))
        low, high = 1 - FORECAST_BAND, 1 + FORECAST_BAND
        lag = ("2-4 s (the blog's)" if self.mount_lag_s is None else
               f"{self.mount_lag_s:.2f} s (measured by a preflight)")
        return "\n".join([
            f"{self.model} ({self.parameters / 1e9:.2f} B parameters), {s.steps} steps",
            f"  replicas      {self.replicas} x {self.replica_flavor}   trainer "
            f"{self.trainer_flavor} (runs the proxy)",
            f"  settings      max_inflight {s.max_inflight}, token_budget {s.token_budget or 0:,}"
            f", max_staleness {s.max_staleness}, gradient_checkpointing "
            f"{str(s.gradient_checkpointing).lower()}",
            f"  step time     {self.step_s:.1f} s p50 (forward+backward {fwd_bwd:.1f} s); "
            f"bottleneck: {self.bottleneck}",
            f"  weight sync   {self.summary.get('weight_sync_s_p50', float('nan')):.1f} s p50 "
            f"every {s.weight_sync_steps} steps; mount lag {lag}",
            f"  wall clock    {hours_text(self.wall_clock_s)} "
            f"({STARTUP_S / 60:.0f} min start-up in); likely "
            f"{hours_text(low * self.wall_clock_s)} to {hours_text(high * self.wall_clock_s)}",
            f"  cost          ${self.cost_usd:,.2f} (${self.hourly_usd:.2f}/h); likely "
            f"${low * self.cost_usd:,.2f} to ${high * self.cost_usd:,.2f}",
            f"  band          +/-{FORECAST_BAND:.0%}: the simulator's largest error on the "
            "blog's step times and wall clocks",
            f"  memory check  trainer {self.trainer_memory_gib:.1f} of {self.trainer_limit_gib:.1f}"
            f" GiB per GPU; replica {self.replica_memory_gib:.1f} of {self.replica_limit_gib:.1f}"
            " GiB (weights + KV cache of its in-flight requests)",
            *(f"  - {why}" for why in self.rejected)])

    def to_dict(self) -> dict:
        """Every field, and `band`: the wall clock's and cost's likely range (FORECAST_BAND)."""
        low, high = 1 - FORECAST_BAND, 1 + FORECAST_BAND
        return {**asdict(self), "band": {
            "share": FORECAST_BAND, "wall_clock_s": [low * self.wall_clock_s,
                                                     high * self.wall_clock_s],
            "cost_usd": [low * self.cost_usd, high * self.cost_usd]}}


def hours_text(seconds: float) -> str:
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h {minutes:02d} min"
