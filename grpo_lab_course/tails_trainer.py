"""Notebook 05b's measurement: the asynchronous trainer that keeps, each step, the tails of
pi_prox / mu over the sampled tokens, a replica that never loads a new adapter, and the runs,
summaries and plots that compare the sampler corrections on them.

    run = tails_run(steps=40, prompts_per_step=16, num_generations=8, max_staleness=8,
                    buffer_size=8 * 16)
    summary = summarise(run, skip=8)  # means after the warm-up: kl, the 1 % and 99 % tails, ...
    frozen = tails_run(replica=FrozenReplica, **CORRECTIONS["TIS (C=2)"], ...)

The trainer's own metrics (`kl`, `ratio`, `clip_ratio/*`, `sampling/*`) are in docs/metrics.md;
the tails come from the log-probabilities the update computes anyway (its forward before any
change, `prox_logps`), so keeping them costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from grpo_lab.algo.sampler_correction import sampler_correction_metrics
from grpo_lab.rollout.generators import LocalGenerator
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.async_trainer import AsyncGRPOTrainer

CORRECTIONS = {
    "clip alone": dict(vllm_importance_sampling_correction=False),
    "TIS (C=2)": dict(vllm_importance_sampling_correction=True,
                      vllm_importance_sampling_mode="token_truncate",
                      vllm_importance_sampling_clip_max=2.0),
    "MIS (sequence, C_max=3)": dict(vllm_importance_sampling_correction=True,
                                    vllm_importance_sampling_mode="sequence_mask",
                                    vllm_importance_sampling_clip_max=3.0),
    "AReaL (cap 5)": dict(vllm_importance_sampling_correction=True,
                          vllm_importance_sampling_mode="token_mask",
                          vllm_importance_sampling_clip_max=5.0),
}
"""The four objectives of notebook 05b as `AsyncGRPOConfig` settings (TRL's option names): the
clip alone against the behaviour, then the clip around pi_prox times a weight that is truncated
(TIS), masked per sequence (MIS) or dropped above a cap (AReaL's decoupled objective)."""

CLIP_BAND = (0.8, 1.2)
"""The clip's band at epsilon = 0.2: a token's pi_prox / mu outside it counts in `outside_clip`."""


def ratio_tails(prox_logps: torch.Tensor, behav_logps: torch.Tensor,
                mask: torch.Tensor) -> dict[str, float]:
    """The tails of w = pi_prox / mu over the real tokens ((B, T) log-probabilities, `mask` 1 on
    real tokens): min, 1 % and 99 % quantiles, max, and the share outside the clip's band."""
    ratio = torch.exp(prox_logps - behav_logps)[mask.bool()]  # (N,)
    lo, hi = CLIP_BAND
    return {"min": ratio.min().item(), "q01": ratio.quantile(0.01).item(),
            "q99": ratio.quantile(0.99).item(), "max": ratio.max().item(),
            "outside_clip": ((ratio < lo) | (ratio > hi)).float().mean().item()}


class TailsTrainer(AsyncGRPOTrainer):
    """The asynchronous trainer; keeps, each step, `ratio_tails` of pi_prox / mu in `tails`.

    `weights`: optional `f(prox_logps, behav_logps, mask) -> (B, T)` weights used instead of the
    configured correction's (notebook 05b's exercise puts the learner's in the trainer)."""

    def __init__(self, *args, weights: Callable | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.tails: list[dict[str, float]] = []
        self.weights = weights

    def sampler_metrics(self, batch, prox_logps):  # prox_logps: (B, T), before the update
        self.tails.append(ratio_tails(prox_logps, batch.old_logps, batch.completion_mask))
        return super().sampler_metrics(batch, prox_logps)

    def sampler_weights(self, old_logps, sampler_logps, mask):
        if self.weights is None:
            return super().sampler_weights(old_logps, sampler_logps, mask)
        weights = self.weights(old_logps, sampler_logps, mask)
        mode = self.config.vllm_importance_sampling_mode
        return weights, sampler_correction_metrics(old_logps, sampler_logps, weights, mask, mode)


class FrozenReplica(LocalGenerator):
    """A generator that loads the first version it is given and no other: asked for any version,
    it samples from that first one (notebook 05's wrong weights under the right name)."""

    def publish(self, model, version):
        if not self.versions:
            super().publish(model, version)

    def generate(self, prompt_ids, *, version, **kwargs):
        return super().generate(prompt_ids, version=self.versions[0], **kwargs)


def tails_run(replica: Callable | None = None, *, steps: int, prompts_per_step: int,
              num_generations: int, seed: int = 0, weights: Callable | None = None,
              **settings) -> dict:
    """One `TailsTrainer` run: `replica(model, tokenizer)` builds its generator (None: the
    trainer's own in-process one); `settings` go to `AsyncGRPOConfig`. Returns the logged records
    (step > 0), the tails per step, the greedy accuracy history and whether the worker stopped."""
    config = AsyncGRPOConfig(steps=steps, prompts_per_step=prompts_per_step,
                             num_generations=num_generations, seed=seed, eval_every=0,
                             log_every=steps, log_completions_every=0, progress=False, **settings)
    trainer = TailsTrainer(config, weights=weights)
    if replica is not None:
        trainer.generator = replica(trainer.model, trainer.tokenizer)
    records = [r for r in trainer.train() if r["step"] > 0]
    return {"records": records, "tails": trainer.tails, "accuracy": trainer.accuracy_history,
            "worker_stopped": not trainer.worker_alive}


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def summarise(run: dict, skip: int = 0) -> dict[str, float]:
    """Means over the steps after `skip` (the warm-up, before staleness reaches its bound): the
    staleness, `kl`, `ratio`, the clipped share, the tails; the accuracy before and after."""
    records, tails = run["records"][skip:], run["tails"][skip:]
    return {"staleness": _mean(r["sample/staleness_mean"] for r in records),
            "kl": _mean(r["kl"] for r in records), "ratio": _mean(r["ratio"] for r in records),
            "clipped": _mean(r["clip_ratio/region_mean"] for r in records),
            "q01": _mean(t["q01"] for t in tails), "q99": _mean(t["q99"] for t in tails),
            "min": min(t["min"] for t in tails), "max": max(t["max"] for t in tails),
            "outside_clip": _mean(t["outside_clip"] for t in tails),
            "reward": _mean(r["reward"] for r in records),
            "accuracy_before": run["accuracy"][0][1], "accuracy_after": run["accuracy"][-1][1]}


def summary_line(name: str, s: dict[str, float]) -> str:
    """One `summarise` result as a line of fixed keys."""
    return (f"{name:24s} staleness {s['staleness']:4.2f} | kl {s['kl']:.1e} | ratio "
            f"{s['ratio']:.4f} | pi_prox/mu 1% {s['q01']:.3f} 99% {s['q99']:.3f} (min "
            f"{s['min']:.2f}, max {s['max']:.2f}), {s['outside_clip']:.2%} outside the clip | "
            f"clipped {s['clipped']:.2%} | accuracy {s['accuracy_before']:.3f} -> "
            f"{s['accuracy_after']:.3f}")


def logged_weights(runs: dict[str, dict]) -> dict[str, tuple[float, float]]:
    """Per corrected run, the smallest and largest weight the trainer logged
    (`sampling/importance_sampling_ratio/min`, `/max`) over the run."""
    return {name: (min(r["sampling/importance_sampling_ratio/min"] for r in run["records"]),
                   max(r["sampling/importance_sampling_ratio/max"] for r in run["records"]))
            for name, run in runs.items()
            if "sampling/importance_sampling_ratio/max" in run["records"][0]}


def retraces(weights: Callable, reference: dict, *, steps: int, tolerance: float = 1e-3,
             **run_settings) -> float:
    """Run `steps` steps with `weights` in the trainer against a `FrozenReplica` and return the
    largest relative gap of its per-step `kl` to `reference`'s (a `tails_run` result with the same
    settings). Prints both kl series; a gap under `tolerance` means the weights are the same."""
    mine = tails_run(FrozenReplica, steps=steps, weights=weights, **run_settings)["records"]
    theirs = reference["records"][:len(mine)]
    gap = max(abs(a["kl"] - b["kl"]) / max(b["kl"], 1e-9) for a, b in zip(mine, theirs))
    print("kl per step, yours    :", [f"{r['kl']:.2e}" for r in mine])
    print("           reference's:", [f"{r['kl']:.2e}" for r in theirs])
    print(f"largest relative gap {gap:.1e} (same run below {tolerance:g})")
    return gap


def _accuracy_range(summaries, *more: float) -> tuple[float, float]:
    values = [v for s in summaries for v in (s["accuracy_before"], s["accuracy_after"])]
    return max(0.0, min(*values, *more) - 0.05), min(1.0, max(*values, *more) + 0.05)


def plot_staleness(runs: dict[int, dict], summaries: dict[int, dict], steps: int):
    """Figure: per max_staleness k, `kl` per step, the 1 %-99 % band of pi_prox / mu per step
    next to the clip's band, and the greedy accuracy after the run. Returns the figure."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 4.2))
    for k, run in runs.items():
        x = [r["step"] for r in run["records"]]
        axes[0].plot(x, [max(r["kl"], 1e-10) for r in run["records"]], label=f"k = {k}")
        axes[1].fill_between(x, [t["q01"] for t in run["tails"]], [t["q99"] for t in run["tails"]],
                             alpha=0.3, label=f"k = {k}")
    axes[1].axhspan(*CLIP_BAND, color="grey", alpha=0.1, label="the clip's band")
    axes[2].bar([str(k) for k in summaries], [s["accuracy_after"] for s in summaries.values()])
    first = next(iter(summaries.values()))
    axes[2].axhline(first["accuracy_before"], color="grey", ls="--", label="before training")
    axes[0].set(yscale="log", xlabel="step", title="kl: k3 of KL(mu || pi_theta), per step")
    axes[1].set(xlabel="step", title="pi_prox / mu over the sampled tokens: 1 % .. 99 %")
    axes[2].set(xlabel="max_staleness", ylim=_accuracy_range(summaries.values()),
                title=f"greedy accuracy after {steps} steps")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def plot_frozen(runs: dict[str, dict], summaries: dict[str, dict], updating_accuracy: float,
                steps: int):
    """Figure: per objective against a frozen replica, `kl` per step and the greedy accuracy
    after the run, next to a run whose replica updates (`updating_accuracy`)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, run in runs.items():
        axes[0].plot([r["step"] for r in run["records"]], [r["kl"] for r in run["records"]],
                     label=name)
    names = list(summaries)
    axes[1].bar(names, [summaries[n]["accuracy_after"] for n in names])
    axes[1].axhline(summaries[names[0]]["accuracy_before"], color="grey", ls="--",
                    label="before")
    axes[1].axhline(updating_accuracy, color="tab:green", ls=":",
                    label="a replica that updates (k = 0)")
    axes[0].set(yscale="log", xlabel="step", title="kl: k3 of KL(frozen replica || pi_theta)")
    axes[1].set(ylim=_accuracy_range(summaries.values(), updating_accuracy),
                title=f"greedy accuracy after {steps} steps")
    axes[1].tick_params(axis="x", labelsize=8)
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
