"""The command line and the main job (`grpo-lab demo`), run as a user runs them."""

import json
import os
import subprocess
import sys

import pytest

from grpo_lab.cli.flags import config_from_args, field_docs
from grpo_lab.cli.main import build_parser, main
from grpo_lab.train.config import GRPOConfig


def test_every_config_field_has_a_docstring_and_a_flag():
    docs = field_docs(GRPOConfig)
    fields = GRPOConfig.__dataclass_fields__
    assert set(docs) == set(fields)
    args = build_parser().parse_args(["train", "--steps", "7", "--use-lora", "false",
                                      "--lora-alpha", "4"])
    cfg = config_from_args(args)
    assert cfg.steps == 7 and cfg.use_lora is False and cfg.lora_alpha == 4.0


@pytest.mark.parametrize("command", ["train", "train-async", "serve", "proxy", "launch"])
def test_every_subcommand_prints_its_help(command, capsys):
    """argparse %-formats help text: a docstring with a literal % ("~30 % more time") must
    not break `--help`."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([command, "--help"])
    assert exit_.value.code == 0 and "--" in capsys.readouterr().out


def test_build_model_takes_the_shipped_model_unless_told_to_build(capsys, tiny_model_dir):
    """`grpo-lab build-model` finds the shipped reference model at once (no silent minutes of
    building on every core); its help names the default, and a build says what it will do."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["build-model", "--help"])
    assert "(default: reference)" in " ".join(capsys.readouterr().out.split())
    assert main(["build-model"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip().endswith(tiny_model_dir.name) and "building" not in captured.err


def test_bad_input_gives_a_clear_error_and_status_2(capsys):
    assert main(["train", "--task", "chess"]) == 2
    assert "unknown task 'chess'" in capsys.readouterr().err


@pytest.mark.slow
def test_sync_demo_writes_its_run_folder_and_fails_a_goal_it_misses(tmp_path):
    """The single-process main job (`--jobs none`), shortened: its run folder, and the goal as
    its exit status, here one that 12 steps cannot reach. That its trainer (GRPOTrainer) learns
    at a full budget is asserted by notebooks 01-02; the multi-job default, goal met and exit 0,
    by tests/test_multi_job.py."""
    run_dir = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_lab.cli", "demo", "--jobs", "none", "--steps", "12",
         "--eval-size", "64", "--min-gain", "0.9", "--output-dir", str(run_dir),
         "--progress", "false"],
        capture_output=True, text=True, timeout=600, env={**os.environ},
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["accuracy_gain"] < 0.9
    assert "greedy accuracy gain >= +90 points: " in proc.stdout and "(NOT met)" in proc.stdout
    assert "FAILED: gain" in proc.stdout
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) >= 12
    for name in ("training.png", "adapter/adapter_model.safetensors"):
        assert (run_dir / name).exists(), name
