"""Dataset tasks: files, folders and hub ids through `datasets`, held-out rows, clear errors."""

import json
import pickle
import random

import datasets
import pandas as pd
import pytest

from grpo_lab.data.datasets import DatasetTask, load_dataset_task
from grpo_lab.data.prompts import prompt_key
from grpo_lab.data.tasks import Problem

CHAT = [{"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(autouse=True)
def offline_datasets_cache(tmp_path, monkeypatch):
    """`datasets` caches what it reads: into tmp_path, never the user's cache, and offline."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)


def _rows(n, start=0):
    return [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(start, start + n)]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _keys(problems):
    return {prompt_key(p.prompt) for p in problems}


def test_jsonl_rows_become_problems_and_numbers_become_text(tmp_path):
    path = _write_jsonl(tmp_path / "sums.jsonl", [{"prompt": "40+2=", "answer": 42}, *_rows(9)])
    task = load_dataset_task(path, eval_fraction=0.2)
    assert task.name == "sums"
    assert len(task.eval_set()) == 2 and len(task.train_set()) == 8
    problems = task.eval_set() + task.train_set()
    assert Problem("40+2=", "42") in problems and all(isinstance(p.answer, str) for p in problems)
    assert task.max_answer_chars == 2


def test_csv_keeps_answers_as_text(tmp_path):
    path = tmp_path / "sums.csv"
    pd.DataFrame({"question": ["07+45=", "01+01=", "10+10="], "answer": ["052", "002", "020"],
                  "source": ["a", "b", "c"]}).to_csv(path, index=False)
    task = load_dataset_task(path, eval_fraction=0.3)  # "question": GSM8K's column name
    problems = task.eval_set() + task.train_set()
    assert Problem("07+45=", "052") in problems and len(problems) == 3


def test_parquet_and_named_columns(tmp_path):
    path = tmp_path / "data.parquet"
    pd.DataFrame({"q": [f"{i}*2=" for i in range(20)], "a": [i * 2 for i in range(20)]}
                 ).to_parquet(path)
    task = load_dataset_task(path, prompt_column="q", answer_column="a", eval_size=3)
    assert len(task.eval_set()) == 2  # 10% of 20, under eval_size
    assert Problem("7*2=", "14") in task.eval_set() + task.train_set()


def test_folder_splits_by_file_name(tmp_path):
    folder = tmp_path / "sums"  # not tmp_path itself: the datasets cache is there
    folder.mkdir()
    _write_jsonl(folder / "train.jsonl", _rows(10))
    _write_jsonl(folder / "test.jsonl", _rows(4, start=100))
    task = load_dataset_task(folder, eval_split="test")
    assert _keys(task.eval_set()) == _keys(Problem(r["prompt"], r["answer"])
                                           for r in _rows(4, start=100))
    assert len(task.train_set()) == 10 and task.name == "sums"


def test_conversational_prompts_are_kept_as_is(tmp_path):
    rows = [{"prompt": [*CHAT[:1], {"role": "user", "content": f"{i}+2?"}], "answer": str(i + 2)}
            for i in range(10)]
    task = load_dataset_task(_write_jsonl(tmp_path / "chat.jsonl", rows))
    prompts = [p.prompt for p in task.eval_set() + task.train_set()]
    assert sorted(prompts, key=str) == sorted((r["prompt"] for r in rows), key=str)
    assert task.sample(random.Random(0)).prompt[0] == CHAT[0]


def test_a_dotted_answer_column_reads_a_nested_field(tmp_path):
    """The blog's data (sail/Sanity-Test-R1D-1.5B) keeps the answer in a struct:
    `reward_model.ground_truth`, beside a conversational prompt."""
    rows = [{"prompt": [{"role": "user", "content": f"{i}+2? Box it."}],
             "reward_model": {"ground_truth": str(i + 2), "style": "rule"}} for i in range(10)]
    task = load_dataset_task(_write_jsonl(tmp_path / "math.jsonl", rows),
                             answer_column="reward_model.ground_truth")
    problems = task.eval_set() + task.train_set()
    assert sorted((p.prompt[0]["content"], p.answer) for p in problems) == \
        sorted((r["prompt"][0]["content"], r["reward_model"]["ground_truth"]) for r in rows)
    with pytest.raises(ValueError, match="reward_model.ground_truth"):
        load_dataset_task(_write_jsonl(tmp_path / "flat.jsonl", _rows(5)),
                          answer_column="reward_model.ground_truth")


def test_eval_fraction_is_disjoint_deterministic_and_capped(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", _rows(200))
    task = load_dataset_task(path, eval_fraction=0.25, eval_size=30, seed=7)
    assert len(task.eval_set()) == 30 and len(task.train_set()) == 170
    assert not _keys(task.eval_set()) & _keys(task.train_set())
    assert task.eval_set() == load_dataset_task(path, eval_fraction=0.25, eval_size=30,
                                                seed=7).eval_set()
    assert task.eval_set() != load_dataset_task(path, eval_fraction=0.25, eval_size=30,
                                                seed=8).eval_set()


def test_eval_file_is_held_out_and_its_prompts_leave_training(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", _rows(20))
    test = _write_jsonl(tmp_path / "test.jsonl", _rows(5, start=18))  # 2 prompts overlap
    task = load_dataset_task(train, eval_split=test, eval_size=4)
    assert [p.prompt for p in task.eval_set()] == ["18+1=", "19+1=", "20+1=", "21+1="]
    assert len(task.train_set()) == 18  # 18+1= and 19+1= are held out, so not trained on


def test_sampling_never_returns_a_held_out_problem(tmp_path):
    rows = _rows(30) + _rows(30)  # every prompt twice: a duplicate must not leak into training
    path = _write_jsonl(tmp_path / "p.jsonl", rows)
    path.write_text(path.read_text() + "\n\n")  # blank lines are no rows
    task = load_dataset_task(path, eval_fraction=0.3)
    sampled = task.sample_batch(random.Random(0), 2000)
    assert _keys(sampled) == _keys(task.train_set())
    assert not _keys(sampled) & _keys(task.eval_set())


def test_hub_id_calls_load_dataset_with_config_and_splits(monkeypatch):
    calls = []

    def fake_load_dataset(path, name=None, split=None, **kwargs):
        calls.append((path, name, split, kwargs))
        rows = {"train": 12, "test": 3}[split]
        return datasets.Dataset.from_dict({
            "question": [f"{split} question {i}?" for i in range(rows)],
            "answer": [f"work... #### {i}" for i in range(rows)]})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task = load_dataset_task("openai/gsm8k", config_name="main", eval_split="test")
    assert calls == [("openai/gsm8k", "main", "train", {}), ("openai/gsm8k", "main", "test", {})]
    assert task.name == "gsm8k" and len(task.eval_set()) == 3 and len(task.train_set()) == 12


def test_dataset_task_from_problems():
    task = DatasetTask([Problem(f"{i}?", str(i)) for i in range(10)], eval_fraction=0.5, seed=0)
    assert len(task.eval_set()) == 5 and task.max_answer_chars == 1
    assert pickle.loads(pickle.dumps(task)).train_set() == task.train_set()  # for other processes


# --- bad input: each error names the problem and the fix ---

def test_missing_file_and_unsupported_extension(tmp_path):
    with pytest.raises(FileNotFoundError, match="no file or folder at .*missing.jsonl"):
        load_dataset_task(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="no file or folder at ./nowhere"):
        load_dataset_task("./nowhere")
    (tmp_path / "notes.txt").write_text("1+1=,2\n")
    with pytest.raises(ValueError, match=r"unsupported file .*notes.txt: use .jsonl, .json, .csv"):
        load_dataset_task(tmp_path / "notes.txt")
    train = _write_jsonl(tmp_path / "train.jsonl", _rows(5))
    with pytest.raises(FileNotFoundError, match="eval_split is a second file"):
        load_dataset_task(train, eval_split="test")
    with pytest.raises(ValueError, match="is a file, a single split"):
        load_dataset_task(train, split="test")


def test_folder_without_data_files(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("nothing here")
    with pytest.raises(ValueError, match="holds no data file: put .jsonl"):
        load_dataset_task(tmp_path / "notes")


def test_missing_columns_list_the_columns_there_are(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"text": "1+1=", "label": "2"}])
    with pytest.raises(ValueError, match=r"no prompt column prompt or question; its columns are "
                                         r"\['text', 'label'\]: name one with prompt_column="):
        load_dataset_task(path)
    with pytest.raises(ValueError, match=r"no answer column 'result'; its columns are "
                                         r"\['text', 'label'\]: name one with answer_column="):
        load_dataset_task(path, prompt_column="text", answer_column="result")
    # Without the default `answer` column (as TRL's datasets) the rows load with no reference
    # answer, their columns kept for the rewards (a reward that needs `answer` is named by the
    # trainer: tests/test_trl_habits.py).
    two = _write_jsonl(tmp_path / "two.jsonl", [{"text": "1+1=", "label": "2"},
                                                {"text": "1+2=", "label": "3"}])
    task = load_dataset_task(two, prompt_column="text", eval_fraction=0.5, seed=0)
    problem = [p for p in task.eval_set() + task.train_set() if p.prompt == "1+1="][0]
    assert (problem.prompt, problem.answer, problem.columns) == ("1+1=", None, {"label": "2"})


@pytest.mark.parametrize("name, content", [("empty.jsonl", ""), ("blank.jsonl", "\n\n"),
                                           ("header.csv", "prompt,answer\n")])
def test_empty_files(tmp_path, name, content):
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match="(is empty: it holds no rows|cannot read .* no data)"):
        load_dataset_task(tmp_path / name)


def test_malformed_jsonl(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{not json}\n')
    with pytest.raises(ValueError, match="bad.jsonl is not valid json: JSON parse error"):
        load_dataset_task(tmp_path / "bad.jsonl")


def test_nothing_left_to_train_on(tmp_path):
    with pytest.raises(ValueError, match="leaves no training row .* lower eval_fraction"):
        load_dataset_task(_write_jsonl(tmp_path / "one.jsonl", _rows(1)))
    with pytest.raises(ValueError, match="eval_fraction must be between 0 and 1"):
        load_dataset_task(_write_jsonl(tmp_path / "p.jsonl", _rows(5)), eval_fraction=0)


@pytest.mark.parametrize("prompt", [
    [{"role": "user"}],                          # no content
    [{"role": "user", "content": ["x"]}],        # content not text
    ["What is 2+2?"],                            # not messages
    [],                                          # no message
    "   ",                                       # blank text
])
def test_badly_shaped_prompts(tmp_path, prompt):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": prompt, "answer": "1"}] * 2)
    with pytest.raises(ValueError, match=r"p.jsonl\[0\]: a prompt is non-empty text or a "
                                         r"conversation, a list of \{'role': str"):
        load_dataset_task(path)


@pytest.mark.parametrize("answer", [None, "", "  "])
def test_missing_answers(tmp_path, answer):
    path = _write_jsonl(tmp_path / "p.jsonl", [*_rows(3), {"prompt": "x=", "answer": answer}])
    with pytest.raises(ValueError, match=r"p.jsonl\[3\]: a reference answer is non-empty text or "
                                         r"a number, got .*: fill the row in or drop it"):
        load_dataset_task(path)


def test_missing_csv_cell(tmp_path):
    (tmp_path / "p.csv").write_text("prompt,answer\n1+1=,2\n2+2=,\n")
    # the empty cell reads as None, or as '' under datasets 5.0 (the floor)
    with pytest.raises(ValueError, match=r"p.csv\[1\]: a reference answer .* got (None|'')"):
        load_dataset_task(tmp_path / "p.csv")
