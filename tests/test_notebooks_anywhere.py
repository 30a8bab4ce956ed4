"""A course notebook is not tied to the clone it came from: copied alone into an empty folder,
with grpo_lab (and the course's harness) installed from the wheel, an empty GRPO_LAB_HOME and
HOME, it runs and meets its goals. Two notebooks run so: 00b (the on-ramp, no model) and 04
(the tiny model from the wheel's reference copy, and a benchmark file of the repository it
does without); every notebook is read for paths outside itself."""

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from grpo_lab_course.notebooks import find_notebook, list_notebooks

ROOT = Path(__file__).resolve().parent.parent


def test_no_notebook_reads_a_path_relative_to_its_folder():
    """Only the working folder a learner chose, or paths found through the package."""
    for path in list_notebooks():
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "code":
                assert not re.search(r"""["']\.\./""", cell.source), (path.name, cell.source)


@pytest.fixture(scope="module")
def wheel_site(tmp_path_factory) -> Path:
    """grpo_lab's wheel, built from this checkout and unpacked: what `pip install` puts in
    site-packages (the course's harness included), ahead of the editable install on the path."""
    out = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = out.glob("grpo_lab-*.whl")
    site = out / "site"
    zipfile.ZipFile(wheel).extractall(site)
    return site


@pytest.mark.notebook
@pytest.mark.parametrize("name", ["00b", "04"])
def test_a_notebook_copied_into_an_empty_folder_runs_from_the_wheel(name, wheel_site, tmp_path):
    source = find_notebook(name)
    alone = tmp_path / "alone"
    alone.mkdir()
    shutil.copy(source, alone / source.name)
    env = {**os.environ, "PYTHONPATH": str(wheel_site), "HOME": str(tmp_path / "home"),
           "GRPO_LAB_HOME": str(tmp_path / "grpo_lab_home"), "OMP_NUM_THREADS": "2",
           "GRPO_LAB_STRICT_GOALS": "1"}
    where = subprocess.run(
        [sys.executable, "-c", "import grpo_lab, grpo_lab_course; "
         "print(grpo_lab.__file__); print(grpo_lab_course.__file__)"],
        cwd=alone, env=env, capture_output=True, text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-2000:]
    assert all(line.startswith(str(wheel_site)) for line in where.stdout.split()), where.stdout
    run = subprocess.run(
        [sys.executable, "-c", "import json, sys; "
         "from grpo_lab_course.notebooks import run_notebook; "
         f"print(json.dumps(run_notebook({source.name!r}, 'executed'), default=str))"],
        cwd=alone, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-4000:])
    results = json.loads(run.stdout.strip().splitlines()[-1])
    assert results, "the notebook recorded no results"
    assert sorted(p.name for p in alone.iterdir()) == sorted([source.name, "executed"])
