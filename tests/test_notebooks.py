"""Every course notebook, executed with papermill at its CPU defaults with its exercises' solutions
filled in; then its recorded values. Static checks of the exercises and links run without a
kernel."""

import re

import nbformat
import pytest
from real_vllm import require_vllm

from grpo_lab_course import lesson
from grpo_lab_course.exercises import SOLUTIONS_DIR, exercise_cells, fill_in_solutions
from grpo_lab_course.figures import figure_captions, figures_without_image, html_images
from grpo_lab_course.goals import NOTEBOOK_GOALS, missed_goals
from grpo_lab_course.notebooks import find_notebook, list_notebooks, notebook_number, run_notebook

NOTEBOOKS = list_notebooks()
VLLM_NOTEBOOKS = ("07_multi_job_async_lora",)
"""Notebooks that take an `engine` parameter: run once more with engine="vllm" (real vLLM's CPU
build as the replicas), skipped with the reason where vLLM cannot run. Such a run starts vLLM
(1-2 minutes on 2 cores, more on a busy machine): it gets twice the suite's 600 s timeout."""
NOTEBOOK_RUNS = [pytest.param(p, {}, id=p.stem) for p in NOTEBOOKS] + [
    pytest.param(p, {"engine": "vllm"}, id=f"{p.stem}-vllm", marks=[pytest.mark.timeout(1200)])
    for p in NOTEBOOKS if p.stem in VLLM_NOTEBOOKS]


def test_every_notebook_has_a_check():
    names = {p.stem for p in NOTEBOOKS}
    assert names, "no notebooks found"
    missing = names - set(NOTEBOOK_GOALS)
    assert not missing, f"notebooks without a results check: {missing}"


@pytest.mark.notebook
@pytest.mark.parametrize("notebook, parameters", NOTEBOOK_RUNS)
def test_notebook_runs_and_achieves_its_goal(notebook, parameters, tmp_path, tiny_model_dir,
                                             chat_model_dir, monkeypatch):
    # The kernel runs as a learner's on the 2 cores the course is sized for, whatever the
    # runner has: not the suite's one-thread default (each notebook sets the threads of what it
    # trains and starts beside itself), and not every core of a bigger runner, whose thread
    # count would change the float sums and so the runs.
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    if parameters.get("engine") == "vllm":
        require_vllm()  # skips where vLLM cannot run; fails instead under GRPO_LAB_REQUIRE_VLLM=1
    results = run_notebook(notebook, tmp_path, parameters, cell_timeout_s=600,
                           with_solutions=True)
    assert results, "the notebook recorded no results"
    if "engine" in parameters:  # it ran there, not on the stand-in it falls back to
        assert results["engine"] == parameters["engine"], results
    failed = missed_goals(notebook.stem, results)
    assert not failed, f"{notebook.stem}: failed {failed}; recorded {results}"
    # Every exercise, solved by its solution file, passed its own check.
    expected = set(exercise_cells(nbformat.read(notebook, as_version=4)))
    assert set(results.get("exercises", {})) == expected, results.get("exercises")
    assert all(ok is True for ok in results.get("exercises", {}).values()), results["exercises"]
    # Every captioned figure has its image, in the executed notebook and in its HTML.
    executed = nbformat.read(tmp_path / notebook.name, as_version=4)
    captions = figure_captions(executed)
    assert captions, f"{notebook.stem} has no captioned figure (**Figure N.k:** ...)"
    assert not figures_without_image(executed, notebook.parent), captions
    assert html_images(executed) >= len(captions)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_exercises_have_solutions_and_untouched_checks_say_not_attempted(notebook, tmp_path):
    """Each exercise cell has its solution and each solution its cell (`fill_in_solutions`
    raises otherwise); left as the learner gets it, each exercise cell and the check cell under
    it run on their own and record None (not attempted), not a crash."""
    nb = nbformat.read(notebook, as_version=4)
    cells = exercise_cells(nb)
    assert cells, f"{notebook.stem} has no exercise"
    solved = fill_in_solutions(notebook, tmp_path / notebook.name)
    assert set(solved) == set(cells)
    for exercise_id, index in cells.items():
        assert exercise_id.startswith(notebook_number(notebook) + "."), exercise_id
        task = nb.cells[index - 1]
        assert task.cell_type == "markdown" and task.source.startswith(
            f"### Exercise {exercise_id}:"), f"{exercise_id}: the cell above must state the task"
        check = nb.cells[index + 1]
        assert check.cell_type == "code" and f'exercises["{exercise_id}"]' in check.source
        # the check cell's helpers (grpo_lab_course.lesson), imported by the notebook's first cells
        namespace = {"exercises": {}, **{name: getattr(lesson, name) for name in
                                         ("check_answer", "check_choice", "check_prediction")}}
        exec(compile(nb.cells[index].source, f"{exercise_id} stub", "exec"), namespace)
        exec(compile(check.source, f"{exercise_id} check", "exec"), namespace)
        assert namespace["exercises"] == {exercise_id: None}, exercise_id
        assert nb.cells[index].source != solved[exercise_id].read_text().rstrip("\n"), \
            f"{exercise_id}: the stub is its own solution"
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "exercises = {}" in code and "exercises=exercises" in code


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_ends_with_one_call_what_you_learned_and_a_quiz(notebook):
    """The last code cell is one `finish(...)` call (its goals live in grpo_lab_course/goals.py);
    after it, a "What you learned" section and 3-5 quiz questions."""
    nb = nbformat.read(notebook, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    last = code[-1].source.strip()
    assert last.startswith("finish("), last[:200]  # nothing computed before it
    assert last.count("finish(") == 1 and "assert " not in last
    after = "\n".join(c.source for c in nb.cells[nb.cells.index(code[-1]) + 1:]
                      if c.cell_type == "markdown")
    assert "## What you learned" in after
    quiz = after.split("## Quiz", 1)
    assert len(quiz) == 2, "a '## Quiz' section after 'What you learned'"
    questions = [line for line in quiz[1].splitlines() if re.match(r"\d+\. ", line)]
    assert 3 <= len(questions) <= 5, questions


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_links_the_glossary_and_a_paper(notebook):
    text = "\n".join(c.source for c in nbformat.read(notebook, as_version=4).cells
                     if c.cell_type == "markdown")
    assert "(../docs/metrics.md)" in text, "link the glossary of logged metrics"
    papers = ("arxiv.org/abs/2402.03300", "arxiv.org/abs/2503.14476", "arxiv.org/abs/2503.20783",
              "arxiv.org/abs/2505.24298")
    assert any(p in text for p in papers), "link at least one of the papers"


def test_no_solution_folder_without_a_notebook():
    stems = {p.stem for p in NOTEBOOKS}
    strays = [d.name for d in SOLUTIONS_DIR.iterdir() if d.is_dir() and d.name not in stems]
    assert not strays, f"solutions/ folders that match no notebook: {strays}"


def _exercise_notebook(path, *ids):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("exercises = {}")]
    for exercise_id in ids:
        cell = nbformat.v4.new_code_cell(f"# EXERCISE {exercise_id}\nanswer = None")
        cell.metadata["tags"] = ["exercise"]
        nb.cells.append(cell)
    nbformat.write(nb, path)
    return path


