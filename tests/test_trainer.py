"""The synchronous trainer: config validation, a short real run, saved adapter files."""

import json
from functools import partial

import pytest
import torch

from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.trainer import GRPOTrainer, format_step


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_generations": 1}, "num_generations must be >= 2"),
        ({"lora_rank": 0}, "lora_rank must be >= 1"),
        ({"temperature": 0.0}, "temperature must be > 0"),
        ({"task": "chess"}, "unknown task"),
        ({"loss_type": "ppo"}, "unknown loss_type"),
        ({"steps": 0}, "steps must be >= 1"),
        ({"lr_scheduler_type": "cosine"}, "unknown lr_scheduler_type"),
    ],
)
def test_invalid_config_fails_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GRPOConfig(**kwargs)


def test_linear_schedule_decays_to_zero_and_constant_stays():
    linear = GRPOConfig(steps=4, learning_rate=2e-3, lr_scheduler_type="linear")
    assert [linear.learning_rate_at(s) for s in range(5)] == pytest.approx(
        [2e-3, 1.5e-3, 1e-3, 0.5e-3, 0.0])
    assert GRPOConfig(steps=4, learning_rate=2e-3).learning_rate_at(3) == 2e-3


def test_trainer_applies_the_schedule(tiny_model_dir):
    cfg = GRPOConfig(model=str(tiny_model_dir), steps=2, prompts_per_step=2, num_generations=2,
                     eval_every=0, eval_size=4, progress=False, learning_rate=1e-3,
                     lr_scheduler_type="linear")
    trainer = GRPOTrainer(cfg)
    trainer.step()
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)  # step 0: the peak
    trainer.step()
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.5e-3)  # halfway down


def test_few_shot_prompts_reach_the_model_with_their_template(tiny_model_dir):
    """`--few-shot 2`: every prompt the trainer samples for and scores starts with the same
    worked examples, and the model reads them (the prompt ids are longer by the template)."""
    from grpo_lab.data.tasks import AdditionTask, few_shot_prefix

    cfg = GRPOConfig(model=str(tiny_model_dir), steps=1, prompts_per_step=2, num_generations=2,
                     eval_every=0, eval_size=4, progress=False, few_shot=2)
    trainer = GRPOTrainer(cfg)
    prefix = few_shot_prefix(AdditionTask(), 2)
    problems = trainer.task.sample_batch(trainer.rng, 2)
    assert all(p.prompt.startswith(prefix) and len(p.prompt) == len(prefix) + 6 for p in problems)
    batch, out, _ = trainer.make_batch(problems)
    prompt_ids = trainer.tokenizer([p.prompt for p in problems])["input_ids"]
    assert [len(i) for i in prompt_ids] == [1 + len(prefix) + 6] * 2  # <bos>, one per character
    assert len(out.texts) == 4 and batch.advantages.shape == (4,)
    assert all(p.prompt.startswith(prefix) for p in trainer.task.eval_set())


def test_a_lora_run_prints_no_deprecation_warning_and_no_nan_accuracy(tiny_model_dir, capsys):
    """Two things a learner saw in red or as noise in every run: transformers' FutureWarning
    about `is_gradient_checkpointing` (read by peft when it wraps the model), and `acc=nan` in
    the progress bar on steps without an evaluation."""
    import warnings

    cfg = GRPOConfig(model=str(tiny_model_dir), steps=2, prompts_per_step=2, num_generations=2,
                     eval_every=0, eval_size=4, progress=True, log_every=100,
                     log_completions_every=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = GRPOTrainer(cfg)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert not deprecations, deprecations
    assert trainer.num_trainable > 0  # the LoRA adapter is in place
    trainer.train()
    bar = capsys.readouterr().err
    assert "reward=" in bar and "acc=" in bar  # the last step evaluates
    assert "acc=nan" not in bar


def test_config_round_trips_and_rejects_unknown_fields():
    cfg = GRPOConfig(steps=3)
    assert GRPOConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="GRPOConfig got unknown fields"):
        GRPOConfig.from_dict({"stepz": 3})


SMALL = dict(steps=3, prompts_per_step=4, num_generations=4, eval_size=32, eval_every=0,
             progress=False, log_every=100)


def test_lora_run_changes_every_adapter_weight_and_saves_files(tmp_path):
    trainer = GRPOTrainer(GRPOConfig(**SMALL, output_dir=str(tmp_path), learning_rate=1e-2))
    params = list(trainer.model.named_parameters())
    before = {n: p.detach().clone() for n, p in params if p.requires_grad}
    frozen = {n: p.detach().clone() for n, p in params if not p.requires_grad}
    records = trainer.train()
    after = dict(trainer.model.named_parameters())
    # lora_B starts at 0; after updates with signal every adapter matrix has moved
    changed = [n for n in before if not torch.equal(before[n], after[n])]
    assert len(changed) == len(before) and trainer.num_trainable == 11776  # rank 1
    assert all(torch.equal(frozen[n], after[n]) for n in frozen)
    step_records = [r for r in records if r["step"] > 0]
    assert len(step_records) == 3
    for r in step_records:
        assert abs(r["ratio"] - 1) < 1e-3  # one update per batch: the sampler is the scorer
        assert {"reward", "reward_std", "loss", "clip_ratio/region_mean", "perf/step_s"} <= set(r)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and "eval/accuracy" in json.loads(lines[-1])
    assert {p.name for p in (tmp_path / "adapter").iterdir()} >= {
        "adapter_config.json", "adapter_model.safetensors"}
    assert json.loads((tmp_path / "config.json").read_text())["steps"] == 3


