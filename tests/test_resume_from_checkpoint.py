"""TRL's habit in the Python API: `save_steps` writes checkpoints under `<output_dir>/checkpoints`
and `train(resume_from_checkpoint=True | path)` continues a run from one, for the synchronous and
the asynchronous trainer (grpo_lab.train.trainer, grpo_lab.bucket.checkpoint)."""

from __future__ import annotations

import json

import pytest
import torch

from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.async_trainer import AsyncGRPOTrainer
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.trainer import GRPOTrainer

SMALL = dict(prompts_per_step=4, num_generations=4, eval_size=16, eval_every=0, progress=False,
             log_every=100, save_steps=2, seed=3, log_completions_every=0)
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.timeout(300)]


def logged_steps(out) -> list[int]:
    return [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if "reward" in r]


def lora_weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.named_parameters() if v.requires_grad}


def make(kind, out, steps, model_dir):
    if kind == "sync":
        return GRPOTrainer(GRPOConfig(model=str(model_dir), steps=steps, output_dir=str(out),
                                      **SMALL))
    return AsyncGRPOTrainer(AsyncGRPOConfig(model=str(model_dir), steps=steps,
                                            output_dir=str(out), trainer_threads=1,
                                            generator_threads=1, **SMALL))


def test_a_resumed_run_is_the_run_that_never_stopped(tmp_path, tiny_model_dir):
    """Synchronous: six steps straight, against five steps (checkpoints at 2 and 4, the newest
    two kept; step 5 then lost, as in a crash) resumed from the newest checkpoint: the same
    steps logged once each, the same rewards step by step, the same final adapter."""
    straight = make("sync", tmp_path / "straight", 6, tiny_model_dir)
    straight.train()
    make("sync", tmp_path / "resumed", 5, tiny_model_dir).train()
    assert [p.name for p in sorted((tmp_path / "resumed" / "checkpoints").iterdir())] == \
        ["step-000002", "step-000004"]
    resumed = make("sync", tmp_path / "resumed", 6, tiny_model_dir)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.step_count == 6
    assert logged_steps(tmp_path / "resumed") == list(range(1, 7))  # step 5 logged once
    rewards = [[r["reward"] for r in t.logger.records if "reward" in r]
               for t in (straight, resumed)]
    assert rewards[0] == rewards[1]
    torch.testing.assert_close(lora_weights(resumed), lora_weights(straight))
    with pytest.raises(ValueError, match="not a checkpoint"):
        make("sync", tmp_path / "other", 6, tiny_model_dir).train(
            resume_from_checkpoint=str(tmp_path))
    with pytest.raises(ValueError, match="no checkpoint under .*save_steps=N"):
        make("sync", tmp_path / "empty", 6, tiny_model_dir).train(resume_from_checkpoint=True)


def test_an_asynchronous_run_resumes_its_weights_at_a_new_version(tmp_path, tiny_model_dir):
    """Asynchronous: the worker samples ahead, so the steps after a resume see other prompts
    than an unbroken run would (as `train-async --resume` does); what holds is the checkpoint's
    weights and step, a version never used before, and each step logged once."""
    from safetensors.torch import load_file

    crashed = make("async", tmp_path / "run", 5, tiny_model_dir)
    crashed.train()
    last_version = crashed.version
    resumed = make("async", tmp_path / "run", 6, tiny_model_dir)
    checkpoint = resumed.resume(True)
    assert checkpoint.name == "step-000004" and resumed.step_count == 4
    saved = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    mine = {k.replace(".default", ""): v for k, v in lora_weights(resumed).items()}
    assert saved.keys() == mine.keys()
    for name, value in saved.items():
        torch.testing.assert_close(mine[name], value)
    assert resumed.version == checkpoint_version(checkpoint) + 1 <= last_version + 1
    resumed.train()
    assert resumed.step_count == 6
    assert logged_steps(tmp_path / "run") == list(range(1, 7))


def checkpoint_version(path) -> int:
    return json.loads((path / "state.json").read_text())["version"]


def test_save_steps_needs_a_run_folder():
    with pytest.raises(ValueError, match="save_steps writes checkpoints under output_dir"):
        GRPOConfig(save_steps=2)
    with pytest.raises(ValueError, match="save_total_limit >= 1"):
        GRPOConfig(save_total_limit=0, output_dir="x")


def test_grpo_lab_train_resumes_from_the_latest_checkpoint(tmp_path, tiny_model_dir, capsys):
    from grpo_lab.cli.main import main

    flags = ["train", "--model", str(tiny_model_dir), "--output-dir", str(tmp_path),
             "--prompts-per-step", "4", "--num-generations", "4", "--eval-size", "0",
             "--progress", "false", "--save-steps", "2", "--num-threads", "1"]
    assert main([*flags, "--steps", "2"]) == 0
    assert main([*flags, "--steps", "3", "--resume-from-checkpoint", "latest"]) == 0
    said = capsys.readouterr()
    assert "resuming from" in said.out + said.err
    assert logged_steps(tmp_path) == [1, 2, 3]