def test_fill_in_solutions_replaces_only_exercise_cells(tmp_path):
    source = _exercise_notebook(tmp_path / "42_demo.ipynb", "42.1", "42.2")
    (tmp_path / "solutions" / "42_demo").mkdir(parents=True)
    for k in (1, 2):
        (tmp_path / "solutions" / "42_demo" / f"42.{k}.py").write_text(
            f"# EXERCISE 42.{k}\nanswer = {k}\n")
    fill_in_solutions(source, tmp_path / "out.ipynb", tmp_path / "solutions")
    before = nbformat.read(source, as_version=4)
    after = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    assert [c.source for c in after.cells] == [
        "exercises = {}", "# EXERCISE 42.1\nanswer = 1", "# EXERCISE 42.2\nanswer = 2"]
    assert [c.id for c in after.cells] == [c.id for c in before.cells]
    assert after.cells[1].metadata["tags"] == ["exercise"]


def test_fill_in_solutions_names_a_missing_or_an_orphan_solution(tmp_path):
    source = _exercise_notebook(tmp_path / "42_demo.ipynb", "42.1")
    folder = tmp_path / "solutions" / "42_demo"
    folder.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"exercise 42\.1 .*no solution"):
        fill_in_solutions(source, tmp_path / "out.ipynb", tmp_path / "solutions")
    (folder / "42.1.py").write_text("# EXERCISE 42.1\nanswer = 1\n")
    (folder / "42.9.py").write_text("# EXERCISE 42.9\nanswer = 9\n")
    with pytest.raises(ValueError, match=r"42\.9.*match no exercise"):
        fill_in_solutions(source, tmp_path / "out.ipynb", tmp_path / "solutions")
    (folder / "42.9.py").unlink()
    (folder / "42.1.py").write_text("answer = 1\n")
    with pytest.raises(ValueError, match="must start with '# EXERCISE 42.1'"):
        fill_in_solutions(source, tmp_path / "out.ipynb", tmp_path / "solutions")
    assert not (tmp_path / "out.ipynb").exists()


def test_an_exercise_cell_must_name_its_id(tmp_path):
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("answer = None")
    cell.metadata["tags"] = ["exercise"]
    nb.cells = [cell]
    with pytest.raises(ValueError, match="# EXERCISE <id>"):
        exercise_cells(nb)


def test_course_command_with_solutions_reaches_the_runner_and_checks_goals(monkeypatch, capsys):
    import grpo_lab_course.__main__ as command

    calls = []
    monkeypatch.setattr(command, "run_notebook",
                        lambda notebook, output_dir, with_solutions: calls.append(
                            (notebook.stem, with_solutions)) or {"exercises": {}})
    assert command.main(["01", "--with-solutions"]) == 1  # nothing recorded: its goals missed
    assert "missed: accuracy gain >= 10 points" in capsys.readouterr().err
    assert command.main(["02"]) == 1
    assert calls == [("01_grpo_from_scratch", True), ("02_grpo_with_lora", False)]


