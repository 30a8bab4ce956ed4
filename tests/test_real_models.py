"""A model and data that are not the tiny model's: the chat model (Qwen2, BPE, ChatML) on
GSM8K-format word problems, through the sync trainer, the async trainer, TRL and the CLI."""

import json
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
from datasets import Dataset

from grpo_lab.cli.main import main
from grpo_lab.data.prompts import encode_prompts
from grpo_lab.data.rewards import format_reward, math_answer_reward
from grpo_lab.model.chat_model import SYSTEM_PROMPT
from grpo_lab.model.models import load_model_and_tokenizer
from grpo_lab.train.async_config import AsyncGRPOConfig
from grpo_lab.train.async_trainer import AsyncGRPOTrainer
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.trainer import GRPOTrainer
from grpo_lab.util.files import read_jsonl

REWARD_KEYS = ("rewards/math_answer/mean", "rewards/format/mean")


def chat_config(model_dir, **overrides) -> dict:
    data = model_dir / "data"
    values = dict(model=str(model_dir), dataset=str(data / "train.jsonl"),
                  eval_split=str(data / "test.jsonl"), reward="math_answer,format",
                  reward_weights="1,0.2", system_prompt=SYSTEM_PROMPT, max_completion_length=24,
                  steps=3, prompts_per_step=4, num_generations=4, eval_size=16, eval_every=0,
                  progress=False, log_every=100, learning_rate=2e-3)
    values.update(overrides)
    return values


