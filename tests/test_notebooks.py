"""Every course notebook, executed with papermill at its CPU defaults; then its recorded values."""

import pytest

from grpo_lab.cli.notebooks import NOTEBOOK_GOALS, list_notebooks, missed_goals, run_notebook


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
