"""Every course notebook, executed with papermill at its CPU defaults; then its recorded values."""

import pytest

from grpo_lab.cli.notebooks import (
    NOTEBOOK_GOALS,
    find_notebook,
    list_notebooks,
    missed_goals,
    run_notebook,
)


def test_every_notebook_has_a_check():
    names = {p.stem for p in list_notebooks()}
    assert names, "no notebooks found"
    missing = names - set(NOTEBOOK_GOALS)
    assert not missing, f"notebooks without a results check: {missing}"


@pytest.mark.notebook
@pytest.mark.parametrize("notebook", list_notebooks(), ids=lambda p: p.stem)
def test_notebook_runs_and_achieves_its_goal(notebook, tmp_path, tiny_model_dir, chat_model_dir):
    results = run_notebook(notebook, tmp_path, cell_timeout_s=600)
    assert results, "the notebook recorded no results"
    failed = missed_goals(notebook.stem, results)
    assert not failed, f"{notebook.stem}: failed {failed}; recorded {results}"


def test_side_chapters_sort_after_their_number(tmp_path):
    for name in ("02_next", "01b_side", "01_main", "00_start", "012_not_a_chapter", "1_nor_this"):
        (tmp_path / f"{name}.ipynb").write_text("{}")
    assert [p.stem for p in list_notebooks(tmp_path)] == ["00_start", "01_main", "01b_side",
                                                          "02_next"]
    assert find_notebook("01", tmp_path).stem == "01_main"
    assert find_notebook("01b", tmp_path).stem == "01b_side"
    with pytest.raises(FileNotFoundError, match="01b_side"):
        find_notebook("03", tmp_path)
