"""A TRL user's habits at grpo_lab's configs: TRL's names are answered with grpo_lab's, TRL's
values and a `datasets.Dataset` are taken, and docs/api.md lists every default that differs."""

from __future__ import annotations

import argparse
import dataclasses
import re
import warnings
from pathlib import Path

import pytest

from grpo_lab.cli.flags import add_config_flags
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.config import TRL_ALIASES, TRL_NAMES, GRPOConfig

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("trl_name", sorted(TRL_NAMES))
def test_a_trl_name_is_answered_with_grpo_labs(trl_name):
    with pytest.raises(TypeError, match=f"'{trl_name}' is TRL's name: use "):
        GRPOConfig(**{trl_name: 1})


def test_a_typo_is_answered_with_the_closest_field():
    with pytest.raises(TypeError, match="'max_stalenes': did you mean 'max_staleness'"):
        AsyncGRPOConfig(max_stalenes=2)
    with pytest.raises(TypeError, match="'xyz' is not a field"):
        GRPOConfig(xyz=1)
    assert GRPOConfig(steps=3).steps == 3  # the fields themselves are untouched


def test_the_trl_names_are_trls():
    trl = pytest.importorskip("trl")
    import inspect
    trl_fields = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
    trainer_args = set(inspect.signature(trl.GRPOTrainer.__init__).parameters)
    converted = {"epsilon", "bf16", "per_device_train_batch_size", "gradient_accumulation_steps"}
    strangers = sorted((set(TRL_NAMES) | set(TRL_ALIASES) | converted) - trl_fields - trainer_args)
    assert not strangers, f"not TRL GRPOConfig fields or GRPOTrainer arguments: {strangers}"
    ours = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert not (set(TRL_NAMES) | set(TRL_ALIASES)) & ours, "a TRL name that is grpo_lab's too"


def test_trls_names_for_the_same_knobs_are_taken():
    config = GRPOConfig(max_steps=3, max_completion_length=8, logging_steps=2, eval_steps=5,
                        epsilon=0.3, per_device_train_batch_size=16,
                        gradient_accumulation_steps=2, num_generations=4, bf16=False)
    assert (config.steps, config.max_completion_length, config.log_every, config.eval_every) == \
        (3, 8, 2, 5)
    assert (config.epsilon_low, config.epsilon_high) == (0.3, 0.3)
    assert (config.prompts_per_step, config.dtype) == (8, "float32")  # 16 x 2 completions / 4
    with pytest.raises(TypeError, match="'max_steps' .TRL's name. and 'steps' are the same"):
        GRPOConfig(max_steps=2, steps=3)
    with pytest.raises(ValueError, match="must be a multiple of num_generations"):
        GRPOConfig(per_device_train_batch_size=6)


def test_the_old_name_of_a_renamed_knob_still_works_with_a_warning():
    """`max_new_tokens` became TRL's `max_completion_length`: a script with the old name keeps
    running, told the new name, in Python and on the command line."""
    with pytest.warns(FutureWarning, match="'max_new_tokens' is now 'max_completion_length'"):
        config = GRPOConfig(max_new_tokens=7)
    assert config.max_completion_length == 7
    with pytest.raises(TypeError, match="the same knob"), pytest.warns(FutureWarning):
        GRPOConfig(max_new_tokens=7, max_completion_length=8)
    parser = argparse.ArgumentParser()
    add_config_flags(parser)
    assert parser.parse_args(["--max-new-tokens", "9"]).max_completion_length == 9
    assert parser.parse_args(["--max-completion-length", "9"]).max_completion_length == 9


def test_scale_rewards_takes_trls_values():
    assert GRPOConfig(scale_rewards="group").scale_rewards is True
    assert GRPOConfig(scale_rewards="none").scale_rewards is False
    with pytest.raises(ValueError, match="TRL's 'batch' is not implemented"):
        GRPOConfig(scale_rewards="batch")


def test_a_datasets_dataset_is_a_task(tmp_path):
    datasets = pytest.importorskip("datasets")
    rows = {"prompt": [f"{a}+{b}=" for a in range(10) for b in range(10)],
            "answer": [str(a + b) for a in range(10) for b in range(10)]}
    config = GRPOConfig(dataset=datasets.Dataset.from_dict(rows), eval_size=10)
    task = config.make_task()
    assert len(task.eval_set()) == 10  # eval_fraction 0.1 of 100 rows
    assert {p.answer for p in task.eval_set()} <= set(rows["answer"])
    saved = config.to_dict()["dataset"]
    assert saved.startswith("<a datasets object in memory, not saved")
    split = datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                                  "test": datasets.Dataset.from_dict(rows)})
    task = GRPOConfig(dataset=split, eval_split="test", eval_size=5).make_task()
    assert len(task.eval_set()) == 5
    with pytest.raises(ValueError, match="has no split 'validation'"):
        GRPOConfig(dataset=split, eval_split="validation").make_task()
    with pytest.raises(ValueError, match="dataset must be a file, a folder"):
        GRPOConfig(dataset=42)


def _defaults(cls) -> dict:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)}


