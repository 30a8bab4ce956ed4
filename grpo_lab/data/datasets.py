"""Tasks from datasets: problems read from a file, a folder or the Hugging Face hub.

`DatasetTask` gives a dataset's rows the `Task` interface of the synthetic tasks: one `Problem`
per row (a prompt column, text or a conversation, and an answer column where it has one; the
row's other columns ride along for the rewards, as TRL passes them), a held-out set (a split, or a
seeded share of the rows never trained on) and stateless uniform sampling. Every source is read by
`datasets.load_dataset` (docs/internals.md, "Tasks from datasets").
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Sequence
from pathlib import Path

from .prompts import Prompt, prompt_key
from .tasks import Problem, Task

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
"""A file's extension -> the `datasets` builder that reads it."""
PROMPT_COLUMNS = ("prompt", "question")
"""Where the prompt is looked for when no column is named: TRL's name, then GSM8K's."""
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")  # `name` or `owner/name`


class DatasetTask(Task):
    """A task whose problems are a dataset's rows, some of them held out for evaluation.

    `eval_problems` is the held-out split when there is one; without it a seeded
    `eval_fraction` of `problems` is held out. `seed` fixes that choice, as `eval_seed` fixes
    a synthetic task's held-out set.
    """

    def __init__(self, problems: Sequence[Problem], eval_problems: Sequence[Problem] | None = None,
                 *, eval_fraction: float = 0.1, eval_size: int = 512, seed: int = 1234,
                 name: str = "dataset"):
        if not problems:
            raise ValueError(f"{name}: no problems to train on")
        if eval_problems is None and not 0 < eval_fraction < 1:
            raise ValueError(f"eval_fraction must be between 0 and 1 (exclusive), got "
                             f"{eval_fraction}")
        if eval_problems is not None and not eval_problems:
            raise ValueError(f"{name}: the evaluation split holds no problems")
        self.name = name
        self.eval_fraction = eval_fraction
        self._rows = list(problems)
        self._eval_split = None if eval_problems is None else list(eval_problems)
        super().__init__(eval_size, seed)  # chooses the held-out set: `_held_out_problems`
        self._train = [p for p in self._rows if prompt_key(p.prompt) not in self._held_out_prompts]
        if not self._train:
            raise ValueError(
                f"{name}: holding out {len(self._eval)} problems for evaluation leaves no "
                f"training row (of {len(self._rows)}): add rows, lower eval_fraction, or name "
                "a separate eval_split")
        self._max_answer_chars = max((len(p.answer) for p in self._rows + self._eval
                                      if p.answer is not None), default=0)

    def _held_out_problems(self, eval_size: int, rng: random.Random) -> list[Problem]:
        """The eval split's first `eval_size` distinct prompts, or a seeded share of the rows."""
        if self._eval_split is not None:
            candidates, count = self._eval_split, eval_size
        else:
            candidates = rng.sample(self._rows, len(self._rows))  # the rows, shuffled by the seed
            count = min(eval_size, max(1, round(self.eval_fraction * len(self._rows))))
        held_out: dict[str | tuple, Problem] = {}
        for problem in candidates:
            held_out.setdefault(prompt_key(problem.prompt), problem)
            if len(held_out) == count:
                break
        return list(held_out.values())

    def _draw(self, rng: random.Random) -> Problem:
        return rng.choice(self._train)  # uniform, with replacement: no state between calls

    def train_set(self) -> list[Problem]:
        """The rows training samples from (none of them has a held-out prompt)."""
        return list(self._train)

    @property
    def max_answer_chars(self) -> int:
        """The longest reference answer, held-out ones included."""
        return self._max_answer_chars

    @property
    def default_max_completion_length(self) -> int:
        """A dataset's completion cap: its model writes its reasoning before the answer, which no
        answer column bounds (GSM8K's solutions run to ~300 tokens)."""
        return max(DATASET_MAX_COMPLETION_LENGTH, self.max_answer_chars + 2)


ANSWER_COLUMN = "answer"
"""The reference answer's column unless `answer_column` names another; a dataset without it
(as many of TRL's) trains with rewards that read its other columns."""

DATASET_MAX_COMPLETION_LENGTH = 256
"""The cap of a dataset's completions, in tokens, unless `max_completion_length` is given (TRL
1.16's GRPOConfig starts from 512: half of it keeps a CPU run's steps short)."""


