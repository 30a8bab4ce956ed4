"""Offline word problems in GSM8K's format, small enough for a ~1M-parameter model.

GSM8K rows are `{"question": ..., "answer": ...}` where the answer is a worked solution whose
last line is `#### N`; `math_answer_reward` reads the number after `####`. We generate rows of
the same shape from a few templates (add, take away, multiply by a small number), a few names and
objects, and small numbers, so that a tiny model can learn part of it (GRPO needs mixed rewards):

    {"question": "Sam has 5 apples and buys 7 more. How many apples does Sam have now?",
     "answer": "5 + 7 = 12\\n#### 12"}

Everything is drawn from `random.Random(seed)`: the same arguments give the same rows, and the
same files byte for byte. Test questions never appear in the training file.
"""

from __future__ import annotations

import random
from pathlib import Path

from ..util.jsonl import write_jsonl

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
