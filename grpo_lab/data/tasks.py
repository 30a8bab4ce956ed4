"""Synthetic tasks with verifiable answers, each with a difficulty knob and a fixed held-out set.

A task turns a random generator into `Problem(prompt, answer)` pairs. The evaluation set is drawn
once from a fixed seed and never appears in training prompts. Tasks whose problems come from a
dataset (a file, a folder, a hub id) are in `grpo_lab.data.datasets`.

Real GRPO prompts share a long prefix (a system prompt, a chat template, worked examples) before
each problem; that shared prefix is what a replica's prefix cache and the proxy's KV routing
reuse. `PrefixedTask` puts such a template before every prompt of a task, and `few_shot_prefix`
writes one from the task's own solved training problems:

    make_task("addition", few_shot=2)   # "32+07=039,52+08=060,99+56=" -> "155"
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from ..util.files import write_jsonl
from .prompts import Prompt, prompt_key


@dataclass(frozen=True)
class Problem:
    prompt: Prompt  # text, or a conversation (unhashable: compare prompts by `prompt_key`)
    answer: str | None  # None: a dataset without an answer column (rewards read its columns)
    columns: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    """The dataset row's other columns by name (empty for the synthetic tasks): the rewards get
    them as keywords, as TRL passes a dataset's columns (grpo_lab.data.reward_set). Left out of
    equality and repr: a problem is its prompt and answer."""


class Task(ABC):
    """Base class: subclasses define `_draw` and `max_answer_chars` (and may choose their
    held-out set by overriding `_held_out_problems`)."""

    name = "task"

    def __init__(self, eval_size: int = 512, eval_seed: int = 1234):
        if eval_size < 1:
            raise ValueError(f"eval_size must be >= 1, got {eval_size}")
        self.eval_size = eval_size
        self._eval = self._held_out_problems(eval_size, random.Random(eval_seed))
        self._held_out_prompts = {prompt_key(p.prompt) for p in self._eval}

    def _held_out_problems(self, eval_size: int, rng: random.Random) -> list[Problem]:
        """Up to `eval_size` problems with distinct prompts, drawn with `_draw`."""
        held_out: dict[str | tuple, Problem] = {}
        for _ in range(eval_size * 50):  # bounded: small problem spaces may hold fewer
            problem = self._draw(rng)
            held_out.setdefault(prompt_key(problem.prompt), problem)
            if len(held_out) == eval_size:
                break
        return list(held_out.values())

    @abstractmethod
    def _draw(self, rng: random.Random) -> Problem:
        """One random problem (the held-out set is drawn with this too)."""

    @property
    @abstractmethod
    def max_answer_chars(self) -> int:
        """The longest answer, in characters: a bound for `max_completion_length`."""

    @property
    def default_max_completion_length(self) -> int:
        """The completion cap when none is given: the longest answer + 2 (an answer-only task
        whose model answers in one token per character, then EOS)."""
        return self.max_answer_chars + 2

    def eval_set(self) -> list[Problem]:
        """The fixed held-out problems (same list on every call)."""
        return list(self._eval)

    def sample(self, rng: random.Random) -> Problem:
        """A training problem, never one from the held-out set."""
        for _ in range(10_000):
            problem = self._draw(rng)
            if prompt_key(problem.prompt) not in self._held_out_prompts:
                return problem
        raise RuntimeError(f"{self.name}: the held-out set covers the whole problem space")

    def sample_batch(self, rng: random.Random, n: int) -> list[Problem]:
        return [self.sample(rng) for _ in range(n)]


class AdditionTask(Task):
    """`"07+45="` -> `"052"`: zero-padded n-digit addition (padding makes it learnable)."""

    name = "addition"

    def __init__(self, digits: int = 2, eval_size: int = 512, eval_seed: int = 1234):
        if not 1 <= digits <= 9:
            raise ValueError(f"addition digits must be in 1..9, got {digits}")
        self.digits = digits
        super().__init__(eval_size, eval_seed)

    def _draw(self, rng: random.Random) -> Problem:
        a, b = rng.randrange(10**self.digits), rng.randrange(10**self.digits)
        n = self.digits
        return Problem(f"{a:0{n}d}+{b:0{n}d}=", f"{a + b:0{n + 1}d}")

    @property
    def max_answer_chars(self) -> int:
        return self.digits + 1


class SortTask(Task):
    """`"5,3,8>"` -> `"3,5,8"`: sort `length` digits (longer lists are harder)."""

    name = "sort"

    def __init__(self, length: int = 4, eval_size: int = 512, eval_seed: int = 1234):
        if not 2 <= length <= 12:
            raise ValueError(f"sort length must be in 2..12, got {length}")
        self.length = length
        super().__init__(eval_size, eval_seed)

    def _draw(self, rng: random.Random) -> Problem:
        digits = [rng.randrange(10) for _ in range(self.length)]
        return Problem(",".join(map(str, digits)) + ">", ",".join(map(str, sorted(digits))))

    @property
    def max_answer_chars(self) -> int:
        return 2 * self.length - 1


class SumFormTask(Task):
    """`What is 28 + 13?` -> `28 + 13 = 41`: a chat model asked for the sum in a stated form.

    For a real instruct model (`--model smollm2-135m`): each prompt is a conversation, a system
    message stating the form and one worked example, then the question. The answer is the whole
    reply, so `exact_match` is the strict reward: the right sum, in the asked form, nothing else
    (`28 + 13 = 41.` scores 0). `largest` bounds the operands (1..largest).
    """

    name = "sum_form"
    SYSTEM = "Reply in the form 'a + b = c'."
    EXAMPLE = (3, 5)

    def __init__(self, largest: int = 30, eval_size: int = 512, eval_seed: int = 1234):
        if not 2 <= largest <= 10**6:
            raise ValueError(f"sum_form's largest operand must be in 2..1000000, got {largest}")
        self.largest = largest
        super().__init__(eval_size, eval_seed)

    @classmethod
    def conversation(cls, a: int, b: int) -> list[dict]:
        x, y = cls.EXAMPLE
        return [{"role": "system", "content": cls.SYSTEM},
                {"role": "user", "content": f"What is {x} + {y}?"},
                {"role": "assistant", "content": f"{x} + {y} = {x + y}"},
                {"role": "user", "content": f"What is {a} + {b}?"}]

    def _draw(self, rng: random.Random) -> Problem:
        a, b = rng.randint(1, self.largest), rng.randint(1, self.largest)
        return Problem(self.conversation(a, b), f"{a} + {b} = {a + b}")

    @property
    def max_answer_chars(self) -> int:
        n = self.largest
        return len(f"{n} + {n} = {2 * n}")


class PrefixedTask(Task):
    """`task`'s problems with the same text `prefix` before every prompt (a shared template).

    The problems, held-out set and answers are the task's own, drawn in the same order: only
    the prompts grow. Text prompts only (a conversation takes a `system_prompt` instead).
    """

    def __init__(self, task: Task, prefix: str):
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"a prompt prefix must be non-empty text, got {prefix!r}")
        self.task, self.prefix = task, prefix
        self.name, self.eval_size = task.name, task.eval_size
        self._eval = [self._prefixed(p) for p in task.eval_set()]  # sampling is the task's own

    def _prefixed(self, problem: Problem) -> Problem:
        if not isinstance(problem.prompt, str):
            raise ValueError(f"{self.name}: a prompt prefix needs text prompts, this one is a "
                             "conversation (give the model a system_prompt instead)")
        return Problem(self.prefix + problem.prompt, problem.answer, problem.columns)

    def _draw(self, rng: random.Random) -> Problem:
        return self._prefixed(self.task._draw(rng))

    def sample(self, rng: random.Random) -> Problem:
        return self._prefixed(self.task.sample(rng))  # the task's own training problem

    @property
    def max_answer_chars(self) -> int:
        return self.task.max_answer_chars


def few_shot_prefix(task: Task, shots: int, seed: int = 4321, separator: str = ",") -> str:
    """`shots` solved training problems of `task`, each as prompt + answer + separator."""
    if shots < 1:
        raise ValueError(f"shots must be >= 1, got {shots}")
    examples = task.sample_batch(random.Random(seed), shots)  # never a held-out problem
    if not all(isinstance(p.prompt, str) for p in examples):
        raise ValueError(f"{task.name}: few-shot examples need text prompts")
    return "".join(f"{p.prompt}{p.answer}{separator}" for p in examples)


TASKS = {"addition": AdditionTask, "sort": SortTask, "sum_form": SumFormTask}


def make_task(name: str, difficulty: int | None = None, eval_size: int = 512,
              few_shot: int = 0) -> Task:
    """Build a task by name; `difficulty` is digits for addition, list length for sort, the
    largest operand for sum_form;
    `few_shot` > 0 puts that many worked examples before every prompt (`PrefixedTask`)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {sorted(TASKS)}")
    if difficulty is None:
        task = TASKS[name](eval_size=eval_size)
    else:
        task = TASKS[name](difficulty, eval_size=eval_size)
    return with_few_shot(task, few_shot)


