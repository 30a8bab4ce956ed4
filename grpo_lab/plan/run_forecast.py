"""One plan and what the pipeline simulator predicts for it (grpo_lab.plan.planner makes them):
its flavors and settings, step time, wall clock, bill, bottleneck and memory check, printed by
`grpo-lab plan` and `grpo-lab launch --dry-run`."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..algo.logprobs import chunk_positions
from ..launch.recipe_config import HF_BLOG_MODEL
from ..model.memory_model import GiB, StepSetting, num_parameters, step_memory
from ..model.shaped_models import QWEN25_MATH_15B, SHAPES, ModelShape
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


# --- The memory check of a plan
# The memory check of a plan: what a model needs on each trainer GPU and on each vLLM replica,
# from grpo_lab.model.memory_model (the real-shapes work), before any GPU is paid for.
#
#     trainer GPU   what persists (bfloat16 weights, the LoRA adapter, its master copies and AdamW
#                   moments) and the gradients, sharded by FSDP2 over the flavor's GPUs, plus one
#                   micro-batch's activations and logits (the token budget's rows, each full length)
#     replica GPU   bfloat16 weights + the KV cache of its share of the in-flight requests at full
#                   length: what `gpu_memory_utilization` of the GPU must hold for vLLM to run them
#                   all at once (beyond it vLLM preempts: slower, not fatal)
# Not counted: vLLM's activations and CUDA graphs, the CUDA context, allocator slack (hence the
# planner's margins). A model is a shape of grpo_lab.model.shaped_models (published configs, usable
# offline), a hub id of those, a local folder's config.json, or a parameter count.


HUB_SHAPES = {HF_BLOG_MODEL: "qwen2.5-math-1.5b", "Qwen/Qwen2.5-0.5B": "qwen2.5-0.5b",
              "Qwen/Qwen2.5-0.5B-Instruct": "qwen2.5-0.5b"}
"""Hub ids whose published config SHAPES holds."""
TOKEN_BUDGETS_X = (32, 16, 8, 4, 2, 1)
"""Token budgets tried, as multiples of one full-length sequence (4,096 tokens at the blog's
lengths: 16,384 is 4x): a sequence never splits across micro-batches."""
TRAINER_MEMORY_FRACTION = 0.85
"""Share of a trainer GPU the memory model may fill: the rest for what it leaves out (the CUDA
context, NCCL's buffers, the allocator's slack; grpo_lab.model.memory_model's docstring)."""


def shape_for_parameters(parameters: float) -> ModelShape:
    """A Qwen2.5-style shape of about `parameters`: Qwen2.5-Math-1.5B's widened and deepened
    alike (128-wide heads, about 6 query heads per KV head, its MLP ratio); approximate."""
    base = QWEN25_MATH_15B

    def at(scale: float) -> ModelShape:
        heads = max(1, round(base.num_attention_heads * scale))
        hidden = heads * 128
        return ModelShape(
            f"~{parameters / 1e9:.3g}B (Qwen2.5-style)", hidden_size=hidden,
            num_hidden_layers=max(1, round(base.num_hidden_layers * scale)),
            num_attention_heads=heads, num_key_value_heads=max(1, round(heads / 6)),
            intermediate_size=round(hidden * base.intermediate_size / base.hidden_size / 128) * 128,
            tie_word_embeddings=parameters < 4e9)

    low, high = 0.01, 100.0
    for _ in range(60):  # bisection on the scale, in log space
        mid = math.sqrt(low * high)
        low, high = (mid, high) if num_parameters(at(mid)) < parameters else (low, mid)
    return at(high)


def model_shape(model: str | int | float | ModelShape) -> ModelShape:
    """A shape name of SHAPES, a hub id it holds, a local model folder (its config.json) or a
    parameter count."""
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, (int, float)):
        return shape_for_parameters(model)
    if model in SHAPES or model in HUB_SHAPES:
        return SHAPES[HUB_SHAPES.get(model, model)]
    config = Path(model).expanduser() / "config.json"
    if config.is_file():
        c = json.loads(config.read_text())
        return ModelShape(Path(model).name, c["hidden_size"], c["num_hidden_layers"],
                          c["num_attention_heads"], c.get("num_key_value_heads",
                                                          c["num_attention_heads"]),
                          c["intermediate_size"], vocab_size=c["vocab_size"],
                          tie_word_embeddings=c.get("tie_word_embeddings", False))
    raise ValueError(f"unknown model {model!r}: give a shape ({', '.join(SHAPES)}), a hub id "
                     f"({', '.join(HUB_SHAPES)}), a local folder with a config.json, or a "
                     "parameter count (--params 7e9)")


def trainer_gib(shape: ModelShape, gpus: int, token_budget: int, checkpointing: bool,
                lengths: tuple[int, int], lora_rank: int = 1) -> float:
    """GiB per trainer GPU: FSDP2 shards what persists (and the gradients) over the flavor's
    GPUs; each GPU holds one micro-batch's activations and logits (token_budget tokens)."""
    prompt, completion = lengths
    rows = max(1, token_budget // (prompt + completion))  # full-length rows of one micro-batch
    mem = step_memory(shape, StepSetting(
        prompts=rows, num_generations=1, prompt_tokens=prompt, completion_tokens=completion,
        dtype="bfloat16", lora_rank=lora_rank, activation_checkpointing=checkpointing,
        logits_chunk_rows=chunk_positions(shape.vocab_size), generate_in_process=False))
    return ((mem.persistent + mem.gradients) / gpus + mem.activations + mem.logits) / GiB


def trainer_limit(gpu_memory_gib: float) -> float:
    """GiB of a trainer GPU the step may take (TRAINER_MEMORY_FRACTION)."""
    return gpu_memory_gib * TRAINER_MEMORY_FRACTION


def largest_token_budget(shape: ModelShape, gpus: int, gpu_memory_gib: float,
                         lengths: tuple[int, int], lora_rank: int = 1) -> tuple[int, bool] | None:
    """The largest token budget of TOKEN_BUDGETS_X whose step fits a trainer of `gpus` GPUs,
    without activation checkpointing if any fits so, and whether it needs it; None: none fits."""
    sequence = sum(lengths)
    return next(((x * sequence, gc) for gc in (False, True) for x in TOKEN_BUDGETS_X
                 if trainer_gib(shape, gpus, x * sequence, gc, lengths, lora_rank)
                 <= trainer_limit(gpu_memory_gib)), None)


def replica_gib(shape: ModelShape, inflight: int, sequence_tokens: int) -> float:
    """GiB of one vLLM replica: bfloat16 weights + the KV cache of `inflight` full sequences."""
    kv_per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * 2
    return (num_parameters(shape) * 2 + kv_per_token * sequence_tokens * inflight) / GiB
