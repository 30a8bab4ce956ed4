"""Several reward functions, weighted and summed: the reward a GRPO group is compared on.

    reward="math_answer,format", reward_weights="1.0,0.2"     correctness, plus a little for form
    reward=[my_reward, "format"], reward_weights=[1.0, 0.2]   a function of yours, passed as is

As TRL's `reward_funcs` and `reward_weights` (a None score counts as 0). A reward is a built-in
name, `module:function` (imported from your code), or a callable named by its `__name__`. Each is
called as TRL calls one, every argument a keyword: `prompts`, `completions`, `completion_ids`
(None where unknown), `answer` and the problem's other dataset columns. So
`def r(completions, **kwargs)`, `def r(prompts, completions, **kwargs)` and
`def r(completions, answer, **kwargs)` all work. The
held-out evaluation calls its reward the same way, with the same keywords (`correctness_scores`).
A reward returns one number (or None) per completion; anything else is an error that names it. The
held-out evaluation counts the reward named by `eval_reward` (the first by default): a completion
is correct when it scores at least 1 (docs/internals.md, "Several rewards").
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from numbers import Real

import torch

from .rewards import REWARDS

RewardSpec = str | Callable
"""One reward as a config names it: a built-in name, `module:function`, or the function."""

OFFERED_BY_SCORE = ("prompts", "completions", "completion_ids", "answer")
"""The keywords `RewardSet.score` fills in itself; a dataset column of the same name is not
passed (the reference answer is always `answer`, whatever column it was read from)."""

NOT_IMPORTABLE = " (a callable that cannot be imported: pass the function itself)"
"""How a saved config writes a reward callable that no `module:function` reaches (a lambda, or
a function defined in a notebook or a script run as __main__)."""


def import_reward(spec: str) -> Callable:
    """`module:function` -> the function, with a message that says what is wrong."""
    if spec.endswith(NOT_IMPORTABLE):
        raise ValueError(f"reward {spec!r}: this config was saved with a reward function that "
                         "cannot be imported; pass the function itself as `reward`")
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"unknown reward {spec!r}: choose a built-in one "
                         f"({', '.join(sorted(REWARDS))}) or write module:function")
    added = os.getcwd() not in sys.path
    if added:  # `grpo-lab` as a console script does not search the working directory
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({exc})") from None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: {module_name} has no function {attr!r}")
    return fn


def reward_name(fn: Callable) -> str:
    """A callable's name, as TRL logs it (`rewards/<__name__>`); a partial is named by its
    function."""
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "func", None), "__name__", None)
    return name or type(fn).__name__


def reward_spec(reward: RewardSpec) -> str:
    """A reward as a saved config writes it: a name as it is; a built-in function by its name;
    another by `module:function` when that imports it back, else its name and NOT_IMPORTABLE."""
    if isinstance(reward, str):
        return reward
    builtin = next((name for name, fn in REWARDS.items() if fn is reward), None)
    if builtin is not None:
        return builtin
    module, qualname = getattr(reward, "__module__", None), getattr(reward, "__qualname__", "")
    if module and module != "__main__" and qualname.isidentifier():  # not nested, not a lambda
        try:
            if getattr(importlib.import_module(module), qualname, None) is reward:
                return f"{module}:{qualname}"
        except ImportError:
            pass
    return reward_name(reward) + NOT_IMPORTABLE


def parse_weights(weights: str | Sequence[float] | None, count: int) -> list[float]:
    """`"1,0.2"` or [1, 0.2] -> [1.0, 0.2]; None -> all 1.0."""
    if weights is None or (isinstance(weights, str) and weights.strip() == ""):
        return [1.0] * count
    items = weights.split(",") if isinstance(weights, str) else list(weights)
    try:
        values = [float(w) for w in items]
    except (TypeError, ValueError):
        raise ValueError(f"reward_weights {weights!r}: write numbers separated by commas, or a "
                         "list of numbers") from None
    if len(values) != count:
        raise ValueError(f"reward_weights {weights!r} has {len(values)} weights for {count} "
                         "rewards")
    if not all(math.isfinite(w) for w in values):
        raise ValueError(f"reward_weights {weights!r}: every weight must be a finite number")
    return values


def call_reward(name: str, fn: Callable, offered: dict) -> list:
    """`fn(**offered)`; a ValueError naming the reward and the keywords it was offered when its
    signature cannot take them (a TypeError raised inside it stays a TypeError)."""
    check_signature(name, fn, offered)
    return fn(**offered)


def check_signature(name: str, fn: Callable, offered: dict) -> None:
    """A ValueError naming the reward when its signature cannot take the `offered` keywords (a
    reference answer it reads from a dataset that has none named as such); nothing to check
    where the callable has no signature."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C callables have none: call and see
        return
    try:
        signature.bind(**offered)
    except TypeError as exc:
        if "answer" not in offered and "'answer'" in str(exc):
            columns = [k for k in offered if k not in OFFERED_BY_SCORE]
            raise ValueError(
                f"reward {name!r} reads the reference answer (`answer`), and the dataset has no "
                f"answer column (its columns: {columns}): name it with answer_column=, or "
                "pass rewards that read the columns it has") from None
        raise ValueError(
            f"reward {name!r} cannot be called with the keywords it is offered "
            f"({', '.join(offered)}): {exc}. Write it as TRL's rewards are written, "
            f"e.g. `def {name}(completions, **kwargs)`, and read what it needs from "
            "kwargs") from None


