"""TRL parity of the sampler/trainer importance-sampling correction (TRL's
`vllm_importance_sampling_*`): grpo_lab's `sampler_importance_weights`, `sampling/*` metrics and
`grpo_loss(importance_weights=)` against TRL's own code, for every
`vllm_importance_sampling_mode`, with and without clip_min: weights, metrics, loss and gradients
agree to float32 rounding (tests/float_tolerance.py). Negative cases show a wrong cap, bound or
mode on grpo_lab's side fails. The loss without the correction is in test_trl_parity_loss.py;
both share tests/trl_parity_helpers.py.

TRL computes the weights and the `sampling/*` metrics inline in `_generate_and_score_completions`
when `use_vllm`: that method runs for real here, with its two model calls stubbed on the
instance: `_generate` returns the batch's tokens with "vLLM" logprobs, and
`_get_per_token_logps_and_entropies` returns the batch's old logprobs as the trainer's. Then
`_compute_loss` applies the weights. grpo_lab's `sampler_importance_weights` and `grpo_loss`
get the same tensors.
"""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch
from float_tolerance import assert_f32_close, assert_grads_close, f32_atol
from trl import GRPOConfig as TRLConfig
from trl_parity_helpers import (
    BETA,
    LONGEST_COMPLETION,
    MAX_COMPLETION_LENGTH,
    MISS,
    B,
    configured,
    fraction_atol,
    gradients,
    kl_atol,
    last_metric,
    loss_atol,
    make_batch,
    make_trainer,
    our_logprobs,
    positions,
    randomised_lora,
    real_tokens,
    single_torch_thread,
    trl_inputs,
)

from grpo_lab.algo import grpo_loss as core
from grpo_lab.algo.sampler_correction import (
    sampler_correction_metrics,
    sampler_importance_weights,
    sampler_log_ratio,
)
from grpo_lab.train.config import GRPOConfig

IS_SETTINGS = {  # id: (mode, clip_max, clip_min)
    "token_truncate": ("token_truncate", 2.0, None),
    "token_mask": ("token_mask", 2.0, None),
    "sequence_truncate": ("sequence_truncate", 2.0, None),
    "sequence_mask": ("sequence_mask", 2.0, None),
    "token_truncate-min": ("token_truncate", 2.0, 0.5),
    "token_mask-min": ("token_mask", 2.0, 0.5),
    "sequence_truncate-min": ("sequence_truncate", 2.0, 0.5),
    "sequence_mask-min": ("sequence_mask", 2.0, 0.5),
    "token_mask-min-only": ("token_mask", None, 0.5),
    "sequence_mask-TRL-defaults": ("sequence_mask", 3.0, None),
}
IS_ATTRS = ("use_vllm", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "beta")
NAN_TOKEN = (5, 0)  # (row, token) whose sampler logprob is unavailable (vLLM sends None)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    with single_torch_thread():
        yield


@pytest.fixture(scope="module")
def trainer(tiny_model_dir, tmp_path_factory):
    return make_trainer(tiny_model_dir, tmp_path_factory.mktemp("trl-parity-sampler"))


@pytest.fixture(scope="module")
def model(trainer):
    return randomised_lora(trainer)


@pytest.fixture(scope="module")
def batch(trainer, model):
    return make_batch(trainer, model)


@pytest.fixture(scope="module")
def sampler_logps(batch):
    """"vLLM" logprobs: the old (trainer's) ones moved by ~0.6 nat per token, so token ratios span
    ~0.3-3 and sequence ratios more; one NaN token; 0 on padding, as TRL pads them. Rows 0 (one
    token) and 9 (four) are 1 nat per token less likely under the sampler: sequence ratios ~2.9
    and ~70, so that the caps bite on sequences with a nonzero advantage, not only on the last
    group's (advantage 0, where no weight changes the loss)."""
    generator = torch.Generator().manual_seed(3)
    noise = 0.6 * torch.randn(batch["old_logps"].shape, generator=generator)
    noise[[0, 9]] -= 1.0
    logps = (batch["old_logps"] + noise) * batch["completion_mask"]
    logps[NAN_TOKEN] = float("nan")
    return logps


@contextmanager
def trl_with_vllm_correction(trainer, batch, sampler, mode, clip_max, clip_min):
    """TRL's trainer as with vLLM and the correction on, its sampling and scoring stubbed."""
    real = batch["completion_mask"].bool()
    prompt_lists = [ids[m.bool()].tolist()
                    for ids, m in zip(batch["prompt_ids"], batch["prompt_mask"], strict=True)]
    completion_lists = [ids[m].tolist()
                        for ids, m in zip(batch["completion_ids"], real, strict=True)]
    sampler_lists = [[None if math.isnan(x) else x for x in row[m].tolist()]
                     for row, m in zip(sampler, real, strict=True)]
    texts = trainer.processing_class.batch_decode(completion_lists, skip_special_tokens=True)

    def generate(prompts):
        return prompt_lists, completion_lists, None, texts, sampler_lists, {}, None, None

    def per_token_logps_and_entropies(*args, **kwargs):
        return batch["old_logps"].clone(), None, None

    settings = dict(use_vllm=True, vllm_importance_sampling_correction=True,
                    vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_max=clip_max,
                    vllm_importance_sampling_clip_min=clip_min, beta=0.0)
    saved = {name: getattr(trainer, name) for name in IS_ATTRS}
    for name, value in settings.items():
        setattr(trainer, name, value)
    trainer._generate = generate  # instance attributes shadow the methods
    trainer._get_per_token_logps_and_entropies = per_token_logps_and_entropies
    try:
        yield trainer
    finally:
        del trainer._generate, trainer._get_per_token_logps_and_entropies
        for name, value in saved.items():
            setattr(trainer, name, value)


