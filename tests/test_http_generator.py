"""`HTTPGenerator`: the weight sync through a bucket and sampling over HTTP, against a real
server process; and a few GRPO steps whose rollouts all come from that server."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_lab.algo.logprobs import policy_logprobs
from grpo_lab.bucket.adapters import AdapterBucket
from grpo_lab.rollout.generators import Generator
from grpo_lab.rollout.http_generator import HTTPGenerator
from grpo_lab.serve.client import ServerError
from grpo_lab.train.rollout_batch import pad_left, pad_right


@pytest.fixture
def server(server_process):
    return server_process(enable_lora=True, max_lora_rank=8, max_loras=4,
                          logprobs_mode="processed_logprobs")


def test_publish_syncs_versions_and_generate_matches_the_trainer(server, tmp_path, peft_model,
                                                                 tiny_model_and_tokenizer):
    tokenizer = tiny_model_and_tokenizer[1]
    bucket = AdapterBucket(tmp_path / "lora", max_staleness=1)
    generator = HTTPGenerator(server.url, bucket, max_staleness=1, seed=0)
    try:
        assert isinstance(generator, Generator)
        for version in range(4):  # each version a different adapter
            with torch.no_grad():
                for name, param in peft_model.named_parameters():
                    if "lora_B" in name:
                        param.add_(torch.randn(param.shape) * 0.05)
            generator.publish(peft_model, version)
            names = [m["id"] for m in generator.client.models()][1:]
            # max_staleness + 1 versions stay loaded; the bucket keeps one more on disk.
            assert names == [f"policy-v{v}" for v in range(max(0, version - 1), version + 1)]
            assert bucket.versions() == list(range(max(0, version - 2), version + 1))
        assert generator.latest_version == 3
        assert [s["version"] for s in generator.syncs] == [0, 1, 2, 3]
        assert all(s["bytes"] > 0 and s["sync_s"] >= s["load_s"] for s in generator.syncs)

        prompts = [tokenizer(t)["input_ids"] for t in ("12+34=", "7+8=", "99+1=")]
        out = generator.generate(prompts, version=3, num_generations=4, max_new_tokens=5,
                                 temperature=0.7)
        assert out.prompt_ids == [p for p in prompts for _ in range(4)]  # prompt-major
        p_ids, p_mask = pad_left(out.prompt_ids, tokenizer.pad_token_id)
        c_ids, c_mask = pad_right(out.completion_ids, tokenizer.pad_token_id)
        served, _ = pad_right(out.logprobs, 0.0)
        with torch.no_grad():
            trainer = policy_logprobs(peft_model, p_ids, p_mask, c_ids, c_mask, 0.7)
        assert ((torch.exp(trainer - served.float()) - 1).abs() * c_mask).max() < 1e-3
        with pytest.raises(KeyError, match="policy-v0"):  # unloaded two syncs ago
            generator.generate(prompts, version=0, num_generations=1, max_new_tokens=2,
                               temperature=1.0)
    finally:
        generator.close()


@pytest.mark.parametrize("request_shape, requests_per_step", [("group", 4), ("single", 16)])
def test_grpo_steps_over_http_keep_the_ratio_at_1(server, tmp_path, tiny_model_and_tokenizer,
                                                 request_shape, requests_per_step):
    from grpo_lab.train.async_config import AsyncGRPOConfig
    from grpo_lab.train.async_trainer import AsyncGRPOTrainer

    torch.set_num_threads(1)
    model, tokenizer = tiny_model_and_tokenizer
    config = AsyncGRPOConfig(steps=3, prompts_per_step=4, num_generations=4, eval_size=16,
                             eval_every=0, progress=False, log_every=100, asynchronous=False,
                             lora_rank=1, max_staleness=0)
    bucket = AdapterBucket(tmp_path / "lora", prefix=f"run-{request_shape}", max_staleness=0)
    generator = HTTPGenerator(server.url, bucket, max_staleness=0, seed=0,
                              request_shape=request_shape)
    try:
        trainer = AsyncGRPOTrainer(config, model=copy.deepcopy(model), tokenizer=tokenizer,
                                   generator=generator)
        records = [r for r in trainer.train() if r["step"] > 0]
        assert len(records) == 3
        for record in records:  # staleness 0, one update per batch: the ratio is exactly 1
            assert abs(record["ratio"] - 1) < 1e-3, record
            # All of a step's requests at once: 4 prompts (n = 4), or 4 x 4 completions (n = 1).
            assert record["rollout/inflight_max"] == requests_per_step
            assert record["rollout/vllm_retry_total"] == 0  # no replica went down
            assert 0 < record["perf/mfu_wall_clock"] <= record["perf/mfu_fwd_bwd"]
        assert generator.latest_version == 3
        loaded = [m["id"] for m in generator.client.models()
                  if m["id"].startswith(bucket.prefix + "-")]
        assert loaded == [f"{bucket.prefix}-v3"] and bucket.versions() == [2, 3]
    finally:
        generator.close()


# 6 prompts x G = 2: "group" sends 6 requests (the cap counts prompts), "single" sends 12 of
# n = 1 (the cap counts completions, as TRL's does).
@pytest.mark.parametrize("shape, cap, expected_peak", [
    ("group", 1, 1), ("group", 2, 2), ("group", None, 6),
    ("single", 3, 3), ("single", None, 12)])
def test_max_inflight_caps_the_requests_in_flight(server, tmp_path, peft_model,
                                                  tiny_model_and_tokenizer, shape, cap,
                                                  expected_peak):
    tokenizer = tiny_model_and_tokenizer[1]
    bucket = AdapterBucket(tmp_path / "lora", prefix=f"cap-{shape}-{cap}", max_staleness=0)
    generator = HTTPGenerator(server.url, bucket, max_staleness=0, seed=0, max_inflight=cap,
                              request_shape=shape)
    try:
        generator.publish(peft_model, 0)
        prompts = [tokenizer(f"{i}+{i}=")["input_ids"] for i in range(6)]
        out = generator.generate(prompts, version=0, num_generations=2, max_new_tokens=4,
                                 temperature=1.0)
        assert out.prompt_ids == [p for p in prompts for _ in range(2)]  # order kept under a cap
        assert generator.inflight_peak == expected_peak
        assert generator.pop_inflight_peak() == expected_peak  # per step: then it starts again
        assert generator.pop_inflight_peak() == 0
    finally:
        generator.client.unload_lora_adapter(generator.name(0))
        generator.close()


def test_single_shape_sends_g_requests_per_prompt_retried_one_by_one(
        server, tmp_path, peft_model, tiny_model_and_tokenizer):
    tokenizer = tiny_model_and_tokenizer[1]
    bucket = AdapterBucket(tmp_path / "lora", prefix="single", max_staleness=0)
    generator = HTTPGenerator(server.url, bucket, max_staleness=0, seed=0, retries=1,
                              retry_every_s=0.0, request_shape="single")
    sent = []  # (prompt, n, seed) of every request that reached the server
    completions = generator.client.client.completions

    async def first_try_of_request_5_fails(prompt, **kwargs):
        sent.append((tuple(prompt), kwargs["n"], kwargs["seed"]))
        if len(sent) == 5:  # a replica died under this one request
            raise ServerError("POST", "/v1/completions", 503, "replica down")
        return await completions(prompt, **kwargs)

    try:
        generator.publish(peft_model, 0)
        generator.client.client.completions = first_try_of_request_5_fails
        prompts = [tokenizer(t)["input_ids"] for t in ("12+34=", "7+8=", "99+1=")]
        out = generator.generate(prompts, version=0, num_generations=4, max_new_tokens=6,
                                 temperature=1.0)
        assert out.prompt_ids == [p for p in prompts for _ in range(4)]  # prompt-major
        assert len(out.completion_ids) == len(out.logprobs) == len(out.texts) == 12
        # 3 x 4 requests of n = 1, prompt-major, then request 5 (prompt 2's first) alone again.
        assert [(prompt, n) for prompt, n, _ in sent] == (
            [(tuple(p), 1) for p in prompts for _ in range(4)] + [(tuple(prompts[1]), 1)])
        assert sent[-1] == sent[4] and generator.retried == 1
        assert len({seed for _, _, seed in sent[:12]}) == 12  # a seed per completion
        for group in range(3):  # so a prompt's G samples differ
            samples = out.completion_ids[4 * group: 4 * group + 4]
            assert len({tuple(c) for c in samples}) > 1, samples
    finally:
        generator.client.unload_lora_adapter(generator.name(0))
        generator.close()


def test_max_inflight_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match="max_inflight"):
        HTTPGenerator("http://127.0.0.1:9", AdapterBucket(tmp_path), max_inflight=0)
    with pytest.raises(ValueError, match="request_shape"):
        HTTPGenerator("http://127.0.0.1:9", AdapterBucket(tmp_path), request_shape="n")


def test_a_python_run_after_a_failed_one_cleans_the_server_and_numbers_after_the_bucket(
        server, tmp_path, tiny_model_and_tokenizer):
    """A run that died leaves its adapters loaded and its versions in the bucket; the next
    Python run on the same server and bucket unloads them and numbers its versions after them
    (as `grpo-lab train-async` does), instead of failing on a name already taken."""
    from grpo_lab.train.async_config import AsyncGRPOConfig
    from grpo_lab.train.async_trainer import AsyncGRPOTrainer

    torch.set_num_threads(1)
    model, tokenizer = tiny_model_and_tokenizer
    config = AsyncGRPOConfig(steps=2, prompts_per_step=2, num_generations=2, eval_size=8,
                             eval_every=0, progress=False, log_every=100, asynchronous=False,
                             lora_rank=1, max_staleness=1)
    bucket = AdapterBucket(tmp_path / "lora", prefix="failed", max_staleness=1)
    first = HTTPGenerator(server.url, bucket, max_staleness=1, seed=0)
    try:  # the "failed" run: two versions published, never cleaned up
        peft = AsyncGRPOTrainer(config, model=copy.deepcopy(model), tokenizer=tokenizer,
                                generator=first)
        first.publish(peft.model, 0)
        first.publish(peft.model, 1)
    finally:
        first.close()
    second = HTTPGenerator(server.url, AdapterBucket(tmp_path / "lora", prefix="failed",
                                                     max_staleness=1), max_staleness=1, seed=0)
    try:
        trainer = AsyncGRPOTrainer(config, model=copy.deepcopy(model), tokenizer=tokenizer,
                                   generator=second)
        records = [r for r in trainer.train() if r["step"] > 0]
        assert len(records) == 2
        assert second.unloaded_at_start == ["failed-v0", "failed-v1"]
        assert [s["version"] for s in second.syncs] == [2, 3, 4]  # after the bucket's 0 and 1
        loaded = [m["id"] for m in second.client.models() if m["id"].startswith("failed-")]
        assert loaded == ["failed-v3", "failed-v4"]
    finally:
        second.close()
