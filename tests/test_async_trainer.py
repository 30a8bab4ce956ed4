"""The asynchronous trainer and the generation interface: short real runs on the tiny model.

Every run uses one torch thread per thread of work (2-core CI), a few steps of 4 prompts x 4
samples, and a pytest timeout, so a lost wake-up fails instead of hanging.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import pytest
import torch

from grpo_lab.model.generation import generate_completions, sample_from_ids
from grpo_lab.rollout.buffer import RolloutBuffer
from grpo_lab.rollout.generators import Generator, LocalGenerator, is_peft_model
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.async_trainer import AsyncGRPOTrainer

SMALL = dict(steps=4, prompts_per_step=4, num_generations=4, eval_size=32, eval_every=0,
             progress=False, log_every=100, trainer_threads=1, generator_threads=1)
WORKER = "grpo-rollout-worker"
pytestmark = [
    pytest.mark.timeout(120),  # a lost wake-up or a deadlock fails instead of hanging
    pytest.mark.usefixtures("one_thread"),
]


def step_records(records):
    return [r for r in records if r["step"] > 0]


class RecordingGenerator:
    """A LocalGenerator that remembers the version of every generate call, in order."""

    def __init__(self, inner: LocalGenerator, fail_after: int | None = None):
        self.inner, self.versions, self.fail_after = inner, [], fail_after

    def publish(self, model, version):
        self.inner.publish(model, version)

    @property
    def latest_version(self):
        return self.inner.latest_version

    def generate(self, prompt_ids, **kwargs):
        if self.fail_after is not None and len(self.versions) >= self.fail_after:
            raise RuntimeError("replica crashed")
        self.versions.append(kwargs["version"])
        return self.inner.generate(prompt_ids, **kwargs)


def recording_trainer(tiny_model_and_tokenizer, fail_after=None, **overrides):
    model, tokenizer = tiny_model_and_tokenizer
    cfg = AsyncGRPOConfig(**{**SMALL, **overrides})
    trainer = AsyncGRPOTrainer(cfg, model=_fresh(model), tokenizer=tokenizer)
    trainer.generator = RecordingGenerator(trainer.generator, fail_after)
    return trainer


def _fresh(model):
    import copy

    return copy.deepcopy(model)


def test_on_policy_async_run_has_ratio_one_and_stops_cleanly(tiny_model_and_tokenizer):
    trainer = recording_trainer(tiny_model_and_tokenizer, max_staleness=0, weight_sync_steps=1)
    records = step_records(trainer.train())
    assert len(records) == 4
    for r in records:
        assert r["sample/staleness_max"] == 0
        assert abs(r["ratio"] - 1) < 1e-3  # the generator's weights are exactly the trainer's
    assert [r["version"] for r in records] == [1, 2, 3, 4]
    assert trainer.generator.versions[:4] == [0, 1, 2, 3]  # admission: nothing generated early
    assert sum(r["sample/dropped_stale_total"] for r in records) == 0
    assert not trainer.worker_alive
    assert WORKER not in {t.name for t in threading.enumerate()}


def test_overlapped_run_bounds_staleness_and_tags_monotone_versions(tiny_model_and_tokenizer):
    trainer = recording_trainer(tiny_model_and_tokenizer, steps=6, max_staleness=1,
                                weight_sync_steps=2)
    records = step_records(trainer.train())
    versions = trainer.generator.versions
    assert versions == sorted(versions) and len(versions) >= 6
    assert all(r["sample/staleness_max"] <= 1 for r in records)
    assert [r["version"] for r in records] == [0, 1, 1, 2, 2, 3]  # a sync every 2 steps
    assert sum(r["sample/dropped_stale_total"] for r in records) == 0
    expected = {"perf/step_s", "perf/fwd_bwd_s", "perf/optimizer_s", "perf/rollout_wait_s",
                "rollout/backpressure_total_s", "sample/rollout_queue_size",
                "sample/staleness_mean", "sample/staleness_max", "sample/time_in_queue_s",
                "perf/weight_sync_s", "rollout/generated_tok_s_busy", "reward", "ratio", "kl",
                "time_s"}
    assert all(expected <= set(r) for r in records)
    assert all(r["rollout/generated_tok_s_busy"] > 0 for r in records)
    G = trainer.config.num_generations  # the queue is counted in completions, as TRL's
    assert all(r["sample/rollout_queue_maxsize"] == trainer.buffer.maxsize * G for r in records)
    assert all(r["sample/rollout_queue_size"] % G == 0 for r in records)
    assert not trainer.worker_alive


def waiting_in_buffer_put(thread_name: str) -> bool:
    """Is the named thread waiting inside `RolloutBuffer.put` (on its condition) right now?
    Read from the thread's Python stack: innermost `Condition.wait`, called by `put`."""
    thread = next((t for t in threading.enumerate() if t.name == thread_name), None)
    frame = sys._current_frames().get(thread.ident) if thread is not None else None
    if frame is None or frame.f_back is None:
        return False
    return (frame.f_code is threading.Condition.wait.__code__
            and frame.f_back.f_code is RolloutBuffer.put.__code__)


