"""Checks that used to run inside notebooks but only check the repository or the installed
libraries, not a lesson: notebook 03's scan of TRL's installed source for the asynchronous
trainer's metric names, and notebook 09's reading of its own parameters cell."""

import ast
import importlib.util
from pathlib import Path

import nbformat
import pytest

from grpo_lab_course.notebooks import find_notebook


def trl_async_source() -> str:
    """TRL's asynchronous GRPO trainer, and the transformers Trainer under it (which logs `loss`
    and `grad_norm`), as one text."""
    pytest.importorskip("trl")
    trl_async = Path(importlib.util.find_spec("trl").origin).parent / "experimental" / "async_grpo"
    if not trl_async.is_dir():
        pytest.skip(f"this TRL has no {trl_async}")
    transformers = Path(importlib.util.find_spec("transformers").origin).parent
    return ("".join(p.read_text() for p in sorted(trl_async.glob("*.py")))
            + (transformers / "trainer.py").read_text())


def quoted(name: str) -> str:
    """A metric key as TRL's source writes it: `"kl"`; `rewards/<name>` is f"rewards/{...}"."""
    return f'"{name}"' if "<name>" not in name else '"' + name.split("<name>")[0]


def test_notebook_03_every_trl_async_name_is_in_trls_source():
    """Notebook 03, section 4: each TRL name of `TRL_ASYNC_NAMES` is a key TRL's asynchronous
    trainer writes, and a pair marked the same quantity has the same name on both sides."""
    from grpo_lab.watch.metric_names import TRL_ASYNC_NAMES

    source = trl_async_source()
    missing = [r.trl for r in TRL_ASYNC_NAMES if r.trl and quoted(r.trl) not in source]
    renamed = [(r.ours, r.trl) for r in TRL_ASYNC_NAMES if r.same and r.ours != r.trl]
    assert not missing, f"TRL names not in TRL's source: {missing}"
    assert not renamed, f"the same quantity under another name: {renamed}"


def gpu_parameters_of(notebook) -> tuple[list[str], dict]:
    """(the parameters marked `# GPU:` in the parameters cell, in order; the literal
    `GPU_PARAMETERS = dict(...)` of a later cell)."""
    parameters = next(c for c in notebook.cells if "parameters" in c.metadata.get("tags", []))
    marked = [line.split("=")[0].strip() for line in parameters.source.splitlines()
              if "# GPU:" in line]
    for cell in notebook.cells:
        if cell.cell_type != "code" or "GPU_PARAMETERS" not in cell.source:
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if (isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None)
                    == "GPU_PARAMETERS"):
                call = node.value
                return marked, {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    raise AssertionError("no GPU_PARAMETERS = dict(...) in the notebook")


def test_notebook_09_marks_exactly_its_gpu_parameters():
    """Notebook 09, section 7: the parameters cell marks GPU exactly the values of
    GPU_PARAMETERS, in the same order, and each is a field of GRPOConfig that makes a valid
    config with the CPU defaults."""
    from dataclasses import fields

    from grpo_lab.train.config import GRPOConfig

    notebook = nbformat.read(find_notebook("09"), as_version=4)
    marked, gpu = gpu_parameters_of(notebook)
    assert marked == list(gpu), (marked, list(gpu))
    assert set(gpu) <= {f.name for f in fields(GRPOConfig)}
    assert GRPOConfig(**gpu).gradient_checkpointing  # constructing it checks, loads nothing
