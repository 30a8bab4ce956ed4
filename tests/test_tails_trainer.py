"""grpo_lab_course.tails_trainer: notebook 05b's tails, summaries, weights hook and plots, on
hand-made records (no training run)."""

import math
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import pytest
import torch

from grpo_lab.algo.sampler_correction import sampler_importance_weights
from grpo_lab_course.tails_trainer import (
    CORRECTIONS,
    TailsTrainer,
    logged_weights,
    plot_staleness,
    ratio_tails,
    summarise,
)


def test_ratio_tails_reads_only_real_tokens():
    w = torch.tensor([[0.5, 1.0, 1.1, 9.0], [1.0, 2.0, 1.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])  # the 100 is padding
    tails = ratio_tails(torch.log(w), torch.zeros_like(w), mask)
    assert tails["min"] == pytest.approx(0.5) and tails["max"] == pytest.approx(9.0)
    assert tails["outside_clip"] == pytest.approx(3 / 7)  # 0.5, 9 and 2 of the 7 real tokens
    assert tails["q01"] < 0.6 and tails["q99"] > 8


def _run(kls, staleness=1.0):
    records = [{"step": i + 1, "kl": kl, "ratio": 1.0, "clip_ratio/region_mean": 0.01 * i,
                "sample/staleness_mean": staleness, "reward": 0.5,
                "sampling/importance_sampling_ratio/min": 0.1 * (i + 1),
                "sampling/importance_sampling_ratio/max": 1.0 + i} for i, kl in enumerate(kls)]
    tails = [{"min": 0.9, "q01": 0.95, "q99": 1.05 + 0.1 * i, "max": 1.5, "outside_clip": 0.0}
             for i in range(len(kls))]
    return {"records": records, "tails": tails, "accuracy": [(0, 0.4), (len(kls), 0.5)],
            "worker_stopped": True}


def test_summarise_skips_the_warm_up():
    s = summarise(_run([1.0, 2.0, 4.0]), skip=1)
    assert s["kl"] == pytest.approx(3.0)  # the mean of steps 2 and 3 only
    assert s["q99"] == pytest.approx(1.20)
    assert (s["accuracy_before"], s["accuracy_after"]) == (0.4, 0.5)


def test_logged_weights_are_the_run_extremes():
    assert logged_weights({"TIS": _run([1.0, 2.0])}) == {"TIS": (pytest.approx(0.1), 2.0)}


def test_weights_hook_replaces_the_configured_correction():
    trainer = object.__new__(TailsTrainer)  # the hook only, no model
    trainer.config = SimpleNamespace(vllm_importance_sampling_mode="token_mask",
                                     vllm_importance_sampling_clip_max=5.0,
                                     vllm_importance_sampling_clip_min=None)
    prox, behav, mask = torch.log(torch.tensor([[2.0, 7.0]])), torch.zeros(1, 2), torch.ones(1, 2)
    trainer.weights = None
    configured, _ = trainer.sampler_weights(prox, behav, mask)
    assert torch.allclose(configured, sampler_importance_weights(
        prox, behav, mask, mode="token_mask", clip_max=5.0))
    trainer.weights = lambda p, b, m: torch.full_like(p, 0.25)
    mine, metrics = trainer.sampler_weights(prox, behav, mask)
    assert torch.equal(mine, torch.full((1, 2), 0.25)) and metrics


def test_plot_staleness_draws_the_records():
    runs = {0: _run([1e-9, 1e-9]), 8: _run([1e-3, 2e-3])}
    fig = plot_staleness(runs, {k: summarise(r) for k, r in runs.items()}, steps=2)
    lines = fig.axes[0].get_lines()
    assert [list(line.get_ydata()) for line in lines] == [[1e-9, 1e-9], [1e-3, 2e-3]]
    assert [bar.get_height() for bar in fig.axes[2].patches] == [0.5, 0.5]
    low, high = fig.axes[2].get_ylim()
    assert low < 0.4 and high > 0.5  # the accuracy before training (0.4) is in view


def test_corrections_name_trl_options():
    assert not CORRECTIONS["clip alone"]["vllm_importance_sampling_correction"]
    assert {s.get("vllm_importance_sampling_mode") for s in CORRECTIONS.values()} == {
        None, "token_truncate", "sequence_mask", "token_mask"}
    assert all(math.isfinite(s.get("vllm_importance_sampling_clip_max", 0))
               for s in CORRECTIONS.values())