def test_stop_unblocks_a_worker_waiting_on_a_full_buffer(tiny_model_and_tokenizer):
    trainer = recording_trainer(tiny_model_and_tokenizer, max_staleness=3)
    trainer.start_steps()
    # The worker fills the buffer, generates the next batch (admission allows 3 ahead), then
    # waits in put for room. Wait for exactly that state, however long generating takes here.
    deadline = time.monotonic() + 90
    while not waiting_in_buffer_put(WORKER):
        assert time.monotonic() < deadline, "the worker never blocked on the full buffer"
        assert trainer.worker_alive, "the worker ended before the buffer filled"
        time.sleep(0.01)
    assert len(trainer.buffer) == trainer.buffer.maxsize and not trainer.worker_busy
    trainer.stop_steps(timeout_s=10)  # must end it where it waits
    assert not trainer.worker_alive
    assert trainer.buffer.stats()["rollout/backpressure_cumulative_s"] > 0  # blocked in put


def test_a_worker_error_surfaces_in_the_trainer(tiny_model_and_tokenizer):
    trainer = recording_trainer(tiny_model_and_tokenizer, fail_after=1, max_staleness=0)
    with pytest.raises(RuntimeError, match="rollout worker stopped") as info:
        trainer.train()
    assert "replica crashed" in str(info.value.__cause__)
    assert not trainer.worker_alive


def test_synchronous_mode_runs_the_same_pipeline_without_a_thread(tiny_model_and_tokenizer):
    trainer = recording_trainer(tiny_model_and_tokenizer, asynchronous=False, token_budget=64)
    worker_seen = []  # at every step: is a rollout worker thread running?
    records = step_records(trainer.train(
        callback=lambda record: worker_seen.append(trainer.worker_alive)))
    assert len(worker_seen) == SMALL["steps"] and not any(worker_seen)
    assert trainer.generator.versions == [0, 1, 2, 3]
    for r in records:
        assert abs(r["ratio"] - 1) < 1e-3 and r["sample/staleness_max"] == 0
        assert r["batch/microbatches_per_step"] > 1 and r["perf/generate_s"] > 0