def test_docs_list_every_default_that_differs_from_trls():
    """Every default TRL's GRPOConfig sets itself and grpo_lab's differs from is listed, with
    both values as installed. A default TRL inherits from transformers' TrainingArguments may move
    with transformers' version (`trackio_space_id`: 'trackio' at 5.5.3, None at 5.25): those are
    checked where listed, and not required."""
    trl = pytest.importorskip("trl")
    from transformers import TrainingArguments

    ours, theirs = _defaults(GRPOConfig), _defaults(trl.GRPOConfig)
    transformers_own = _defaults(TrainingArguments)
    differ = {k for k in set(ours) & set(theirs) if ours[k] != theirs[k]}
    inherited = {k for k in differ if k in transformers_own and transformers_own[k] == theirs[k]}
    page = (ROOT / "docs" / "api.md").read_text()
    section = page.split("## Where the defaults differ from TRL's", 1)[1].split("\n## ", 1)[0]
    section = section.split("\n### ", 1)[0]  # the asynchronous trainer's have a table of their own
    rows = {m[0]: (m[1], m[2]) for m in
            re.findall(r"^\| `(\w+)` \| `([^`]*)` \| `([^`]*)` \|", section, flags=re.M)}
    assert differ - inherited <= set(rows) <= differ, (
        f"docs/api.md lists {sorted(rows)}; the defaults that differ are {sorted(differ)} "
        f"(of them, transformers' own: {sorted(inherited)})")
    wrong = [f"{k}: page says {rows[k]}, code {ours[k]!r} / TRL {theirs[k]!r}" for k in rows
             if rows[k] != (repr(ours[k]), repr(theirs[k]))]
    assert not wrong, "\n".join(wrong)


def test_docs_list_every_async_default_that_differs_from_trls():
    """The same for the asynchronous trainers: a default of grpo_lab's AsyncGRPOConfig that
    differs from TRL's AsyncGRPOConfig, and that the GRPOConfig table does not already give with
    the same TRL value, is listed in the asynchronous table, with both values as installed."""
    pytest.importorskip("trl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TRL's "experimental" warning
        from trl.experimental.async_grpo import AsyncGRPOConfig as TRLAsyncGRPOConfig

    from transformers import TrainingArguments

    ours, theirs = _defaults(AsyncGRPOConfig), _defaults(TRLAsyncGRPOConfig)
    transformers_own = _defaults(TrainingArguments)
    page = (ROOT / "docs" / "api.md").read_text()
    grpo_section = page.split("## Where the defaults differ from TRL's", 1)[1].split(
        "\n### ", 1)[0]
    async_section = page.split("### The asynchronous trainer's", 1)[1].split("\n## ", 1)[0]

    def rows(section):
        return {m[0]: (m[1], m[2]) for m in
                re.findall(r"^\| `(\w+)` \| `([^`]*)` \| `([^`]*)` \|", section, flags=re.M)}

    grpo_rows, async_rows = rows(grpo_section), rows(async_section)
    differ = {k for k in set(ours) & set(theirs) if ours[k] != theirs[k]
              and grpo_rows.get(k) != (repr(ours[k]), repr(theirs[k]))}
    # as above: a default TRL inherits from transformers may move with transformers' version
    inherited = {k for k in differ if k in transformers_own and transformers_own[k] == theirs[k]}
    assert differ - inherited <= set(async_rows) <= differ, (
        f"the asynchronous table lists {sorted(async_rows)}; the defaults that differ are "
        f"{sorted(differ)} (of them, transformers' own: {sorted(inherited)})")
    wrong = [f"{k}: page says {async_rows[k]}, code {ours[k]!r} / TRL {theirs[k]!r}"
             for k in async_rows if async_rows[k] != (repr(ours[k]), repr(theirs[k]))]
    assert not wrong, "\n".join(wrong)


def test_a_trl_script_runs_after_changing_its_import(tmp_path, monkeypatch):
    """TRL's constructor, TRL's field names, a datasets.Dataset with an extra column, a reward
    that reads it and a peft LoraConfig: TRL's quick-start shape, with `from grpo_lab import`."""
    datasets = pytest.importorskip("datasets")
    from peft import LoraConfig

    from grpo_lab import GRPOConfig as Config
    from grpo_lab import GRPOTrainer as Trainer

    rows = [(a, b) for a in range(10, 40) for b in range(10, 40)][:200]
    train = datasets.Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in rows],
                                        "answer": [str(a + b) for a, b in rows],
                                        "unit": ["" for _ in rows]})
    seen_units = []

    def unit_reward(completions, unit, answer, **kwargs):  # reads an extra column, as in TRL
        seen_units.extend(unit)
        return [float(c.strip().startswith(a + u)) for c, a, u in zip(completions, answer, unit)]

    monkeypatch.chdir(tmp_path)
    args = Config(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=8,
                  num_generations=4, max_completion_length=4, logging_steps=1, learning_rate=1e-3,
                  eval_size=8, progress=False, log_completions_every=0)
    trainer = Trainer(model="tiny", reward_funcs=unit_reward, args=args, train_dataset=train,
                      peft_config=LoraConfig(r=2, lora_alpha=4))
    assert (trainer.config.steps, trainer.config.prompts_per_step, trainer.config.lora_rank) == \
        (2, 2, 2)
    history = trainer.train()
    assert len([row for row in history if "reward" in row]) == 2
    assert seen_units and set(seen_units) == {""}  # the column reached the reward
    assert (tmp_path / "run" / "metrics.jsonl").is_file()

