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
from grpo_lab.train.config import TRL_ALIASES, TRL_AS_HERE, TRL_NAMES, GRPOConfig

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
    converted = {"epsilon", "bf16", "per_device_train_batch_size", "gradient_accumulation_steps",
                 "disable_tqdm", "log_completions", "save_strategy", "eval_strategy", "use_cpu",
                 "per_device_eval_batch_size"}
    names = set(TRL_NAMES) | set(TRL_ALIASES) | set(TRL_AS_HERE) | converted
    strangers = sorted(names - trl_fields - trainer_args)
    assert not strangers, f"not TRL GRPOConfig fields or GRPOTrainer arguments: {strangers}"
    ours = {f.name for f in dataclasses.fields(GRPOConfig)}
    assert not names & ours, "a TRL name that is grpo_lab's too"
    # What TRL_AS_HERE takes as changing nothing is TRL's own default for each (but `optim`,
    # whose default names the same AdamW).
    defaults = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    for name, (same, _) in TRL_AS_HERE.items():
        default = getattr(defaults[name], "value", defaults[name])
        assert default in same or name == "optim", (name, default, same)


def test_a_trl_field_that_changes_nothing_here_is_taken_and_any_other_value_named():
    config = GRPOConfig(use_vllm=False, remove_unused_columns=False, push_to_hub=False,
                        num_train_epochs=1, max_steps=3, disable_tqdm=True, log_completions=True,
                        logging_steps=2, save_strategy="no", eval_strategy="no")
    assert (config.steps, config.progress, config.log_completions_every, config.save_steps,
            config.eval_size) == (3, False, 2, 0, 0)
    assert GRPOConfig(save_strategy="steps", save_steps=4, output_dir="run").save_steps == 4
    with pytest.raises(TypeError, match="'use_vllm' is TRL's field; only False is taken here: "
                                        "generation runs in process"):
        GRPOConfig(use_vllm=True)
    with pytest.raises(TypeError, match="save_strategy='epoch'"):
        GRPOConfig(save_strategy="epoch")
    with pytest.raises(TypeError, match="'num_train_epochs' is TRL's name: use steps"):
        GRPOConfig(num_train_epochs=2)  # without max_steps it would set the run's length


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



def test_a_pure_trl_script_runs_on_rows_without_an_answer_column(tmp_path, monkeypatch):
    """TRL's quick-start as written for TRL (no grpo_lab-only field): a Dataset whose reference
    is a `solution` column (no `answer`), a reward reading it, TRL's usual config fields."""
    datasets = pytest.importorskip("datasets")

    from grpo_lab import GRPOConfig as Config
    from grpo_lab import GRPOTrainer as Trainer

    rows = [(a, b) for a in range(10, 40) for b in range(10, 40)][:120]
    train = datasets.Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in rows],
                                        "solution": [str(a + b) for a, b in rows]})
    offered = []

    def solution_reward(completions, solution, **kwargs):
        offered.append(set(kwargs))
        return [float(c.strip().startswith(s)) for c, s in zip(completions, solution)]

    monkeypatch.chdir(tmp_path)
    args = Config(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=8,
                  num_generations=4, max_completion_length=4, logging_steps=1,
                  learning_rate=1e-3, report_to="none", use_vllm=False,
                  remove_unused_columns=False, num_train_epochs=1, save_strategy="no",
                  disable_tqdm=True, seed=0, use_cpu=True, logging_strategy="steps",
                  per_device_eval_batch_size=8, shuffle_dataset=True)
    trainer = Trainer(model="tiny", reward_funcs=[solution_reward], args=args,
                      train_dataset=train)
    history = trainer.train()
    assert len([row for row in history if "reward" in row]) == 2
    assert offered and all("answer" not in keys for keys in offered)  # as TRL: no such column
    assert trainer.accuracy_history  # the held-out accuracy counts the solution reward

    # The default reward reads a reference answer this dataset does not have: named at once.
    with pytest.raises(ValueError, match="reads the reference answer .*no answer column "
                                         r"\(its columns: \['solution'\]\)"):
        Trainer(model="tiny", args=args, train_dataset=train)
    # A named answer column that is not there is still an error.
    with pytest.raises(ValueError, match="has no answer column 'result'"):
        Trainer(model="tiny", reward_funcs=[solution_reward],
                args=Config(answer_column="result", max_steps=1), train_dataset=train)


def test_a_model_object_without_its_tokenizer_gets_the_one_it_came_with(tiny_model_dir):
    """TRL loads `processing_class` from the model's `name_or_path` when it is left out."""
    from transformers import AutoModelForCausalLM

    from grpo_lab import GRPOConfig as Config
    from grpo_lab import GRPOTrainer as Trainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trainer = Trainer(model=model, args=Config(max_steps=1, eval_size=0, progress=False))
    assert trainer.tokenizer.name_or_path == str(tiny_model_dir)
    assert trainer.tokenizer.padding_side == "left" and trainer.tokenizer.pad_token is not None
    model.config._name_or_path = ""
    with pytest.raises(ValueError, match="pass processing_class=tokenizer"):
        Trainer(model=model, args=Config(max_steps=1, eval_size=0, progress=False))


def test_the_async_trainer_takes_trls_constructor(tiny_model_dir):
    datasets = pytest.importorskip("datasets")
    from grpo_lab import AsyncGRPOConfig, AsyncGRPOTrainer

    train = datasets.Dataset.from_dict({"prompt": [f"{a}+{a}=" for a in range(10, 50)],
                                        "answer": [str(2 * a) for a in range(10, 50)]})
    args = AsyncGRPOConfig(max_steps=2, per_device_train_batch_size=4, num_generations=2,
                           max_completion_length=4, eval_size=4, progress=False)
    trainer = AsyncGRPOTrainer(model=str(tiny_model_dir), reward_funcs="exact_match", args=args,
                               train_dataset=train)
    assert isinstance(trainer.config, AsyncGRPOConfig) and trainer.config.prompts_per_step == 2
    assert len([row for row in trainer.train() if "reward" in row]) == 2
    with pytest.raises(TypeError, match="this trainer's config is grpo_lab.AsyncGRPOConfig"):
        AsyncGRPOTrainer(model=str(tiny_model_dir), args=GRPOConfig(max_steps=1))