def test_local_generator_keeps_its_own_weights_and_versions(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    trainer = AsyncGRPOTrainer(AsyncGRPOConfig(**SMALL), model=_fresh(model), tokenizer=tokenizer)
    gen = trainer.generator
    assert isinstance(gen, Generator) and gen.latest_version == -1  # published by the first step
    trainer.publish_current()
    assert gen.latest_version == 0
    trainer_ptrs = {p.data_ptr() for p in trainer.model.parameters()}
    assert not trainer_ptrs & {p.data_ptr() for p in gen.model.parameters()}  # no shared tensor
    sampling = dict(num_generations=4, max_new_tokens=5, temperature=1.0)
    torch.manual_seed(0)
    before = gen.generate([[1, 4]], version=0, **sampling)
    with torch.no_grad():
        for p in trainer.model.parameters():
            if p.requires_grad:
                p.add_(1.0)  # "train": the published snapshot of version 0 must not move
    gen.publish(trainer.model, 1)
    gen.generate([[1, 4]], version=1, **sampling)  # the copy now holds version 1 ...
    torch.manual_seed(0)
    after = gen.generate([[1, 4]], version=0, **sampling)  # ... and loads version 0 again
    assert after.completion_ids == before.completion_ids and after.logprobs == before.logprobs
    for v in (2, 3):
        gen.publish(trainer.model, v)
    assert gen.versions == [1, 2, 3] and gen.latest_version == 3  # max_staleness + 2 slots
    with pytest.raises(KeyError, match="version 0 not available"):
        gen.generate([[1, 4]], version=0, num_generations=2, max_new_tokens=3, temperature=1.0)
    with pytest.raises(ValueError, match="versions must increase"):
        gen.publish(trainer.model, 3)


def test_sampling_from_ids_equals_sampling_from_text(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    prompts = ["07+45=", "12+30="]
    torch.manual_seed(0)
    text_out = generate_completions(model, tokenizer, prompts, max_new_tokens=5,
                                    num_generations=3)
    torch.manual_seed(0)
    ids_out = sample_from_ids(model, tokenizer, tokenizer(prompts)["input_ids"],
                              num_generations=3, max_new_tokens=5, temperature=1.0)
    assert ids_out.prompt_ids == text_out.prompt_ids
    assert ids_out.completion_ids == text_out.completion_ids
    assert ids_out.texts == text_out.texts and ids_out.finish_reasons == text_out.finish_reasons
    for a, b in zip(ids_out.logprobs, text_out.logprobs, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_staleness": -1}, "max_staleness must be >= 0"),
        ({"weight_sync_steps": 0}, "weight_sync_steps must be >= 1"),
        ({"buffer_size": 2}, "buffer_size must hold"),
        ({"pack_sequences": True}, "pack_sequences needs a token_budget"),
        ({"num_generations": 1}, "num_generations must be >= 2"),  # GRPOConfig's checks still run
    ],
)
def test_invalid_async_config_fails_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(**{"prompts_per_step": 4, **kwargs})


def test_async_config_round_trips():
    cfg = AsyncGRPOConfig(max_staleness=2, token_budget=256)
    assert AsyncGRPOConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.effective_buffer_size == cfg.prompts_per_step


def test_full_finetune_with_kl_and_packing_runs_async(tiny_model_and_tokenizer):
    trainer = recording_trainer(tiny_model_and_tokenizer, steps=2, use_lora=False,
                                learning_rate=1e-4, beta=0.1, token_budget=48,
                                pack_sequences=True, pack_row_tokens=24,
                                shared_prompt=False)  # else a row per group takes precedence
    records = step_records(trainer.train())
    assert all(r["kl"] >= 0 and r["ref_kl"] >= 0 for r in records)  # sampler's and reference's
    assert all(r["batch/microbatches_per_step"] > 1 for r in records)
    assert not trainer.worker_alive


def test_merged_adapter_samples_like_the_unmerged_one(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    trainer = AsyncGRPOTrainer(AsyncGRPOConfig(**SMALL), model=_fresh(model), tokenizer=tokenizer)
    with torch.no_grad():  # a non-trivial adapter: lora_B starts at 0
        for name, p in trainer.model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    merged = LocalGenerator(trainer.model, tokenizer, merge_lora=True)
    plain = LocalGenerator(trainer.model, tokenizer, merge_lora=False)
    assert not is_peft_model(merged.model) and is_peft_model(plain.model)  # merged: plain
    outs = []
    for gen in (merged, plain):
        gen.publish(trainer.model, 0)
        torch.manual_seed(0)
        outs.append(gen.generate([[1, 4, 11, 14, 8, 9, 17]], version=0, num_generations=8,
                                 max_new_tokens=5, temperature=1.0))
    assert outs[0].completion_ids == outs[1].completion_ids
    for a, b in zip(outs[0].logprobs, outs[1].logprobs, strict=True):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)


def test_every_async_metric_is_in_the_glossary_and_the_trl_mapping(tiny_model_dir):
    from fnmatch import fnmatch

    from grpo_lab.watch.metric_names import TRL_ASYNC_NAMES, glossary_name, unknown_metrics

    cfg = AsyncGRPOConfig(model=str(tiny_model_dir), steps=3, prompts_per_step=2,
                          num_generations=2, eval_every=0, eval_size=4, progress=False,
                          log_every=100)
    records = AsyncGRPOTrainer(cfg).train()
    logged = set().union(*records)
    assert {"rollout/backpressure_total_s", "perf/rollout_wait_s", "version"} <= logged
    assert unknown_metrics(dict.fromkeys(logged)) == []
    mapped = [r.ours for r in TRL_ASYNC_NAMES if r.ours]
    unmapped = [n for n in logged if not any(fnmatch(glossary_name(n), m) for m in mapped)]
    assert not unmapped, f"no row in grpo_lab.watch.metric_names.TRL_ASYNC_NAMES: {unmapped}"


@pytest.mark.timeout(300)
def test_a_python_run_writes_the_jobs_run_folder(tiny_model_and_tokenizer, tmp_path):
    """`train()` with output_dir writes what `grpo-lab train-async` does: syncs.jsonl (one line
    per version published, the first step's included) and summary.json; a second run in the same
    folder sets the first one's aside instead of appending to its sync log."""
    from grpo_lab.util.files import read_jsonl

    for _ in range(2):
        trainer = recording_trainer(tiny_model_and_tokenizer, steps=2, eval_every=2, eval_size=4,
                                    output_dir=str(tmp_path))
        trainer.train()
        syncs = read_jsonl(tmp_path / "syncs.jsonl")
        assert [s["version"] for s in syncs] == [0, 1, 2]
        assert all(s["sync_s"] >= 0 for s in syncs)
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["steps"] == 2 and summary["version"] == 2 and summary["syncs"] == 3
        assert summary["samples"] == 2 * SMALL["prompts_per_step"] * SMALL["num_generations"]
        history = trainer.accuracy_history
        assert (summary["accuracy_before"], summary["accuracy_after"]) == (history[0][1],
                                                                           history[-1][1])
    assert (tmp_path / "earlier-runs" / "1" / "syncs.jsonl").is_file()


class CleaningGenerator(RecordingGenerator):
    """A generator that, as HTTPGenerator, cleans an earlier run's adapters before its first
    publish and says so in `unloaded_at_start` (None until then)."""

    def __init__(self, inner: LocalGenerator, first_unused: int):
        super().__init__(inner)
        self.unloaded_at_start, self.cleanings, self.first_unused = None, 0, first_unused

    def start_after_earlier_runs(self) -> int:
        self.cleanings += 1
        self.unloaded_at_start = []
        return self.first_unused


def test_the_servers_are_cleaned_once_before_the_first_publish(tiny_model_and_tokenizer):
    """The trainer cleans the servers itself before its first publish, unless the job did it
    already (train-async's `restore`): never twice."""
    trainer = recording_trainer(tiny_model_and_tokenizer)
    trainer.generator = CleaningGenerator(trainer.generator.inner, first_unused=3)
    trainer.publish_current()
    assert trainer.generator.cleanings == 1 and trainer.version == 3
    assert trainer.generator.latest_version == 3

    job_cleaned = recording_trainer(tiny_model_and_tokenizer)
    job_cleaned.generator = CleaningGenerator(job_cleaned.generator.inner, first_unused=5)
    job_cleaned.version = job_cleaned.generator.start_after_earlier_runs()  # as `restore` does
    job_cleaned.publish_current()
    assert job_cleaned.generator.cleanings == 1 and job_cleaned.generator.latest_version == 5
