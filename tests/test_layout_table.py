"""docs/layout.md's package table says where each concept lives and which notebooks bring it in.

Checked against the tree and the notebooks' own imports (read statically, as test_layout does):
- every module of every role folder has exactly one row entry under its role, and every entry
  is a module that exists;
- a role's notebooks, `data/` (00, 01, ...), are exactly the notebooks that first import one of
  its modules (in course order): the notebook a learner meets the module in.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

from test_layout import MODULES, _imports

from grpo_lab_course.notebooks import list_notebooks, notebook_number

ROOT = Path(__file__).resolve().parent.parent
HEADER = "| role (notebooks) | module | concept |"
TABLE = ROOT / "docs" / "layout.md"


def _table() -> dict[str, tuple[list[str], list[str]]]:
    """{role: (notebook numbers in its label, modules listed)} from docs/layout.md."""
    lines = TABLE.read_text().splitlines()
    start = lines.index(HEADER) + 2  # skip the header's separator row
    table: dict[str, tuple[list[str], list[str]]] = {}
    role = None
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        first, modules = (cell.strip() for cell in line.strip("|").split("|")[:2])
        if first:
            match = re.fullmatch(r"`(\w+)/`(?: \(([\w, ]+)\))?", first)
            assert match, f"layout table: a role cell reads `name/` (notebooks): {first!r}"
            role = match.group(1)
            numbers = [n.strip() for n in (match.group(2) or "").split(",") if n.strip()]
            table[role] = (numbers, [])
        assert role, f"layout table: a row before any role: {line!r}"
        table[role][1].extend(re.findall(r"`(\w+)`", modules))
    return table


def _package_modules() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for name in MODULES:
        parts = name.split(".")
        if len(parts) == 3 and parts[2] not in ("__main__",):
            found.setdefault(parts[1], set()).add(parts[2])
    return found


def _first_notebook_of_each_module() -> dict[str, str]:
    first: dict[str, str] = {}
    for path in list_notebooks():  # course order: the first import wins
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            source = re.sub(r"^\s*[%!].*$", "", "".join(cell["source"]), flags=re.M)
            for module, _ in _imports(ast.parse(source), None):
                if module.count(".") == 2:
                    first.setdefault(module, notebook_number(path))
    return first


def test_the_table_lists_every_module_once_under_its_stage():
    table, tree = _table(), _package_modules()
    assert set(table) == set(tree), f"roles: docs/layout.md {sorted(table)} vs tree {sorted(tree)}"
    for role, (_, listed) in table.items():
        repeated = sorted({m for m in listed if listed.count(m) > 1})
        assert not repeated, f"{role}/ lists {repeated} twice"
        assert set(listed) == tree[role], (
            f"{role}/: missing from docs/layout.md {sorted(tree[role] - set(listed))}, "
            f"listed but not in the tree {sorted(set(listed) - tree[role])}")


def test_each_stage_names_the_notebooks_that_bring_its_modules_in():
    first = _first_notebook_of_each_module()
    wrong = []
    for role, (numbers, _) in _table().items():
        expected = sorted({nb for module, nb in first.items() if module.split(".")[1] == role})
        if numbers != expected:
            wrong.append(f"`{role}/` reads ({', '.join(numbers)}), its modules are first "
                         f"imported in ({', '.join(expected)})")
    assert not wrong, "docs/layout.md package table:\n" + "\n".join(wrong)