def trl_correction(trainer, batch, sampler, mode, clip_max, clip_min):
    """TRL's importance weights and `sampling/*` metrics for `sampler` vs the batch's old logps."""
    rows = [{"prompt": "1+1=", "answer": "002"} for _ in range(B)]  # rewards are not compared here
    with trl_with_vllm_correction(trainer, batch, sampler, mode, clip_max, clip_min), \
            torch.no_grad():
        out = trainer._generate_and_score_completions(rows)
    # The stubs were used: TRL's tensors are the batch's.
    assert torch.equal(out["completion_ids"], batch["completion_ids"])
    assert torch.equal(out["old_per_token_logps"], batch["old_logps"])
    names = [f"sampling/sampling_logp_difference/{s}" for s in ("mean", "max")] + \
            [f"sampling/importance_sampling_ratio/{s}" for s in ("min", "mean", "max")]
    return out["importance_sampling_ratio"], {name: last_metric(trainer, name) for name in names}


def our_correction(batch, sampler, mode, clip_max, clip_min):
    weights = sampler_importance_weights(batch["old_logps"], sampler, batch["completion_mask"],
                                         mode=mode, clip_max=clip_max, clip_min=clip_min)
    metrics = sampler_correction_metrics(batch["old_logps"], sampler, weights,
                                         batch["completion_mask"], mode)
    return weights, metrics


def weight_scale(batch, sampler, weights) -> float:
    """Size of a weight's rounding: w = exp(sum of log-ratios of size |log pi_old - log
    pi_sampler|), so an ulp of each log-ratio moves w by w x that ulp."""
    log_ratios = sampler_log_ratio(batch["old_logps"], sampler, batch["completion_mask"])
    return weights.max().item() * max(1.0, log_ratios.abs().max().item())


@pytest.mark.parametrize("setting", IS_SETTINGS, ids=list(IS_SETTINGS))
def test_sampler_importance_weights_match_trl(trainer, batch, sampler_logps, setting):
    mode, clip_max, clip_min = IS_SETTINGS[setting]
    trl_weights, trl_metrics = trl_correction(trainer, batch, sampler_logps, mode, clip_max,
                                              clip_min)
    weights, metrics = our_correction(batch, sampler_logps, mode, clip_max, clip_min)
    assert weights.shape == trl_weights.shape == ((B, 1) if mode.startswith("sequence") else
                                                  batch["old_logps"].shape)
    scale = weight_scale(batch, sampler_logps, weights)
    # A sequence weight sums up to LONGEST_COMPLETION log-ratios; the metrics average the tokens.
    assert_f32_close(weights, trl_weights, f32_atol(scale, LONGEST_COMPLETION), "weights")
    assert_f32_close(metrics, trl_metrics, f32_atol(scale, real_tokens(batch)), "metrics")
    # Not vacuous: the bounds bite on this batch (some weights clipped or zeroed, others kept).
    raw = torch.exp(sampler_log_ratio(batch["old_logps"], sampler_logps, batch["completion_mask"]))
    if mode.startswith("sequence"):
        raw = raw.prod(-1, keepdim=True)
    real = torch.ones_like(raw, dtype=torch.bool) if mode.startswith("sequence") else \
        batch["completion_mask"].bool()
    outside = torch.zeros_like(real)
    if clip_max is not None:
        outside |= raw > clip_max
    if clip_min is not None:
        outside |= raw < clip_min
    assert (outside & real).any() and (~outside & real).any()
    assert not torch.isnan(weights).any()
    if not mode.startswith("sequence"):  # no sampler logprob: no correction (weight 1), as TRL
        assert weights[NAN_TOKEN] == 1


@pytest.mark.parametrize("loss_type", core.LOSS_TYPES)
@pytest.mark.parametrize("beta", [0.0, BETA])
@pytest.mark.parametrize("setting", ["token_truncate", "token_mask-min", "sequence_truncate-min",
                                     "sequence_mask"])