def load_dataset_task(source: str | Path, *, split: str = "train",
                      eval_split: str | Path | None = None, config_name: str | None = None,
                      prompt_column: str | None = None, answer_column: str = ANSWER_COLUMN,
                      eval_fraction: float = 0.1, eval_size: int = 512,
                      seed: int = 1234) -> DatasetTask:
    """A `DatasetTask` from a file, a folder, a hub dataset id, or a `datasets.Dataset` (or
    `DatasetDict`) already in memory, as TRL's `train_dataset` takes.

    `split` and `config_name` name a split and a configuration of a folder or a hub dataset
    (a file is one split). `eval_split` is the held-out split of the same dataset, or a second
    file when `source` is a file; without it `eval_fraction` of the rows are held out.
    `prompt_column` defaults to the first of PROMPT_COLUMNS the data has.
    """
    if in_memory(source):
        return _task_in_memory(source, split, eval_split, prompt_column, answer_column,
                               eval_fraction, eval_size, seed)
    path = Path(source).expanduser()
    text_columns = {*([prompt_column] if prompt_column else PROMPT_COLUMNS), answer_column}
    rows = _load_split(source, split, config_name, text_columns)
    problems = _problems(rows, _where(source, split), prompt_column, answer_column)
    eval_problems = None
    if eval_split is not None and path.is_file():
        eval_path = Path(eval_split).expanduser()
        if not eval_path.is_file():
            raise FileNotFoundError(f"no file at {eval_split}: when the source is a file, "
                                    "eval_split is a second file (e.g. test.jsonl)")
        eval_problems = _problems(_load_file(eval_path, text_columns), str(eval_path),
                                  prompt_column, answer_column)
    elif eval_split is not None:
        eval_rows = _load_split(source, str(eval_split), config_name, text_columns)
        eval_problems = _problems(eval_rows, _where(source, eval_split), prompt_column,
                                  answer_column)
    return DatasetTask(problems, eval_problems, eval_fraction=eval_fraction, eval_size=eval_size,
                       seed=seed, name=path.stem if path.is_file() else path.name)


def in_memory(source) -> bool:
    """A `datasets.Dataset` or `DatasetDict` (anything with splits or columns), not a name."""
    return not isinstance(source, str | Path) and (
        hasattr(source, "column_names") or hasattr(source, "keys"))


def _task_in_memory(source, split, eval_split, prompt_column, answer_column, eval_fraction,
                    eval_size, seed) -> DatasetTask:
    """`load_dataset_task` of a Dataset in memory: a DatasetDict's `split` (and `eval_split`),
    or a Dataset as one split."""
    def one_split(name):
        if not hasattr(source, "keys"):
            return source, f"the given Dataset ({len(source)} rows)"
        if name not in source:
            raise ValueError(f"the given DatasetDict has no split {name!r} "
                             f"(its splits: {sorted(source)})")
        return source[name], f"the given DatasetDict's {name!r} split"

    if eval_split is not None and not hasattr(source, "keys"):
        raise ValueError("eval_split names a split of a DatasetDict; the given Dataset is one "
                         "split (hold rows out with eval_fraction, or pass a DatasetDict)")
    rows, where = one_split(split)
    problems = _problems(rows, where, prompt_column, answer_column)
    eval_problems = None
    if eval_split is not None:
        eval_rows, eval_where = one_split(str(eval_split))
        eval_problems = _problems(eval_rows, eval_where, prompt_column, answer_column)
    return DatasetTask(problems, eval_problems, eval_fraction=eval_fraction, eval_size=eval_size,
                       seed=seed, name="dataset")


def _where(source: str | Path, split: str | Path) -> str:
    """How errors name the rows: the file itself, or the dataset and its split."""
    return str(source) if Path(source).expanduser().is_file() else f"{source}:{split}"


def _load_split(source: str | Path, split: str, config_name: str | None, text_columns: set[str]):
    """One split of `source` as a `datasets.Dataset`: a file, a folder or a hub dataset id."""
    # Imported here: `datasets` takes a second to import, and synthetic tasks never need it.
    from datasets import load_dataset

    path = Path(source).expanduser()
    if path.is_file():
        if split != "train" or config_name is not None:
            raise ValueError(f"{path} is a file, a single split with no configurations: keep "
                             "split='train' and config_name=None (give the held-out rows as a "
                             "second file, eval_split='test.jsonl')")
        return _load_file(path, text_columns)
    if path.is_dir():
        if not any(p.suffix.lower() in FILE_FORMATS for p in path.rglob("*") if p.is_file()):
            raise ValueError(f"folder {path} holds no data file: put {', '.join(FILE_FORMATS)} "
                             "files in it (train.jsonl, test.jsonl, ...)")
    elif not _HUB_ID.fullmatch(str(source)) or path.suffix.lower() in FILE_FORMATS:
        raise FileNotFoundError(f"no file or folder at {source} (a hub dataset id looks like "
                                "owner/name, e.g. openai/gsm8k)")
    return load_dataset(str(source), name=config_name, split=split)