def with_few_shot(task: Task, few_shot: int) -> Task:
    """`task` itself when `few_shot` is 0, else its problems behind `few_shot` worked examples."""
    if few_shot < 0:
        raise ValueError(f"few_shot must be >= 0, got {few_shot}")
    return PrefixedTask(task, few_shot_prefix(task, few_shot)) if few_shot else task


# --- Offline word problems in GSM8K's format
# Offline word problems in GSM8K's format, small enough for a ~1M-parameter model.
#
# GSM8K rows are `{"question": ..., "answer": ...}` where the answer is a worked solution whose
# last line is `#### N`; `math_answer_reward` reads the number after `####`. We generate rows of
# the same shape from a few templates (add, take away, multiply by a small number), a few names and
# objects, and small numbers, so that a tiny model can learn part of it (GRPO needs mixed rewards):
#
#     {"question": "Sam has 5 apples and buys 7 more. How many apples does Sam have now?",
#      "answer": "5 + 7 = 12\\n#### 12"}
#
# Everything is drawn from `random.Random(seed)`: the same arguments give the same rows, and the
# same files byte for byte. Test questions never appear in the training file.


NAMES = ("Sam", "Mia", "Leo", "Ava", "Tom", "Zoe", "Ben", "Ivy")
OBJECTS = ("apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles")


