"""The public API (docs/api.md): `grpo_lab.__all__`, the lazy map and the page's list agree; every
name resolves to the module the page names; the page's torch column is true (`import grpo_lab` and
its torch-free names import no torch); example (a) runs and example (c)'s config builds."""

from __future__ import annotations

import ast
import importlib
import inspect
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

import grpo_lab

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "api.md").read_text()
ROW = re.compile(r"^\| `(\w+)` \| `(grpo_lab(?:\.\w+)+)` \| (yes|no) \| [^|].*\|$", re.M)
ROWS = ROW.findall(PAGE)  # (name, module, torch)
TORCH_PACKAGES = {"torch", "transformers", "peft", "accelerate", "trl"}  # each imports torch


def _example(label: str) -> str:
    """The first ```python block under the heading `### (label) ...`."""
    found = re.search(rf"^### \({label}\) .*?^```python\n(.*?)^```", PAGE, re.M | re.S)
    assert found, f"docs/api.md has no python block under '### ({label}) ...'"
    return found.group(1)


def test_the_page_the_exports_and_the_lazy_map_agree():
    names_section = PAGE.split("\n## The names", 1)[1].split("\n## ", 1)[0]
    table_lines = re.findall(r"^\| `.*$", names_section, re.M)
    assert len(ROWS) == len(table_lines), "a row of docs/api.md's list does not parse"
    names = [name for name, _, _ in ROWS]
    assert len(names) == len(set(names)), "a name is listed twice in docs/api.md"
    assert len(grpo_lab.__all__) == len(set(grpo_lab.__all__))
    assert set(names) == set(grpo_lab.__all__), (
        f"only in docs/api.md: {sorted(set(names) - set(grpo_lab.__all__))}; only in "
        f"grpo_lab.__all__: {sorted(set(grpo_lab.__all__) - set(names))}")
    assert {name: module for name, module, _ in ROWS} == grpo_lab._MODULE_OF


def test_every_name_resolves_to_the_module_that_defines_it():
    for name in grpo_lab.__all__:
        module_name = grpo_lab._MODULE_OF[name]
        value = getattr(grpo_lab, name)
        assert value is getattr(importlib.import_module(module_name), name), name
        if inspect.isclass(value) or inspect.isfunction(value):  # defined there, not re-exported
            assert value.__module__ == module_name, f"{name} is defined in {value.__module__}"
    assert set(grpo_lab.__all__) <= set(dir(grpo_lab))
    with pytest.raises(AttributeError, match="no attribute 'GRPOTrainr'"):
        grpo_lab.GRPOTrainr  # noqa: B018


def _module_file(module: str) -> Path | None:
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level_imports(module: str) -> set[str]:
    """Modules and packages that importing `module` imports at once (not inside functions, not
    under `if TYPE_CHECKING`), relative imports resolved."""
    path = _module_file(module)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found: set[str] = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = (".".join(base + [node.module] if node.module else base)
                          if node.level else node.module)
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names
                             if _module_file(f"{target}.{a.name}"))
            elif isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    visit(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body + node.orelse + node.finalbody
                      + [s for handler in node.handlers for s in handler.body])

    visit(ast.parse(path.read_text()).body)
    return found


def _imports_torch(module: str, seen: set[str] | None = None) -> bool:
    seen = set() if seen is None else seen
    seen.add(module)
    for target in _top_level_imports(module):
        if target.split(".")[0] in TORCH_PACKAGES:
            return True
        parts = target.split(".")
        # importing grpo_lab.a.b runs grpo_lab.a's __init__ too
        chain = [".".join(parts[:i]) for i in range(2, len(parts) + 1)]
        for name in chain:
            if (parts[0] == "grpo_lab" and name not in seen and _module_file(name)
                    and _imports_torch(name, seen)):
                return True
    return False


def test_the_torch_column_says_which_names_import_torch():
    """'yes': the module imports torch (or a library built on it) when imported, read from the
    source; 'no': a fresh interpreter touches every such name without importing torch."""
    wrong = [f"{name} ({module}): the page says torch={torch}" for name, module, torch in ROWS
             if _imports_torch(module) != (torch == "yes")]
    assert not wrong, "\n".join(wrong)
    light = [name for name, _, torch in ROWS if torch == "no"]
    assert light, "docs/api.md marks no name torch-free"
    code = ("import sys\nimport grpo_lab\n"
            "assert 'torch' not in sys.modules, 'import grpo_lab imported torch'\n"
            f"for name in {light!r}:\n"
            "    getattr(grpo_lab, name)\n"
            "    assert 'torch' not in sys.modules, f'grpo_lab.{name} imported torch'\n"
            "grpo_lab.grpo_loss\n"
            "assert 'torch' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_example_a_the_loss_on_your_own_batch_runs():
    scope: dict = {}
    exec(compile(_example("a"), "docs/api.md example (a)", "exec"), scope)
    loss, logits, metrics = scope["loss"], scope["logits"], scope["metrics"]
    assert loss.dim() == 0 and math.isfinite(loss.item())
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    assert metrics["ratio"] == pytest.approx(1.0)  # logps == old_logps before the update


def test_example_c_builds_its_config(monkeypatch):
    built = []

    class Trainer:  # stands in for the training run: the hub is not reached here
        def __init__(self, config, **kwargs):
            built.append(config)

        def train(self):
            return []

    monkeypatch.setattr(grpo_lab, "AsyncGRPOTrainer", Trainer)
    exec(compile(_example("c"), "docs/api.md example (c)", "exec"), {})
    (config,) = built
    assert isinstance(config, grpo_lab.AsyncGRPOConfig)
    assert (config.model, config.dataset) == ("Qwen/Qwen2.5-0.5B-Instruct", "openai/gsm8k")


def test_every_example_compiles_and_uses_exported_names():
    for label in "abc":
        compile(_example(label), f"docs/api.md example ({label})", "exec")
    used = set(re.findall(r"\bgl\.(\w+)", PAGE))
    assert used <= set(grpo_lab.__all__), f"docs/api.md uses {sorted(used - set(grpo_lab.__all__))}"