def checked_scores(name: str, values, count: int) -> list[float]:
    """A reward's return value as `count` floats (NaN where it said None: no score), or a
    ValueError naming the reward and what it returned instead."""
    if hasattr(values, "tolist") and not isinstance(values, (str, bytes)):
        values = values.tolist()  # a tensor or an array
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"reward {name!r} returned {type(values).__name__} "
                         f"{_short(values)}; a reward returns a list with one number per "
                         "completion (None for a completion it does not score)")
    if len(values) != count:
        raise ValueError(f"reward {name!r} returned {len(values)} values for {count} "
                         "completions")
    bad = next((v for v in values if v is not None and not isinstance(v, Real)), _NONE)
    if bad is not _NONE:
        raise ValueError(f"reward {name!r} returned {type(bad).__name__} {_short(bad)} for a "
                         "completion; each value must be a number, or None for no score")
    scores = [math.nan if v is None else float(v) for v in values]
    nans = sum(math.isnan(v) for v, raw in zip(scores, values) if raw is not None)
    if nans:
        warnings.warn(f"reward {name!r} returned NaN for {nans} of {count} completions: they "
                      "count as 0 in the total and as wrong in the held-out evaluation (return "
                      "None for a completion your reward does not score)", RuntimeWarning,
                      stacklevel=3)
    return scores


_NONE = object()