def _minuend_and_subtrahend(rng: random.Random) -> tuple[int, int]:
    """A take-away that stays positive: 2..12 minus 1..(a - 1)."""
    a = rng.randint(2, 12)
    return a, rng.randint(1, a - 1)


# (question, operator, how to draw the two numbers): the answer is "a op b = c".
TEMPLATES = (
    ("{name} has {a} {obj} and buys {b} more. How many {obj} does {name} have now?", "+",
     lambda rng: (rng.randint(1, 9), rng.randint(1, 9))),
    ("{name} finds {a} {obj} and then {b} more. How many {obj} did {name} find?", "+",
     lambda rng: (rng.randint(1, 9), rng.randint(1, 9))),
    ("{name} has {a} {obj} and gives {b} away. How many {obj} are left?", "-",
     _minuend_and_subtrahend),
    ("{name} buys {a} boxes of {b} {obj}. How many {obj} is that?", "*",
     lambda rng: (rng.randint(2, 5), rng.randint(2, 5))),
)
OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def word_problem(rng: random.Random) -> dict:
    """One GSM8K-format row drawn from `rng`."""
    template, op, draw = rng.choice(TEMPLATES)
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b = draw(rng)
    result = OPERATIONS[op](a, b)
    question = template.format(name=name, obj=obj, a=a, b=b)
    return {"question": question, "answer": f"{a} {op} {b} = {result}\n#### {result}"}


def word_problems(n: int, seed: int = 0, exclude: set[str] | frozenset[str] = frozenset()
                  ) -> list[dict]:
    """`n` rows with distinct questions, none of them in `exclude` (e.g. the test questions)."""
    rng = random.Random(seed)
    rows: dict[str, dict] = {}
    for _ in range(50 * n + 100):  # bounded: the question space holds ~15k problems
        row = word_problem(rng)
        if row["question"] not in exclude:
            rows.setdefault(row["question"], row)
            if len(rows) == n:
                return list(rows.values())
    raise ValueError(f"could not draw {n} distinct word problems outside the {len(exclude)} "
                     f"excluded ones")


def write_word_problems(folder: str | Path, train_size: int = 2000, test_size: int = 500,
                        seed: int = 0) -> dict[str, Path]:
    """Write `train.jsonl` and `test.jsonl` (disjoint questions) into `folder`; return their paths.

    The test set is drawn first from `seed`, the training set from `seed + 1` without the test
    questions, so growing `train_size` never changes the test set.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    test = word_problems(test_size, seed)
    train = word_problems(train_size, seed + 1, exclude={row["question"] for row in test})
    paths = {"train": folder / "train.jsonl", "test": folder / "test.jsonl"}
    write_jsonl(train, paths["train"])
    write_jsonl(test, paths["test"])
    return paths
