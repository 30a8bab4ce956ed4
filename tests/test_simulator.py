"""The pipeline simulator (grpo_lab.plan.simulator): its records read like a real run's, its
model behaves as a pipeline must, and its run-2-5 predictions stay where the benchmark put them
(benchmarks/simulator_vs_blog.py)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from grpo_lab.model.shaped_models import QWEN25_MATH_15B
from grpo_lab.plan.sim_blog import (
    BLOG_MODEL,
    BLOG_RUNS,
    blog_costs,
    blog_lengths,
    blog_setting,
    costs_for,
    decoder_flops,
)
from grpo_lab.plan.sim_model import PipelineSetting, StageCosts
from grpo_lab.plan.simulator import simulate, summarize
from grpo_lab.watch.doctor import diagnose
from grpo_lab.watch.flops import flops_per_token
from grpo_lab.watch.metric_names import unknown_metrics
from grpo_lab.watch.step_metrics import buffer_metrics

STEPS = 80


@pytest.fixture(scope="module")
def blog():
    costs = blog_costs()
    runs = {}
    for run in BLOG_RUNS:
        setting = blog_setting(run)
        runs[run] = (setting, simulate(setting, costs, steps=STEPS))
    return costs, runs


def test_records_carry_the_real_trainers_names(blog):
    _, runs = blog
    record = runs[1][1][-1]
    assert unknown_metrics(record) == []  # every name is one the glossary explains
    pipeline = buffer_metrics({"perf/rollout_wait_cumulative_s": 0.0,
                               "rollout/backpressure_cumulative_s": 0.0,
                               "sample/rollout_queue_maxsize": 1,
                               "sample/dropped_stale_cumulative": 0,
                               "sample/time_in_queue_mean_s": 0.0}, {}, 0, 8)
    wanted = set(pipeline) | {"perf/step_s", "perf/fwd_bwd_s", "perf/weight_sync_s",
                              "sample/staleness_mean", "sample/staleness_max",
                              "rollout/version_wait_s", "rollout/generated_tok_s_busy",
                              "rollout/inflight_max", "batch/microbatches_per_step",
                              "perf/mfu_fwd_bwd", "batch/samples_per_row", "step", "time_s"}
    assert wanted <= set(record)


def test_blog_run1_reads_trainer_bound_and_a_starved_trainer_generation_bound(blog):
    costs, runs = blog
    assert diagnose(runs[1][1]).bottleneck == "trainer"
    assert summarize(runs[1][1], runs[1][0])["bottleneck"] == "trainer"
    # run 3's fast step against one replica behind a small cap: the trainer starves
    starved = replace(blog_setting(3), replicas=1, max_inflight=32)
    records = simulate(starved, costs, steps=STEPS)
    assert diagnose(records).bottleneck == "generation"
    assert summarize(records, starved)["bottleneck"] == "client_cap"


def test_run1_calibration_reproduces_run1():
    setting, costs = blog_setting(1), blog_costs()
    got = summarize(simulate(setting, costs, steps=STEPS), setting)
    published = BLOG_RUNS[1]
    assert got["fwd_bwd_s_p50"] == pytest.approx(published["fwd_bwd_s_p50"], rel=0.03)
    assert got["step_s_p50"] == pytest.approx(published["step_s_p50"], rel=0.03)
    assert got["mfu"] == pytest.approx(published["mfu"], rel=0.05)
    assert got["weight_sync_s_p50"] == pytest.approx(published["weight_sync_s_p50"], rel=0.05)
    assert got["micro_batches"] == 64 and got["samples_per_row"] == 1
    assert got["queue_size_p50"] == 512  # full: generation throttled


def test_more_replicas_never_slow_generation():
    costs = blog_costs()
    base = replace(blog_setting(5), max_inflight=None, buffer_size=512)
    rates = [summarize(simulate(replace(base, replicas=r), costs, steps=40),
                       base)["generation_tokens_per_s"] for r in (1, 2, 3)]
    assert rates[0] <= rates[1] * 1.02 and rates[1] <= rates[2] * 1.02


def test_a_bigger_inflight_cap_fills_the_queue_more():
    costs = blog_costs()
    setting = blog_setting(3)  # two replicas: the cap decides how fast they generate
    queues = [summarize(simulate(replace(setting, max_inflight=cap), costs, steps=STEPS),
                        setting)["queue_size_mean"] for cap in (16, 64, 384)]
    assert queues[0] < queues[1] < queues[2]
    assert queues[2] > 0.75 * setting.buffer_size * setting.num_generations  # full: trainer-bound


def test_deterministic_per_seed():
    setting, costs = blog_setting(2), blog_costs()
    a = simulate(setting, costs, steps=20, seed=3)
    assert a == simulate(setting, costs, steps=20, seed=3)
    assert a != simulate(setting, costs, steps=20, seed=4)


def test_flops_and_lengths_match_the_models_shape():
    config = SimpleNamespace(**{k: getattr(QWEN25_MATH_15B, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "intermediate_size")}, vocab_size=BLOG_MODEL["vocab"])
    base, per_ctx = decoder_flops()
    assert base + per_ctx * 1000 == flops_per_token(config, 1000)
    prompt, completion = blog_lengths()
    assert 0 < prompt < 1096 and 0 < completion < 3000


def test_costs_for_scales_with_size_and_hardware():
    base = blog_costs()
    same = costs_for(model_params=BLOG_MODEL["params"], trainer_gpus=2,
                     trainer_peak_flops=989e12, replica_memory_bandwidth=4.8e12,
                     replica_peak_flops=989e12)
    assert same.decode_step_s == pytest.approx(base.decode_step_s)
    assert same.train_token_s == pytest.approx(base.train_token_s)
    bigger = costs_for(model_params=2 * BLOG_MODEL["params"], trainer_gpus=1,
                       trainer_peak_flops=989e12 / 2, replica_memory_bandwidth=2.4e12,
                       replica_peak_flops=989e12, sync_s=20.0)
    assert bigger.decode_step_s == pytest.approx(4 * base.decode_step_s)
    assert bigger.train_token_s == pytest.approx(4 * base.train_token_s)
    setting = PipelineSetting(steps=12)
    syncs = [r["perf/weight_sync_s"] for r in simulate(setting, bigger) if r["perf/weight_sync_s"]]
    assert syncs and all(s == pytest.approx(20.0) for s in syncs)


def test_run_2_to_5_predictions_stay_within_the_benchmarks_errors(blog):
    """What benchmarks/results/simulator_vs_blog.json reports, with margin: fwd+bwd within
    20 % (it misses 15 % by 2 points in runs 3-5), MFU within 15 %, micro-batches exact, run 5's
    wall clock within 10 %, its queue within 15 %."""
    _, runs = blog
    for run in (2, 3, 4, 5):
        setting, records = runs[run]
        got, published = summarize(records, setting), BLOG_RUNS[run]
        assert got["fwd_bwd_s_p50"] == pytest.approx(published["fwd_bwd_s_p50"], rel=0.20)
        if "mfu" in published:
            assert got["mfu"] == pytest.approx(published["mfu"], rel=0.15)
        if "micro_batches" in published:
            assert got["micro_batches"] == published["micro_batches"]
    setting = blog_setting(5)
    got = summarize(simulate(setting, blog_costs()), setting)  # the whole 500 steps
    assert got["wall_clock_s"] == pytest.approx(BLOG_RUNS[5]["wall_clock_s"], rel=0.10)
    assert got["queue_size_mean"] == pytest.approx(BLOG_RUNS[5]["queue_size"], rel=0.15)
    assert got["step_s_p50"] == pytest.approx(BLOG_RUNS[5]["step_s_p50"], rel=0.20)


def _cpu_pipeline(**changes):
    """A small CPU-like pipeline: single-thread trainer and replicas of a tiny model."""
    setting = PipelineSetting(replicas=2, max_inflight=None, prompts_per_step=8,
                              num_generations=4, max_staleness=1, buffer_size=8,
                              micro_batch_size=32, gradient_checkpointing=False,
                              weight_sync_steps=1, steps=12, prompt_tokens=20,
                              max_completion_tokens=60, completion_tokens=30.0,
                              max_prompt_tokens=40, worker="batch")
    costs = StageCosts(decode_step_s=0.005, decode_seq_s=0.0, decode_ctx_s=0.0,
                       prefill_token_s=0.0, train_token_s=2e-4, train_micro_batch_s=0.01,
                       sync_pause_s=0.0, sync_save_s=0.05, sync_load_s=0.0, sync_other_s=0.0,
                       mount_lag_s=(0.0, 0.0), prefix_tail_tokens=0)
    return setting, replace(costs, **changes)


def test_shared_cores_slow_the_trainer_and_replicas_only_when_oversubscribed():
    setting, alone = _cpu_pipeline()
    base = simulate(setting, alone)
    # more cores than processes ever busy: the same run (None's, up to float rounding)
    roomy = simulate(setting, replace(alone, cores=16))
    for a, b in zip(base, roomy):
        assert b["perf/step_s"] == pytest.approx(a["perf/step_s"], rel=1e-9)
        assert b["perf/fwd_bwd_s"] == pytest.approx(a["perf/fwd_bwd_s"], rel=1e-9)
    # one core for a trainer, two replicas and the proxy: every stage slows
    shared = simulate(setting, replace(alone, cores=1))
    got, was = summarize(shared, setting), summarize(base, setting)
    assert got["fwd_bwd_s_p50"] > 1.3 * was["fwd_bwd_s_p50"]  # replicas busy during its pass
    assert got["fwd_bwd_s_p50"] <= 4.0 * was["fwd_bwd_s_p50"] + 1e-9  # at most 1/4 of a core
    assert got["wall_clock_s"] > 1.3 * was["wall_clock_s"]
    # one replica, no proxy, two cores: a trainer and a replica never share
    one = replace(setting, replicas=1)
    assert simulate(one, replace(alone, cores=2))[-1]["time_s"] == pytest.approx(
        simulate(one, alone)[-1]["time_s"], rel=1e-9)


def test_the_prefix_cache_saves_a_groups_later_prefills(blog):
    """A prompt's G completions are G requests: the first prefills the prompt, the other G - 1
    find it cached on the group's replica (all but a block's tail): a hit rate under (G - 1) / G.
    A request the proxy spills to a less loaded replica prefills again: one replica, which never
    spills, keeps the most."""
    costs, runs = blog
    setting, records = runs[1]
    G = setting.num_generations
    rate = summarize(records, setting)["prefix_cache_hit_rate"]
    alone = replace(setting, replicas=1)
    one = summarize(simulate(alone, costs, steps=20), alone)["prefix_cache_hit_rate"]
    tail = costs.prefix_tail_tokens / setting.prompt_tokens
    assert (G - 1) / G * (1 - 2 * tail) < one <= (G - 1) / G, one
    assert 0.7 < rate <= one, (rate, one)
    assert all(r["rollout/prefix_cache_hits"] <= r["rollout/prefix_cache_queries"]
               for r in records)
    pairs = replace(setting, num_generations=2)
    fewer = summarize(simulate(pairs, costs, steps=20), pairs)["prefix_cache_hit_rate"]
    assert fewer <= 0.5 < rate  # one completion of two reuses the prompt


def test_a_shared_prompt_row_forwards_each_prompt_once():
    """grpo_lab's shared_prompt layout (the demo's): a row per group, its prompt once, then its
    G completions; a row a pass here, so nothing is padded: the step forwards G - 1 prompts a
    group fewer than a row per sample, in G times fewer passes."""
    costs = blog_costs()
    base = replace(blog_setting(1), micro_batch_size=1, token_budget=None, steps=6)
    apart, shared = (simulate(replace(base, shared_prompt=sp), costs, seed=0)
                     for sp in (False, True))
    G = base.num_generations
    for a, s in zip(apart, shared):
        assert s["batch/microbatches_per_step"] * G == a["batch/microbatches_per_step"]
        # the same samples (same seed): the prompts forwarded are the whole difference
        prompts = a["batch/forwarded_tokens_per_step"] - a["batch/trained_tokens_per_step"]
        assert s["batch/forwarded_tokens_per_step"] == pytest.approx(
            a["batch/trained_tokens_per_step"] + prompts / G)
        assert s["perf/fwd_bwd_s"] < a["perf/fwd_bwd_s"]
