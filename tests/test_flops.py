"""MFU (grpo_lab.watch.flops): the FLOP count, the peaks, and the trainers' `perf/mfu_*` and
`batch/*` metrics (grpo_lab.watch.step_metrics)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from grpo_lab.algo.packing import make_micro_batches
from grpo_lab.train.distributed import Processes
from grpo_lab.train.rollout_batch import RolloutBatch
from grpo_lab.watch import flops
from grpo_lab.watch.flops import flops_per_token, gpu_peak_flops, mfu
from grpo_lab.watch.step_metrics import layout_metrics, throughput_metrics

# h 64, 2 layers, vocab 100, 4 query heads and 2 key/value heads of 16, MLP 128
SMALL = LlamaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=100, num_attention_heads=4,
                    num_key_value_heads=2, intermediate_size=128)


def test_flops_per_token_is_the_hand_count():
    qkv = 2 * 64 * (4 + 2 + 2) * 16  # Q, K, V projections: 16,384
    out = 2 * 4 * 16 * 64  # O: 8,192
    scores = 2 * 2 * 4 * 16 * 10  # Q.K^T and attn.V at seq_len 10: 2,560
    mlp = 2 * 3 * 64 * 128  # gate, up, down: 49,152
    head = 2 * 100 * 64  # LM head: 12,800
    assert flops_per_token(SMALL, 10) == 3 * (2 * (qkv + out + scores + mlp) + head) == 496_128


def test_flops_per_token_is_trls():
    utils = pytest.importorskip("trl.trainer.utils")
    if not hasattr(utils, "compute_flops_per_token"):
        pytest.skip("this TRL has no compute_flops_per_token")
    for seq_len in (1, 10, 333):
        assert flops_per_token(SMALL, seq_len) == utils.compute_flops_per_token(SMALL, seq_len)


def test_a_config_without_the_fields_has_no_count():
    from transformers import GPT2Config

    assert flops_per_token(GPT2Config(), 10) is None


def test_published_gpu_peaks():
    bf16 = torch.bfloat16
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", bf16) == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", bf16) == 756e12
    assert gpu_peak_flops("NVIDIA H200", bf16) == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", bf16) == 312e12
    assert gpu_peak_flops("NVIDIA L40S", bf16) == 362e12
    assert gpu_peak_flops("NVIDIA L4", bf16) == 121e12
    assert gpu_peak_flops("NVIDIA A10G", bf16) == 125e12
    assert gpu_peak_flops("Tesla T4", bf16) is None  # not in the table: no MFU
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32) is None


def test_mfu_is_a_percentage_as_trls():
    assert mfu(flops=2e12, seconds=2.0, peak=1e13) == pytest.approx(10.0)
    assert mfu(flops=2e12, seconds=2.0, peak=1e13, processes=2) == pytest.approx(5.0)


def test_the_cpu_peak_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("GRPO_LAB_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(flops, "measure_cpu_flops", lambda threads: calls.append(threads) or 5e10)
    assert flops.cpu_peak_flops(1) == flops.cpu_peak_flops(1) == 5e10
    assert calls == [1]  # the second call read the cache
    flops.cpu_peak_flops(2)  # another thread count is another measurement
    assert calls == [1, 2]
    keys = list(json.loads((tmp_path / "cpu_peak_flops.json").read_text()))
    assert len(keys) == 2 and all(torch.__version__ in k for k in keys)
    assert flops.peak_flops("cpu", torch.float32, 1) == 5e10
    monkeypatch.setattr(flops, "measure_cpu_flops", lambda threads: 4e10)  # a busier machine
    assert flops.cpu_peak_flops(1, refresh=True) == 5e10  # the larger is kept


def test_a_real_cpu_measurement_is_positive():
    assert flops.measure_cpu_flops(1, sizes=(128,), repeats=1) > 1e6


def _batch(prompt_lens, completion_lens):
    B, P, C = len(prompt_lens), max(prompt_lens), max(completion_lens)
    prompt_mask = torch.tensor([[0] * (P - p) + [1] * p for p in prompt_lens])
    completion_mask = torch.tensor([[1] * c + [0] * (C - c) for c in completion_lens])
    return RolloutBatch(prompt_ids=prompt_mask * 5, prompt_mask=prompt_mask,
                        completion_ids=completion_mask * 7, completion_mask=completion_mask,
                        old_logps=torch.zeros(B, C), rewards=torch.zeros(B),
                        advantages=torch.zeros(B))


def test_layout_metrics_of_padded_micro_batches():
    batch = _batch([3, 3, 2, 2], [4, 1, 2, 2])  # lengths 7, 4, 4, 4
    mbs = make_micro_batches(batch, token_budget=14)  # [7, 4] (2 x 7) and [4, 4] (2 x 4)
    metrics, (tokens, sequences) = layout_metrics(batch, mbs, 14, Processes("cpu"))
    assert (tokens, sequences) == (19, 4)
    assert metrics["batch/forwarded_tokens_per_step"] == 22
    assert metrics["batch/row_tokens_mean"] == 11 and metrics["batch/row_tokens_max"] == 14
    assert metrics["batch/row_fill_frac"] == pytest.approx(22 / 28)
    assert metrics["batch/pad_frac"] == pytest.approx(3 / 22)
    assert metrics["batch/samples_per_row"] == 2 and metrics["batch/samples_per_step"] == 4
    assert metrics["batch/trained_tokens_per_step"] == 9
    assert metrics["batch/masked_token_frac"] == pytest.approx(10 / 19)
    assert metrics["sample/forwarded_tokens_mean"] == pytest.approx(19 / 4)
    assert metrics["sample/forwarded_tokens_max"] == 7
    assert metrics["sample/trained_tokens_mean"] == pytest.approx(9 / 4)
    out = throughput_metrics(metrics, passes=1, fwd_bwd_s=2.0, step_s=4.0, flops=1e9, peak=1e10)
    assert out["perf/forwarded_tok_s_fwd_bwd"] == 11
    assert out["perf/trained_tok_s_wall_clock"] == 2.25
    assert out["perf/mfu_fwd_bwd"] == pytest.approx(5.0)
    assert out["perf/mfu_wall_clock"] == pytest.approx(2.5)
    assert "perf/mfu_fwd_bwd" not in throughput_metrics(metrics, 1, 2.0, 4.0, 1e9, None)


def test_a_short_async_run_logs_mfu(tiny_model_dir, tmp_path):
    from grpo_lab.train.async_config import AsyncGRPOConfig
    from grpo_lab.train.async_trainer import AsyncGRPOTrainer
    from grpo_lab.watch.metrics import read_metrics

    cfg = AsyncGRPOConfig(model=str(tiny_model_dir), steps=3, prompts_per_step=2,
                          num_generations=2, eval_every=0, eval_size=4, progress=False,
                          log_every=100, output_dir=str(tmp_path / "run"))
    AsyncGRPOTrainer(cfg).train()
    records = [r for r in read_metrics(tmp_path / "run") if "perf/mfu_fwd_bwd" in r]
    assert len(records) == 3
    for r in records:  # percent, as TRL logs it; the wall clock includes waiting
        assert 0 < r["perf/mfu_wall_clock"] <= r["perf/mfu_fwd_bwd"] <= 100
        assert r["batch/groups_per_step"] == 2 and r["batch/samples_per_step"] == 4
        assert 0 <= r["clip_ratio/low_min"] <= 1 and 0 <= r["clip_ratio/high_max"] <= 1


def test_a_subclass_with_its_own_update_still_steps(tiny_model_dir):
    """Notebook 01 overrides `optimize` with its own stage 4: no layout metrics, so no
    throughput or MFU, and the step goes on."""
    from grpo_lab.train.config import GRPOConfig
    from grpo_lab.train.trainer import GRPOTrainer

    class OwnUpdate(GRPOTrainer):
        def optimize(self, batch):
            return {"loss": 0.0, "grad_norm": 0.0}

    trainer = OwnUpdate(GRPOConfig(model=str(tiny_model_dir), prompts_per_step=2,
                                   num_generations=2, steps=1, eval_size=4, progress=False))
    record = trainer.step()
    assert record["step"] == 1 and "perf/step_s" in record
    assert not any(name.startswith("perf/mfu") for name in record)