def test_side_chapters_sort_after_their_number(tmp_path):
    for name in ("02_next", "01b_side", "01_main", "00_start", "012_not_a_chapter", "1_nor_this"):
        (tmp_path / f"{name}.ipynb").write_text("{}")
    assert [p.stem for p in list_notebooks(tmp_path)] == ["00_start", "01_main", "01b_side",
                                                          "02_next"]
    assert find_notebook("01", tmp_path).stem == "01_main"
    assert find_notebook("01b", tmp_path).stem == "01b_side"
    with pytest.raises(FileNotFoundError, match="01b_side"):
        find_notebook("03", tmp_path)


def test_a_quiz_question_says_why_when_right_and_does_not_raise_when_wrong(capsys):
    """`check_choice`: None untouched; the right letter (any case, in brackets or not) is True
    with its reason, computed only then; another letter is False with the hint, not a traceback;
    a letter that is not a choice names the choices."""
    reasons = []

    def why():
        reasons.append(1)
        return "because"

    assert lesson.check_choice("00.9", None, correct="b", why=why) is None
    assert lesson.check_choice("00.9", "a", correct="b", why=why, hint="Look again.") is False
    assert not reasons and "not (a). Look again." in capsys.readouterr().out
    assert lesson.check_choice("00.9", "(B)", correct="b", why=why) is True
    assert reasons == [1] and "Why: because" in capsys.readouterr().out
    with pytest.raises(ValueError, match="one of 'a', 'b', 'c' .got 'e'"):
        lesson.check_choice("00.9", "e", correct="b", why=why, choices="abc")


def test_finish_counts_an_exercise_goal_only_once_the_exercise_is_attempted(tmp_path, capsys,
                                                                           monkeypatch):
    """A learner who runs a notebook without its exercises sees their goals as "to do", and the
    notebook still ends cleanly; once attempted, a missed exercise goal fails like any other
    (under the course runner's strict mode, as the tests run notebooks)."""
    from grpo_lab_course.lesson import finish, goals_table

    monkeypatch.setenv(lesson.STRICT_ENV, "1")

    notebook = "08_reading_the_pipeline"
    exercise_goals = [g for g, ok in goals_table(notebook, {"exercises": {"08.2": None}})
                      if ok is None]
    assert exercise_goals and all(g.startswith("08.2") for g in exercise_goals)
    with pytest.raises(AssertionError) as missed:  # the lesson's own goals still count
        finish(notebook, tmp_path / "r.json", exercises={"08.1": None, "08.2": None})
    assert "bottlenecks as expected" in str(missed.value)
    assert "08.2" not in str(missed.value)
    assert "to do " in capsys.readouterr().out
    with pytest.raises(AssertionError) as attempted:
        finish(notebook, tmp_path / "r.json", exercises={"08.1": None, "08.2": True})
    assert "08.2" in str(attempted.value)


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_wrapped_line_turns_into_a_list(notebook):
    """A markdown line that starts with "1. " right under a paragraph's line begins a numbered
    list (CommonMark lets `1.` interrupt a paragraph): a sentence wrapped before "1." loses it."""
    wrapped = []
    for cell in nbformat.read(notebook, as_version=4).cells:
        if cell.cell_type != "markdown":
            continue
        lines = cell.source.splitlines()
        for above, line in zip(lines, lines[1:]):
            in_list = re.match(r"\s*(\d+\.|[-*])\s", above)
            if line.startswith("1. ") and above.strip() and not in_list \
                    and not above.rstrip().endswith(":") and not above.startswith("#"):
                wrapped.append(f"{above!r} / {line!r}")
    assert not wrapped, wrapped


def test_a_missed_goal_is_a_note_for_a_learner_and_a_failure_under_the_tests(
        tmp_path, monkeypatch, capsys):
    """A learner who changed a knob ends in the goals table and a note, not a traceback; the
    course's runner (the tests, `python -m grpo_lab_course`) sets strict mode, where a miss
    raises."""
    results = dict(accuracy_before=0.43, accuracy_after=0.45, eval_size=256, findings=[],
                   kinds={"in the form, wrong sum": [114, 100]}, adapter_bytes=1, model_bytes=100,
                   exercises={"09b.1": None})
    monkeypatch.delenv(lesson.STRICT_ENV, raising=False)
    lesson.finish("09b_a_real_model_learns", tmp_path / "r.json", **results)
    out = capsys.readouterr().out
    assert "MISSED  strict held-out accuracy +10 points" in out and "not met in this run" in out
    assert "to do   09b.1" in out  # an exercise not attempted is neither met nor missed
    monkeypatch.setenv(lesson.STRICT_ENV, "1")
    with pytest.raises(AssertionError, match=r"missed: strict held-out accuracy \+10"):
        lesson.finish("09b_a_real_model_learns", tmp_path / "r.json", **results)