def test_corrected_loss_matches_trl(trainer, model, batch, sampler_logps, loss_type, beta, setting):
    """TRL's `_compute_loss` with its own weights == grpo_lab's `grpo_loss(importance_weights=)`
    with grpo_lab's: loss, gradients and the clip/KL metrics."""
    mode, clip_max, clip_min = IS_SETTINGS[setting]
    trl_weights, _ = trl_correction(trainer, batch, sampler_logps, mode, clip_max, clip_min)
    weights, _ = our_correction(batch, sampler_logps, mode, clip_max, clip_min)
    eps = dict(epsilon_low=0.2, epsilon_high=0.28)
    inputs = dict(trl_inputs(batch, off_policy=True, beta=beta),
                  importance_sampling_ratio=trl_weights)
    with trl_vllm_flags(trainer), configured(trainer, loss_type=loss_type, beta=beta, **eps):
        trl_loss = trainer._compute_loss(model, inputs)
        logps = our_logprobs(model, batch)
        ours, metrics = core.grpo_loss(
            logps, batch["old_logps"], batch["advantages"], batch["completion_mask"],
            loss_type=loss_type, beta=beta, ref_logps=batch["ref_logps"] if beta else None,
            max_completion_length=MAX_COMPLETION_LENGTH, importance_weights=weights, **eps)
        uncorrected, _ = core.grpo_loss(
            logps, batch["old_logps"], batch["advantages"], batch["completion_mask"],
            loss_type=loss_type, beta=beta, ref_logps=batch["ref_logps"] if beta else None,
            max_completion_length=MAX_COMPLETION_LENGTH, **eps)
        atol = loss_atol(batch, off_policy=True, beta=beta, weights=weights)
        assert_f32_close(ours.item(), trl_loss.item(), atol, "loss")
        assert abs(trl_loss.item() - uncorrected.item()) > MISS * atol  # the weights matter
        assert_grads_close(gradients(model, ours), gradients(model, trl_loss), positions(batch))
        for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
            assert_f32_close(metrics[name], last_metric(trainer, name), fraction_atol(batch), name)
        if beta:
            assert_f32_close(metrics["kl"], last_metric(trainer, "kl"), kl_atol(batch), "kl")


@contextmanager
def trl_vllm_flags(trainer):
    """What `_compute_loss` reads to apply `inputs["importance_sampling_ratio"]`."""
    saved = trainer.use_vllm, trainer.vllm_importance_sampling_correction
    trainer.use_vllm = trainer.vllm_importance_sampling_correction = True
    try:
        yield trainer
    finally:
        trainer.use_vllm, trainer.vllm_importance_sampling_correction = saved


IS_ALTERATIONS = {  # name: (TRL's setting, grpo_lab's mode, clip_max, clip_min)
    "cap 2->3 (token_truncate)": ("token_truncate", ("token_truncate", 3.0, None)),
    "cap 2->3 (sequence_mask)": ("sequence_mask", ("sequence_mask", 3.0, None)),
    "clip_min dropped (token_mask)": ("token_mask-min", ("token_mask", 2.0, None)),
    "clip_min dropped (sequence_truncate)": ("sequence_truncate-min",
                                             ("sequence_truncate", 2.0, None)),
    "truncate->mask (token)": ("token_truncate", ("token_mask", 2.0, None)),
    "mask->truncate (sequence)": ("sequence_mask", ("sequence_truncate", 2.0, None)),
    "token->sequence (truncate)": ("token_truncate", ("sequence_truncate", 2.0, None)),
    "sequence->token (mask)": ("sequence_mask", ("token_mask", 2.0, None)),
}


@pytest.mark.parametrize("alteration", IS_ALTERATIONS, ids=list(IS_ALTERATIONS))
def test_altered_correction_does_not_match(trainer, model, batch, sampler_logps, alteration):
    """A wrong cap, bound or mode on grpo_lab's side changes the weights and the loss."""
    setting, (mode, clip_max, clip_min) = IS_ALTERATIONS[alteration]
    trl_weights, _ = trl_correction(trainer, batch, sampler_logps, *IS_SETTINGS[setting])
    weights, _ = our_correction(batch, sampler_logps, mode, clip_max, clip_min)
    inputs = dict(trl_inputs(batch, off_policy=True, beta=0.0),
                  importance_sampling_ratio=trl_weights)
    with trl_vllm_flags(trainer), configured(trainer, loss_type="grpo", beta=0.0), torch.no_grad():
        trl_loss = trainer._compute_loss(model, inputs)
        logps = our_logprobs(model, batch)
        altered, _ = core.grpo_loss(logps, batch["old_logps"], batch["advantages"],
                                    batch["completion_mask"], epsilon_low=0.2, epsilon_high=0.28,
                                    importance_weights=weights)
    assert not torch.allclose(weights.expand_as(batch["old_logps"]),
                              trl_weights.expand_as(batch["old_logps"]), atol=1e-3)
    atol = loss_atol(batch, off_policy=True, beta=0.0, weights=trl_weights)
    assert abs(trl_loss.item() - altered.item()) > MISS * atol, (alteration, trl_loss.item())


def test_trl_correction_config_names_and_defaults():
    """grpo_lab's options are TRL 1.16's GRPOConfig fields, with TRL's defaults."""
    # The fields' defaults, not an instance: building a TRLConfig resets accelerate's state,
    # which the module's trainer needs.
    trl = {name: f.default for name, f in TRLConfig.__dataclass_fields__.items()}
    ours = GRPOConfig()
    for name in ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                 "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min"):
        assert getattr(ours, name) == trl[name], name
    assert (ours.vllm_importance_sampling_mode, ours.vllm_importance_sampling_clip_max) == \
        ("sequence_mask", 3.0)