def test_full_finetune_with_kl_and_several_iterations_moves_the_ratio():
    trainer = GRPOTrainer(GRPOConfig(**SMALL, use_lora=False, learning_rate=1e-3, beta=0.1,
                                     num_iterations=2, loss_type="dapo"))
    records = trainer.train()
    last = records[-1]
    assert trainer.num_trainable > 1_000_000
    assert "kl" in last and last["kl"] >= 0
    # the second update of a batch scores a policy that already moved: ratio != 1 somewhere
    assert any(abs(r["ratio"] - 1) > 1e-6 for r in records if "ratio" in r)


def test_use_bias_correction_kl_reaches_the_update():
    """`GRPOConfig.use_bias_correction_kl` (TRL's option) changes the trained weights once the
    policy has left the reference, both trainers pass it on, and runs without it repeat
    exactly (so the difference is the option's)."""
    from grpo_lab.train.async_config import AsyncGRPOConfig
    from grpo_lab.train.async_trainer import AsyncGRPOTrainer

    def weights_after(trainer_class, config_class, **option):
        torch.manual_seed(0)
        trainer = trainer_class(config_class(**SMALL, use_lora=False, learning_rate=1e-3,
                                             beta=0.5, seed=0, **option))
        trainer.train()
        return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])

    for trainer_class, config_class in ((GRPOTrainer, GRPOConfig),
                                        (AsyncGRPOTrainer, AsyncGRPOConfig)):
        if config_class is AsyncGRPOConfig:  # its loop without the worker thread: repeatable
            config_class = partial(AsyncGRPOConfig, asynchronous=False)
        plain = weights_after(trainer_class, config_class)
        again = weights_after(trainer_class, config_class, use_bias_correction_kl=False)
        corrected = weights_after(trainer_class, config_class, use_bias_correction_kl=True)
        assert torch.equal(plain, again), trainer_class.__name__
        assert (plain - corrected).abs().max() > 1e-6, trainer_class.__name__


def test_format_step_has_fixed_keys():
    line = format_step({"step": 3, "reward": 0.5, "ratio": 1.0, "loss": 0.0}, 10)
    assert line.startswith("[step 3/10] reward=0.500") and "ratio=1.000" in line


def test_any_local_model_path_works_in_place_of_tiny(tiny_model_dir, tmp_path):
    """Nothing assumes the tiny model: a copy saved elsewhere trains the same way."""
    from grpo_lab.model.models import load_model_and_tokenizer

    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    model.save_pretrained(tmp_path / "other")
    tokenizer.save_pretrained(tmp_path / "other")
    trainer = GRPOTrainer(GRPOConfig(**{**SMALL, "steps": 1}, model=str(tmp_path / "other")))
    assert trainer.train()[-1]["step"] == 1


def test_every_logged_metric_is_in_the_glossary(tiny_model_dir):
    from grpo_lab.watch.metric_names import unknown_metrics

    cfg = GRPOConfig(model=str(tiny_model_dir), steps=2, prompts_per_step=2, num_generations=2,
                     eval_every=1, eval_size=4, progress=False, beta=0.1, log_every=100)
    records = GRPOTrainer(cfg).train()
    logged = set().union(*records)
    assert {"kl", "eval/accuracy", "perf/generate_s"} <= logged  # the optional ones were logged
    assert unknown_metrics(dict.fromkeys(logged)) == []
    assert unknown_metrics({"reward": 0.0, "made/up": 1.0}) == ["made/up"]


def test_the_docs_metric_table_is_the_glossary():
    from pathlib import Path

    from grpo_lab.watch.metric_names import glossary_markdown

    docs = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"
    assert docs.read_text() == glossary_markdown(), (
        "regenerate docs/metrics.md (see glossary_markdown)")


def test_a_prompt_and_completion_past_the_models_context_are_refused(tiny_model_dir):
    """The synchronous path refuses what the servers refuse with a 400: a prompt plus
    max_completion_length beyond the model's context (the tiny model's 64 positions), before any
    step."""
    trainer = GRPOTrainer(GRPOConfig(max_completion_length=60, steps=1, progress=False,
                                     eval_size=8))
    with pytest.raises(ValueError, match=r"plus 60 completion tokens \(max_completion_length\) "
                                         r"is \d+ tokens, past the model's context of 64 "
                                         r"\(max_position_embeddings\)"):
        trainer.train()


def test_a_reused_output_dir_starts_a_fresh_run_and_keeps_the_earlier_one(tmp_path):
    out = tmp_path / "run"
    for _ in range(2):
        config = GRPOConfig(steps=2, prompts_per_step=2, num_generations=2, eval_size=4,
                            output_dir=str(out), progress=False, log_completions_every=0)
        GRPOTrainer(config).train()
    steps = [line for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"reward"' in line]
    assert len(steps) == 2, "the second run's metrics.jsonl holds the first run's steps too"
    earlier = (out / "earlier-runs" / "1" / "metrics.jsonl").read_text().splitlines()
    assert len([line for line in earlier if '"reward"' in line]) == 2