def _short(value, width: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


@dataclass
class RewardSet:
    """Named reward functions and their weights."""

    names: list[str]
    functions: list[Callable]
    weights: list[float]
    eval_reward: str | None = None
    """The reward the held-out evaluation counts (None: the first)."""

    def __post_init__(self):
        if self.eval_reward is not None and self.eval_reward not in self.names:
            raise ValueError(f"eval_reward {self.eval_reward!r} is not one of the rewards "
                             f"({', '.join(self.names)})")

    @classmethod
    def from_specs(cls, specs: Sequence[RewardSpec],
                   weights: str | Sequence[float] | None = None,
                   eval_reward: str | None = None) -> RewardSet:
        """From a list of rewards, each a built-in name, `module:function` or a callable."""
        specs = [s.strip() if isinstance(s, str) else s for s in specs]
        if not specs or any(s == "" for s in specs):
            raise ValueError("reward: name at least one reward function (and no empty name)")
        for spec in specs:
            if not isinstance(spec, str) and not callable(spec):
                raise ValueError(f"reward {spec!r}: give a name, `module:function` or a "
                                 "function")
        names = [s if isinstance(s, str) else reward_name(s) for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"reward {names} names a reward twice (a function is named by its "
                             "__name__: give each its own)")
        functions = [s if callable(s) else REWARDS[s] if s in REWARDS else import_reward(s)
                     for s in specs]
        return cls(names, functions, parse_weights(weights, len(specs)), eval_reward)

    @classmethod
    def parse(cls, rewards: RewardSpec | Sequence[RewardSpec],
              weights: str | Sequence[float] | None = None,
              eval_reward: str | None = None) -> RewardSet:
        """From the config's `reward`: names or `module:function`, comma separated; a
        function; or a list of either."""
        if isinstance(rewards, str):
            specs = [s for s in rewards.split(",") if s.strip()]
        elif callable(rewards):
            specs = [rewards]
        elif isinstance(rewards, Sequence):
            specs = list(rewards)
        else:
            raise ValueError(f"reward {rewards!r}: give names (comma separated), a function, "
                             "or a list of either")
        return cls.from_specs(specs, weights, eval_reward)

    def offered(self, completions: Sequence, answers: Sequence[str],
                prompts: Sequence | None = None, *,
                completion_ids: Sequence[Sequence[int]] | None = None,
                columns: Sequence[dict] | None = None) -> dict[str, list]:
        """The keywords every reward is called with (one entry per completion)."""
        B = len(completions)
        offered = {"prompts": list(prompts) if prompts is not None else [None] * B,
                   "completions": list(completions),
                   "completion_ids": ([list(ids) for ids in completion_ids]
                                      if completion_ids is not None else [None] * B),
                   "answer": list(answers)}
        if all(a is None for a in offered["answer"]):  # rows without an answer column, as TRL:
            del offered["answer"]                       # no `answer` keyword at all
        offered.update(self._column_lists(columns, B))
        for key in ("answer", "completion_ids", "prompts"):
            if key in offered and len(offered[key]) != B:
                raise ValueError(f"{len(offered[key])} values of {key} for {B} completions")
        return offered

    def score(self, completions: Sequence, answers: Sequence[str], prompts: Sequence | None = None,
              *, completion_ids: Sequence[Sequence[int]] | None = None,
              columns: Sequence[dict] | None = None,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(weighted sum per completion, each reward per completion), tensors of shape (B,).

        Every argument is one entry per completion (B of them, a prompt's repeated G times):
        `completion_ids` the sampled token ids, `columns` each problem's other dataset columns
        (`Problem.columns`), passed to the rewards as keywords, one list per column. A None
        score (NaN in the per-reward tensor) counts as 0 in the sum, as TRL's nansum."""
        offered = self.offered(completions, answers, prompts, completion_ids=completion_ids,
                               columns=columns)
        per_reward = {name: torch.tensor(checked_scores(name, call_reward(name, fn, offered),
                                                        len(completions)))
                      for name, fn in zip(self.names, self.functions)}
        total = sum(w * torch.nan_to_num(per_reward[n], nan=0.0)
                    for n, w in zip(self.names, self.weights))
        return total.float(), per_reward

    def check_problem(self, problem) -> None:
        """Every reward's signature against the keywords a step offers for `problem` (one of the
        task's), before the first step: a reward that cannot take them is named at once, not
        after the first generation."""
        offered = self.offered([""], [problem.answer], [problem.prompt], completion_ids=[[]],
                               columns=[problem.columns])
        for name, fn in zip(self.names, self.functions):
            check_signature(name, fn, offered)

    @property
    def correctness_name(self) -> str:
        """The reward the held-out evaluation counts: `eval_reward`, else the first."""
        return self.eval_reward or self.names[0]

    def correctness_scores(self, completions: Sequence, problems: Sequence,
                           completion_ids: Sequence[Sequence[int]] | None = None) -> list[float]:
        """The evaluation's reward on one completion per problem, called exactly as in training
        (prompts, completions, completion_ids, answer and every dataset column); NaN for None."""
        name = self.correctness_name
        offered = self.offered(completions, [p.answer for p in problems],
                               [p.prompt for p in problems], completion_ids=completion_ids,
                               columns=[p.columns for p in problems])
        fn = self.functions[self.names.index(name)]
        return checked_scores(name, call_reward(name, fn, offered), len(completions))

    @staticmethod
    def _column_lists(columns: Sequence[dict] | None, count: int) -> dict[str, list]:
        """[{column: value}] per completion -> {column: [value per completion]} (None where a
        row lacks the column), leaving out the keywords `score` fills in itself."""
        if columns is None:
            return {}
        if len(columns) != count:
            raise ValueError(f"{len(columns)} rows of columns for {count} completions")
        names = dict.fromkeys(k for row in columns for k in row if k not in OFFERED_BY_SCORE)
        return {k: [row.get(k) for row in columns] for k in names}

    @staticmethod
    def metrics(per_reward: dict[str, torch.Tensor]) -> dict[str, float]:
        """`rewards/<name>/mean` and `/std` (TRL's names), ignoring None (NaN) values."""
        out = {}
        for name, values in per_reward.items():
            seen = values[~values.isnan()]
            out[f"rewards/{name}/mean"] = seen.mean().item() if len(seen) else math.nan
            out[f"rewards/{name}/std"] = seen.std().item() if len(seen) > 1 else 0.0
        return out
