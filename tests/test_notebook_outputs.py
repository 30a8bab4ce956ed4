"""The notebooks ship the outputs of a reference run, made from their current code.

`tools/ship_outputs.py` executes each notebook as a learner first opens it and records the hash
of its code cells beside the outputs; a code cell edited since then fails here, naming the
notebook to rerun it for.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import nbformat
import pytest

from grpo_lab_course.notebooks import list_notebooks

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ship_outputs", ROOT / "tools" / "ship_outputs.py")
ship_outputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ship_outputs)


@pytest.mark.parametrize("path", list_notebooks(), ids=lambda p: p.stem)
def test_the_shipped_outputs_come_from_the_current_code(path):
    notebook = nbformat.read(path, as_version=4)
    shipped = notebook.metadata.get("grpo_lab", {}).get("code_sha256")
    assert shipped, (f"{path.name} ships no reference run: "
                     f".venv/bin/python tools/ship_outputs.py {path.stem}")
    assert shipped == ship_outputs.code_sha256(notebook), (
        f"{path.name}: a code cell changed after its outputs were made: "
        f".venv/bin/python tools/ship_outputs.py {path.stem}")
    code = [c for c in notebook.cells if c.cell_type == "code"]
    assert all(c.execution_count for c in code), f"{path.name}: a code cell never ran"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, f"{path.name} ships an error: {errors[0].get('ename')}"
