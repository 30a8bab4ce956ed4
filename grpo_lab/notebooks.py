"""Running the course's notebooks: record what a notebook achieved, execute one with papermill.

Each notebook has a `parameters` cell with CPU-sized defaults and a `results_path` parameter;
its last cells assert the outcome and call `record_results(results_path, ...)`, so a test (or
`grpo-lab notebook NAME`) can check values, not just that it ran.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK_DIR = REPO_ROOT / "notebooks"


def record_results(results_path: str | os.PathLike | None, **values) -> dict:
    """Merge `values` into the JSON file at `results_path` (no-op when it is None)."""
    if results_path is None:
        return values
    path = Path(results_path)
    current = json.loads(path.read_text()) if path.exists() else {}
    current.update(values)
    path.write_text(json.dumps(current, indent=2, default=float))
    return current


def list_notebooks(notebook_dir: Path = NOTEBOOK_DIR) -> list[Path]:
    """The numbered notebooks, in course order."""
    return sorted(p for p in notebook_dir.glob("[0-9][0-9]_*.ipynb"))


def find_notebook(name: str, notebook_dir: Path = NOTEBOOK_DIR) -> Path:
    """A notebook by number (`"01"`), stem or file name."""
    for path in list_notebooks(notebook_dir):
        if name in (path.name, path.stem, path.stem[:2]):
            return path
    known = ", ".join(p.stem for p in list_notebooks(notebook_dir)) or "none"
    raise FileNotFoundError(f"no notebook {name!r} in {notebook_dir} (known: {known})")


def run_notebook(
    notebook: str | Path,
    output_dir: str | Path | None = None,
    parameters: dict | None = None,
    cell_timeout_s: int = 600,
) -> dict:
    """Execute a notebook with papermill into `output_dir` (never the source tree).

    Returns the values the notebook recorded with `record_results`. Raises papermill's
    `PapermillExecutionError` (naming the failing cell) when a cell or an assert fails.
    """
    import papermill

    source = Path(notebook) if Path(notebook).suffix == ".ipynb" else find_notebook(str(notebook))
    output_dir = Path(output_dir or tempfile.mkdtemp(prefix="grpo_lab_nb_"))
    output_dir.mkdir(parents=True, exist_ok=True)
    results_path = output_dir / f"{source.stem}.results.json"
    results_path.unlink(missing_ok=True)
    papermill.execute_notebook(
        str(source),
        str(output_dir / source.name),
        parameters={**(parameters or {}), "results_path": str(results_path)},
        cwd=str(source.parent),
        execution_timeout=cell_timeout_s,
        kernel_name="python3",
        progress_bar=False,
    )
    return json.loads(results_path.read_text()) if results_path.exists() else {}
