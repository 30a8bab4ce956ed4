"""The course's own cells, as one call each: an exercise's check, a quiz question's, a prediction
checked against a run, and a notebook's ending (record its results, show its goals as a table).

A notebook imports them with `from grpo_lab_course.lesson import check_answer, check_prediction,
finish` (`course` is installed beside `grpo_lab` by `pip install -e .`). The goals a notebook shows
are the ones its tests check: `grpo_lab_course/goals.py`.

    exercises["01.1"] = check_answer("01.1", my_answer, expected=lambda: core.group_advantages(..))
    exercises["01.2"] = check_choice("01.2", answer, correct="a", why="...")
    exercises["01.4"], runs = check_prediction("01.4", predicted_kl_ratio, run=lambda: ...,
                                               outcome=lambda runs: ..., explain="...")
    finish("01_grpo_from_scratch", results_path, exercises=exercises, accuracy_before=...)
"""

from __future__ import annotations

import html
import math
import os
import re
import warnings
from collections.abc import Callable
from typing import Any

from grpo_lab_course.notebook_results import record_results

from .exercises import solution_file
from .goals import NOTEBOOK_GOALS, missed_goals

# PEFT calls transformers' deprecated `is_gradient_checkpointing` on every adapter it builds:
# a red box in each notebook that builds one, about neither PEFT's use nor the lesson.
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)


def _not_attempted(exercise_id: str) -> None:
    """How an exercise is done, said where a learner meets it: under its untouched check."""
    print(f"Exercise {exercise_id}: not attempted yet. Replace the None in the cell above, run "
          f"it, then this one (a solution: {solution_file(exercise_id)}).")


def _close(answer: Any, expected: Any, tolerance: float) -> bool:
    """Numbers, tensors, arrays and (nested) lists within `tolerance` of each other (absolute,
    and relative to the expected value's magnitude); anything else by `==`."""
    if hasattr(expected, "tolist"):
        expected = expected.tolist()
    if hasattr(answer, "tolist"):
        answer = answer.tolist()
    if isinstance(expected, (list, tuple)):
        return (isinstance(answer, (list, tuple)) and len(answer) == len(expected)
                and all(_close(a, e, tolerance) for a, e in zip(answer, expected)))
    if isinstance(expected, dict):
        return (isinstance(answer, dict) and answer.keys() == expected.keys()
                and all(_close(answer[k], expected[k], tolerance) for k in expected))
    if isinstance(expected, bool) or isinstance(answer, bool):
        return answer == expected
    if isinstance(expected, (int, float)) and isinstance(answer, (int, float)):
        return math.isclose(float(answer), float(expected), rel_tol=tolerance, abs_tol=tolerance)
    return answer == expected


def check_answer(exercise_id: str, answer: Any, expected: Callable[[], Any] | None = None, *,
                 passes: Callable[[Any], bool] | None = None, tolerance: float = 1e-4,
                 hint: str = "") -> bool | None:
    """One exercise's check: None (and a note) while `answer` is None; otherwise True when the
    answer equals `expected()` (within `tolerance`, see `_close`) or `passes(answer)` is true,
    and an AssertionError naming what was expected and `hint` when it does not.

    `expected` is a function so that it is computed only once there is an answer to compare."""
    if answer is None:
        _not_attempted(exercise_id)
        return None
    if (expected is None) == (passes is None):
        raise TypeError("check_answer takes exactly one of expected= and passes=")
    if expected is not None:
        want = expected()
        assert _close(answer, want, tolerance), (
            f"Exercise {exercise_id}: expected {want!r}, got {answer!r}. {hint}".rstrip())
    else:
        assert passes(answer), f"Exercise {exercise_id}: not yet. {hint}".rstrip()
    print(f"Exercise {exercise_id}: correct!")
    return True


def check_choice(exercise_id: str, choice: str | None, *, correct: str,
                 why: str | Callable[[], str], choices: str = "abcd",
                 hint: str = "") -> bool | None:
    """A quiz question's check: None (and a note) while `choice` is None; True and the reason
    (`why`, or `why()`: computed only then) for the right letter; False and `hint` for another
    one (a quiz is a step of the lesson: a wrong letter is told so, not raised). A letter outside
    `choices` is a ValueError that names them."""
    if choice is None:
        _not_attempted(exercise_id)
        return None
    letter = str(choice).strip().lower().strip("()")
    if len(letter) != 1 or letter not in choices:
        raise ValueError(f"Exercise {exercise_id}: answer with one of "
                         f"{', '.join(repr(c) for c in choices)} (got {choice!r})")
    if letter != correct:
        print(f"Exercise {exercise_id}: not ({letter}). {hint}".rstrip()
              + " Read the question again, and try another letter.")
        return False
    print(f"Exercise {exercise_id}: correct, ({letter}). Why: {why() if callable(why) else why}")
    return True


