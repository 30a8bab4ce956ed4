"""Finding and executing the course's notebooks with papermill.

Each notebook has a `parameters` cell with CPU-sized defaults and a `results_path` parameter; its
last cells assert the outcome and record values there, so a test (or `python -m grpo_lab_course
NAME`) can check values, not just that it ran.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

from .exercises import fill_in_solutions
from .lesson import STRICT_ENV

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"


def notebook_number(path: Path) -> str:
    """`01` of `01_grpo_from_scratch`, `01b` of `01b_grpo_maths` (a letter: a side chapter)."""
    return path.stem.split("_", 1)[0]


def list_notebooks(notebook_dir: Path = NOTEBOOK_DIR) -> list[Path]:
    """The numbered notebooks (`01_...`, `01b_...`), in course order: 01b after 01, before 02."""
    return sorted(p for p in notebook_dir.glob("[0-9][0-9]*_*.ipynb")
                  if re.fullmatch(r"\d\d[a-z]?", notebook_number(p)))


def find_notebook(name: str, notebook_dir: Path = NOTEBOOK_DIR) -> Path:
    """A notebook by number (`"01"`, `"01b"`), stem or file name."""
    for path in list_notebooks(notebook_dir):
        if name in (path.name, path.stem, notebook_number(path)):
            return path
    known = ", ".join(p.stem for p in list_notebooks(notebook_dir)) or "none"
    raise FileNotFoundError(f"no notebook {name!r} in {notebook_dir} (known: {known})")


PROSE_WORDS_PER_MINUTE = 120
"""A learner reading a lesson, not skimming: prose at about 120 words a minute."""
CODE_LINES_PER_MINUTE = 20
"""Code read line by line before running it."""


TRACKS = {
    "algorithm": ("00", "00b", "01", "01b", "02", "03", "09", "09b", "10"),
    "systems": ("04", "05", "05b", "06", "07", "08", "11"),
}
"""The course's two tracks, in reading order (the systems track after 00-01)."""
ROADMAP_PREFIX = "> **You are here:**"
"""The first line under a notebook's title: its place on the map (tools/roadmap.py writes it)."""


def reading_minutes(path: Path) -> int:
    """Minutes to read a notebook as a learner does: its markdown words at
    `PROSE_WORDS_PER_MINUTE` and its code lines at `CODE_LINES_PER_MINUTE` (collapsed blocks and
    quiz answers included; the roadmap line and running time apart)."""
    cells = json.loads(Path(path).read_text())["cells"]
    words = sum(len(line.split()) for c in cells if c["cell_type"] == "markdown"
                for line in "".join(c["source"]).splitlines()
                if not line.startswith(ROADMAP_PREFIX))
    lines = sum(len([line for line in "".join(c["source"]).splitlines() if line.strip()])
                for c in cells if c["cell_type"] == "code")
    return round(words / PROSE_WORDS_PER_MINUTE + lines / CODE_LINES_PER_MINUTE)


def run_notebook(
    notebook: str | Path,
    output_dir: str | Path | None = None,
    parameters: dict | None = None,
    cell_timeout_s: int = 600,
    with_solutions: bool = False,
) -> dict:
    """Execute a notebook with papermill into `output_dir` (never the source tree).

    `with_solutions`: execute a copy with every exercise's solution filled in
    (`fill_in_solutions`), written to `output_dir` first. Returns the values the notebook
    recorded with `record_results`. Raises papermill's `PapermillExecutionError` (naming the
    failing cell) when a cell or an assert fails.
    """
    import papermill

    source = Path(notebook) if Path(notebook).suffix == ".ipynb" else find_notebook(str(notebook))
    output_dir = Path(output_dir or tempfile.mkdtemp(prefix="grpo_lab_nb_"))
    output_dir.mkdir(parents=True, exist_ok=True)
    results_path = output_dir / f"{source.stem}.results.json"
    results_path.unlink(missing_ok=True)
    executed = source
    if with_solutions:
        executed = output_dir / f"{source.stem}.with-solutions.ipynb"
        fill_in_solutions(source, executed)
    strict = os.environ.get(STRICT_ENV)
    os.environ[STRICT_ENV] = "1"  # the kernel inherits it: a missed goal fails the run
    try:
        papermill.execute_notebook(
            str(executed),
            str(output_dir / source.name),
            parameters={**(parameters or {}), "results_path": str(results_path)},
            cwd=str(source.parent),
            execution_timeout=cell_timeout_s,
            kernel_name="python3",
            progress_bar=False,
        )
    finally:
        if strict is None:
            os.environ.pop(STRICT_ENV)
        else:
            os.environ[STRICT_ENV] = strict
    return json.loads(results_path.read_text()) if results_path.exists() else {}
