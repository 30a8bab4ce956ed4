"""The course's exercises and their solutions.

An exercise is a code cell tagged `exercise` whose first line is `# EXERCISE <id>` (`<id>` =
notebook number + "." + k, e.g. `02.1`); the cell after it checks the answer into
`exercises["<id>"]` (True when right, None when not attempted). The solution of each is
`solutions/<notebook stem>/<id>.py`, the whole replacement text of the cell: `fill_in_solutions`
writes a copy of a notebook with them filled in, which the tests (and teachers, with
`python -m grpo_lab_course NAME --with-solutions`) execute.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

SOLUTIONS_DIR = Path(__file__).resolve().parents[1] / "solutions"
EXERCISE_TAG = "exercise"
_EXERCISE_LINE = re.compile(r"# EXERCISE (\d\d[a-z]?\.\d+)\s*")


def exercise_cells(notebook) -> dict[str, int]:
    """`{exercise id: cell index}` of a notebook (an `nbformat` node) in order. Raises ValueError
    for an `exercise` cell whose first line is not `# EXERCISE <id>`, or for a repeated id."""
    found: dict[str, int] = {}
    for index, cell in enumerate(notebook.cells):
        if EXERCISE_TAG not in cell.get("metadata", {}).get("tags", []):
            continue
        first_line = cell.source.split("\n", 1)[0]
        match = _EXERCISE_LINE.fullmatch(first_line)
        if cell.cell_type != "code" or not match:
            raise ValueError(f"cell {index} ({cell.get('id')}) is tagged {EXERCISE_TAG!r} but is "
                             f"not a code cell starting with '# EXERCISE <id>': {first_line!r}")
        if match.group(1) in found:
            raise ValueError(f"exercise {match.group(1)} appears twice (cells "
                             f"{found[match.group(1)]} and {index})")
        found[match.group(1)] = index
    return found


def fill_in_solutions(notebook_path: str | os.PathLike, out_path: str | os.PathLike,
                      solutions_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write a copy of a notebook whose exercise cells hold their solutions.

    Each `exercise` cell's source becomes `<solutions_dir>/<notebook stem>/<id>.py` (default
    solutions dir: the repository's `solutions/`); ids, tags and cell ids stay. Raises
    FileNotFoundError for an exercise without a solution, ValueError for a solution without an
    exercise (an orphan) or one whose first line does not name its exercise. Returns
    `{id: solution file}`.
    """
    import nbformat

    notebook_path = Path(notebook_path)
    folder = Path(solutions_dir or SOLUTIONS_DIR) / notebook_path.stem
    notebook = nbformat.read(notebook_path, as_version=4)
    cells = exercise_cells(notebook)
    files = {p.stem: p for p in folder.glob("*.py")} if folder.is_dir() else {}
    orphans = sorted(set(files) - set(cells))
    if orphans:
        raise ValueError(f"{folder}: solutions {orphans} match no exercise cell of "
                         f"{notebook_path.name} (its exercises: {sorted(cells) or 'none'})")
    used = {}
    for exercise_id, index in cells.items():
        if exercise_id not in files:
            raise FileNotFoundError(f"exercise {exercise_id} of {notebook_path.name} has no "
                                    f"solution: expected {folder / (exercise_id + '.py')}")
        text = files[exercise_id].read_text()
        if text.split("\n", 1)[0].strip() != f"# EXERCISE {exercise_id}":
            raise ValueError(f"{files[exercise_id]} must start with '# EXERCISE {exercise_id}', "
                             "like the cell it replaces")
        cell = notebook.cells[index]
        cell.source = text.rstrip("\n")
        cell.outputs, cell.execution_count = [], None
        used[exercise_id] = files[exercise_id]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, out_path)
    return used


def solution_file(exercise_id: str) -> str:
    """Where exercise `exercise_id`'s solution is, as a learner reads it: the repository's
    `solutions/<notebook stem>/<id>.py` (the folder is found by the notebook number)."""
    number = exercise_id.split(".", 1)[0]
    folders = sorted(SOLUTIONS_DIR.glob(f"{number}_*")) if SOLUTIONS_DIR.is_dir() else []
    folder = folders[0].name if folders else f"{number}_..."
    return f"solutions/{folder}/{exercise_id}.py"