@pytest.fixture(scope="module")
def trl_trainer(chat_model_dir, tmp_path_factory):
    """TRL's GRPOTrainer on the chat model, conversational prompts, the same two rewards."""
    from trl import GRPOConfig as TRLConfig
    from trl import GRPOTrainer as TRLTrainer
    from trl_parity_helpers import CHECKPOINTING

    model, tokenizer = load_model_and_tokenizer(chat_model_dir)
    rows = read_jsonl(chat_model_dir / "data" / "train.jsonl")[:16]
    dataset = Dataset.from_list([{"prompt": [{"role": "system", "content": SYSTEM_PROMPT},
                                             {"role": "user", "content": r["question"]}],
                                  "answer": r["answer"]} for r in rows])
    args = TRLConfig(output_dir=str(tmp_path_factory.mktemp("trl")), use_cpu=True, bf16=False,
                     report_to="none", save_strategy="no", **{CHECKPOINTING: False},
                     per_device_train_batch_size=8, num_generations=4, max_completion_length=24,
                     max_steps=2, logging_steps=1, learning_rate=1e-3, seed=0,
                     reward_weights=[1.0, 0.2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TRLTrainer(model=model, processing_class=tokenizer, args=args,
                          reward_funcs=[math_answer_reward, format_reward], train_dataset=dataset)


def test_chat_prompts_are_the_token_ids_trl_makes(trl_trainer):
    tokenizer = trl_trainer.processing_class
    questions = ["Sam has 3 pens and buys 4 more. How many pens does Sam have?",
                 "Ben buys 4 boxes of 5 apples. How many apples is that?"]
    conversations = [[{"role": "system", "content": SYSTEM_PROMPT},
                      {"role": "user", "content": q}] for q in questions]
    trl_ids, _, _ = trl_trainer._tokenize_prompts(conversations)
    ours = encode_prompts(tokenizer, questions, system_prompt=SYSTEM_PROMPT)
    assert ours == [list(ids) for ids in trl_ids]
    assert encode_prompts(tokenizer, conversations) == ours  # a conversation is used as it is
    end = tokenizer.decode(ours[0][-3:])
    assert end.endswith("<|im_start|>assistant\n"), end  # the generation prompt ends the prompt
    # A plain-text dataset: TRL tokenizes the text as it is; so does chat_template=False.
    trl_plain, _, _ = trl_trainer._tokenize_prompts(questions)
    assert encode_prompts(tokenizer, questions, chat_template=False) == [list(i) for i in trl_plain]
    assert ours != encode_prompts(tokenizer, questions, chat_template=False)


def test_trl_trains_the_chat_model_with_both_rewards_logged(trl_trainer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trl_trainer.train()
    logged = [r for r in trl_trainer.state.log_history if "reward" in r]
    assert len(logged) == 2
    for record in logged:  # TRL's names: rewards/<function name>/mean
        total = (record["rewards/math_answer_reward/mean"]
                 + 0.2 * record["rewards/format_reward/mean"])
        assert record["reward"] == pytest.approx(total, abs=1e-5)


def test_sync_trainer_on_a_dataset_and_a_chat_model(chat_model_dir, tmp_path):
    trainer = GRPOTrainer(GRPOConfig(**chat_config(chat_model_dir, output_dir=str(tmp_path),
                                                   log_completions_every=3)))
    assert type(trainer.model.get_base_model()).__name__ == "Qwen2ForCausalLM"
    records = trainer.train()
    steps = [r for r in records if r["step"] > 0]
    assert len(steps) == 3 and all(k in r for r in steps for k in REWARD_KEYS)
    assert all(abs(r["ratio"] - 1) < 1e-3 for r in steps)
    assert steps[-1]["rewards/format/mean"] > 0.5  # the warmed-up model already answers as ####
    logged = [json.loads(x) for x in (tmp_path / "completions.jsonl").read_text().splitlines()]
    assert logged and logged[0]["prompt"].startswith("<|im_start|>system\n" + SYSTEM_PROMPT)
    # evaluated before the first step and after the last, on the 16 held-out problems; the
    # last value is the trained model's greedy accuracy (evaluated again: the same count)
    assert [step for step, _ in trainer.accuracy_history] == [0, 3]
    assert len(trainer.task.eval_set()) == 16
    accuracy = trainer.accuracy_history[-1][1]
    assert accuracy * 16 == round(accuracy * 16) and trainer.evaluate() == accuracy
    recorded = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["eval/accuracy"] for r in recorded if "eval/accuracy" in r] == [
        a for _, a in trainer.accuracy_history]


def test_async_trainer_on_a_dataset_and_a_chat_model(chat_model_dir):
    trainer = AsyncGRPOTrainer(AsyncGRPOConfig(**chat_config(chat_model_dir), max_staleness=1))
    records = [r for r in trainer.train() if r["step"] > 0]
    async_keys = [k.removesuffix("/mean") for k in REWARD_KEYS]  # TRL AsyncGRPOTrainer's names
    assert len(records) == 3 and all(k in r for r in records for k in async_keys)
    assert max(r["sample/staleness_max"] for r in records) <= 1
    assert not trainer.worker_alive


def test_cli_trains_a_local_chat_model_on_a_jsonl_file(chat_model_dir, tmp_path):
    """The issue's acceptance command, on a copy of a model grpo_lab's default recipe did not
    build, in a folder of the user's own."""
    shutil.copytree(chat_model_dir, tmp_path / "my-model")
    shutil.copy(chat_model_dir / "data" / "train.jsonl", tmp_path / "problems.jsonl")
    result = subprocess.run(
        [sys.executable, "-m", "grpo_lab.cli", "train", "--dataset", "problems.jsonl",
         "--model", str(tmp_path / "my-model"), "--reward", "math_answer,format",
         "--steps", "2", "--prompts-per-step", "4", "--num-generations", "4",
         "--eval-size", "16", "--max-new-tokens", "24", "--progress", "false",
         "--output-dir", "run", "--log-completions-every", "2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "greedy accuracy by step" in result.stdout and "best  (" in result.stdout
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert all(k in records[-1] for k in REWARD_KEYS)
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").exists()


@pytest.mark.parametrize("rows, extra, message", [
    (None, [], "no file or folder at"),
    ([{"q": "1+1", "answer": "2"}], [], "has no prompt column prompt or question"),
    ([], [], "holds no rows|is empty"),
    ([{"question": "1+1", "answer": "2"}], ["--reward", "nope"], "unknown reward 'nope'"),
    ([{"question": "1+1", "answer": "2"}], ["--reward", "no_module:f"], "cannot import module"),
])
def test_cli_bad_dataset_or_reward_is_a_clear_error(tmp_path, capsys, monkeypatch, rows, extra,
                                                     message):
    monkeypatch.chdir(tmp_path)
    if rows is not None:
        (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["train", "--dataset", "data.jsonl", "--model", "unused", "--steps", "1",
                 *extra])
    err = capsys.readouterr().err
    assert code == 2 and "grpo-lab: error:" in err
    assert re.search(message, err), err


def test_cpu_run_resolves_auto_to_float32_on_cpu(chat_model_dir):
    trainer = GRPOTrainer(GRPOConfig(**chat_config(chat_model_dir, steps=1)))
    assert trainer.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert next(trainer.model.parameters()).dtype == torch.float32