def _load_file(path: Path, text_columns: set[str]):
    """A .jsonl, .json, .csv or .parquet file as a `datasets.Dataset`."""
    from datasets import load_dataset
    from datasets.exceptions import DatasetGenerationError

    kind = FILE_FORMATS.get(path.suffix.lower())
    if kind is None:
        raise ValueError(f"unsupported file {path}: use {', '.join(FILE_FORMATS)}, or a folder "
                         "of such files")
    if path.stat().st_size == 0:
        raise ValueError(f"{path} is empty: it holds no rows")
    # pandas reads .csv; its converters keep these cells as text ("052", not 52).
    options = {"converters": dict.fromkeys(text_columns, str)} if kind == "csv" else {}
    try:
        return load_dataset(kind, data_files=str(path), split="train", **options)
    except DatasetGenerationError as exc:  # a malformed line or row: the cause says which
        raise ValueError(f"{path} is not valid {kind}: {exc.__cause__}") from exc
    except ValueError as exc:  # e.g. blank lines only, or a .csv header alone: "no data"
        raise ValueError(f"cannot read {path} as {kind}: {exc}") from exc


def _problems(rows, where: str, prompt_column: str | None, answer_column: str) -> list[Problem]:
    """The rows as Problems, each prompt and answer checked (`where[i]` names a bad row)."""
    if len(rows) == 0:
        raise ValueError(f"{where} holds no rows")
    if any("." in c and c not in rows.column_names for c in (prompt_column, answer_column) if c):
        rows = rows.flatten()  # nested fields as columns: `reward_model.ground_truth`
    columns = rows.column_names
    if prompt_column is None:
        prompt_column = next((c for c in PROMPT_COLUMNS if c in columns), None)
        if prompt_column is None:
            raise ValueError(f"{where} has no prompt column {' or '.join(PROMPT_COLUMNS)}; its "
                             f"columns are {columns}: name one with prompt_column=")
    # Rows without the default answer column (TRL's datasets: a `solution`, a `completion`)
    # train with rewards that read their own columns: `answer` is None, and no reward gets it.
    needed = [("prompt", prompt_column)]
    if answer_column != ANSWER_COLUMN or answer_column in columns:
        needed.append(("answer", answer_column))
    for kind, column in needed:
        if column not in columns:
            raise ValueError(f"{where} has no {kind} column {column!r}; its columns are "
                             f"{columns}: name one with {kind}_column=")
    # Every column but the prompt travels with its problem, for the rewards (TRL passes them).
    others = [c for c in columns if c != prompt_column]
    extras = rows.select_columns(others).to_list() if others else [{}] * len(rows)
    answers = rows[answer_column] if answer_column in columns else [None] * len(rows)
    problems = []
    for i, (prompt, answer) in enumerate(zip(rows[prompt_column], answers)):
        row = f"{where}[{i}]"
        problems.append(Problem(_checked_prompt(prompt, row),
                                None if answer_column not in columns
                                else _checked_answer(answer, row), extras[i]))
    return problems


def _checked_prompt(prompt, where: str) -> Prompt:
    """Non-empty text, or a conversation: a non-empty list of {role: str, content: str}."""
    if isinstance(prompt, str) and prompt.strip():
        return prompt
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str) for m in prompt):
        return prompt
    raise ValueError(f"{where}: a prompt is non-empty text or a conversation, a list of "
                     f"{{'role': str, 'content': str}} messages; got {prompt!r:.120}")


def _checked_answer(answer, where: str) -> str:
    """The reference answer as text: non-empty text, or a finite number made text."""
    if isinstance(answer, int | float) and not isinstance(answer, bool) and math.isfinite(answer):
        return str(answer)
    if isinstance(answer, str) and answer.strip():
        return answer
    raise ValueError(f"{where}: a reference answer is non-empty text or a number, got "
                     f"{answer!r:.120}: fill the row in or drop it")