def check_prediction(exercise_id: str, prediction: Any, run: Callable[[], Any], *,
                     outcome: Callable[[Any], Any], explain: str,
                     tolerance: float | None = None) -> tuple[bool | None, Any]:
    """A prediction checked against a run: while `prediction` is None, nothing runs (None, None).
    Otherwise `run()` starts the run (with the knob the exercise cell changed), `outcome(result)`
    reads the number or choice the learner predicted from it, and the two are printed side by side
    with `explain`, the reason. Returns (True, result): a prediction is a step of the lesson, not
    a test, so a wrong one does not fail; what the run must show is a goal in
    `grpo_lab_course/goals.py`.

    `tolerance`: for numbers, the relative distance at which the prediction counts as right."""
    if prediction is None:
        _not_attempted(exercise_id)
        return None, None
    result = run()
    measured = outcome(result)
    if tolerance is not None and isinstance(measured, (int, float)):
        right = abs(float(prediction) - measured) <= tolerance * max(abs(measured), 1e-12)
    else:
        right = prediction == measured
    shown = f"{measured:.3g}" if isinstance(measured, float) else repr(measured)
    verdict = "as you predicted" if right else "not what you predicted"
    print(f"Exercise {exercise_id}: you predicted {prediction!r}; the run gave {shown}: {verdict}.")
    print(f"Why: {explain}")
    return True, result


def exercise_of(goal: str) -> str | None:
    """The exercise id a goal belongs to ("08.2: ..." -> "08.2"), or None for a lesson's goal."""
    match = re.match(r"(\d\db?\.\d+)[: ]", goal)
    return match.group(1) if match else None


def goals_table(notebook: str, results: dict) -> list[tuple[str, bool | None]]:
    """`[(goal, met)]` for a notebook's goals in `grpo_lab_course/goals.py`, in their order; `met`
    is None for the goal of an exercise the learner has not attempted (its run never happened)."""
    missed = set(missed_goals(notebook, results))
    attempted = {k for k, ok in (results.get("exercises") or {}).items() if ok is not None}
    return [(goal, None if exercise_of(goal) and exercise_of(goal) not in attempted
             else goal not in missed) for goal in NOTEBOOK_GOALS[notebook]]


def show_goals(notebook: str, results: dict) -> None:
    """The goals as a table: HTML in a notebook, text elsewhere."""
    rows = goals_table(notebook, results)
    done = [ok for ok in (results.get("exercises") or {}).values() if ok]
    exercises = (f"{len(done)} of {len(results.get('exercises') or {})} exercises solved "
                 f"(`python -m grpo_lab_course {notebook.split('_', 1)[0]} --with-solutions` "
                 "runs this notebook with the solutions filled in)")
    try:
        from IPython import get_ipython
        from IPython.display import HTML, display
        in_notebook = get_ipython() is not None
    except ImportError:
        in_notebook = False
    if in_notebook:
        solved_html = re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(exercises))
        marks = {True: "&#10003;", False: "&#10007; missed", None: "not attempted yet"}
        body = "".join(f"<tr><td style='text-align:left'>{html.escape(goal)}</td>"
                       f"<td>{marks[ok]}</td></tr>" for goal, ok in rows)
        display(HTML(f"<table><thead><tr><th style='text-align:left'>What this notebook set out "
                     f"to show</th><th>met</th></tr></thead><tbody>{body}</tbody></table>"
                     f"<p>{solved_html}</p>"))
    else:
        for goal, ok in rows:
            print(f"{ {True: 'met   ', False: 'MISSED', None: 'to do '}[ok]}  {goal}")
        print(exercises)


STRICT_ENV = "GRPO_LAB_STRICT_GOALS"
"""Set to 1 (the course's runner does, for the tests and `python -m grpo_lab_course`): a missed goal
raises. Unset (a learner in JupyterLab): a missed goal is a row of the table and a note."""


def finish(notebook: str, results_path: str | os.PathLike | None, **values) -> None:
    """A notebook's last call: record `values` where its runner reads them (`results_path`) and
    show its goals (`grpo_lab_course/goals.py`) as a table. A goal missed (an exercise's goal counts
    once the exercise is attempted) is a note for a learner who changed a knob, which is how a
    lesson is explored; under `GRPO_LAB_STRICT_GOALS=1` (the tests, `python -m grpo_lab_course`) it
    raises an AssertionError naming every goal missed. Returns nothing: the notebook's last cell
    shows the table, not the recorded values (they are in `results_path`)."""
    if notebook not in NOTEBOOK_GOALS:
        raise KeyError(f"no goals for {notebook!r} in grpo_lab_course/goals.py")
    results = record_results(results_path, **values)
    show_goals(notebook, results)
    missed = [goal for goal, ok in goals_table(notebook, results) if ok is False]
    if missed and os.environ.get(STRICT_ENV) == "1":
        raise AssertionError(f"{notebook} missed: " + "; ".join(missed))
    if missed:
        print(f"{len(missed)} goal(s) not met in this run. The goals hold at the parameters "
              "cell's defaults; a changed knob moves them, and the table shows where to. Set the "
              "defaults back, or read what moved in the run's figures above.")
