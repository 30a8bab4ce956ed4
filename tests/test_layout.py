"""The package's layout, read statically (ast, nothing of grpo_lab is imported but its __init__).

One folder per role, in the order of `grpo_lab.ROLES`. Checked here:
- no import cycle between grpo_lab's modules. Every import counts, the ones inside functions
  too: no deliberate lazy import closes a cycle today, so none may start one;
- no module imports a role folder that comes after its own;
- nothing in grpo_lab imports the course's helpers (`grpo_lab_course`), and they live outside it;
- every import of grpo_lab (in the package, tests, benchmarks and the notebooks' code cells)
  names a module or package that exists, and every `-m grpo_lab...` command can run;
- the folders are exactly the roles, their __init__ files import nothing, and no module is
  longer than MAX_LINES.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import grpo_lab

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "grpo_lab"
ROLES = grpo_lab.ROLES
COURSE = "grpo_lab_course"
MAX_LINES = 600
"""A module is as long as its concept (issue 45): at 350, concepts were split across files only to
fit (five sim_* modules re-exporting each other), which a reader pays for more than for length."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = {_module_name(p) for p in PACKAGE.rglob("__init__.py")}


def _role(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # None: grpo_lab itself


def _imports(tree: ast.AST, module: str | None) -> list[tuple[str, int]]:
    """(grpo_lab module or package imported, line) for every import in the tree, wherever it
    stands; `module` resolves relative imports (None: outside the package, where a relative import
    is the course package's own)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names
                      if a.name.split(".")[0] == "grpo_lab"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                if module is None:  # the course's helpers importing each other
                    continue
                package = module if module in PACKAGES else module.rsplit(".", 1)[0]
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "grpo_lab":
                target = node.module
            else:
                continue
            # `from grpo_lab.algo import grpo_loss` imports the module grpo_lab.algo.grpo_loss
            submodules = [f"{target}.{a.name}" for a in node.names
                          if f"{target}.{a.name}" in MODULES]
            found += [(m, node.lineno) for m in submodules]
            if len(submodules) < len(node.names):
                found.append((target, node.lineno))
    return found


def _graph() -> dict[str, list[tuple[str, int]]]:
    return {name: _imports(ast.parse(path.read_text()), name) for name, path in MODULES.items()}


def _find_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_folders_are_the_roles():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and any(p.glob("*.py"))}
    assert folders == set(ROLES), f"folders {sorted(folders)} vs grpo_lab.ROLES {ROLES}"
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"modules outside a role folder: {loose}"
    for role in ROLES:
        init = PACKAGE / role / "__init__.py"
        assert init.is_file(), f"{role}/ is not a package"
        tree = ast.parse(init.read_text())
        assert ast.get_docstring(tree), f"{role}/__init__.py: say what the folder is for"
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], (
            f"{role}/__init__.py imports something: keep importing a folder free")
    doc = grpo_lab.__doc__
    rows = [doc.find(f"\n    {role}/ ") for role in ROLES]
    assert -1 not in rows and rows == sorted(rows), "grpo_lab's docstring lists the roles in order"


def test_the_library_never_imports_the_course():
    bad = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            bad += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names
                    if n.split(".")[0] == COURSE]
    assert not bad, f"the library imports the course's helpers: {bad}"


def test_no_import_cycle():
    graph = {m: [t for t, _ in imports] for m, imports in _graph().items()}
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_folder_imports_a_later_role():
    order = {role: i for i, role in enumerate(ROLES)}
    bad = []
    for module, imports in _graph().items():
        role = _role(module)
        for target, line in imports:
            later = _role(target)
            if later in order and (role is None or order[later] > order[role]):
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line} ({role}) imports "
                           f"{target} ({later})")
    order_text = ", ".join(ROLES)
    assert not bad, f"a folder imports a later role (order: {order_text}):\n" + "\n".join(bad)


def _outside_sources():
    """(label, tree) for tests, benchmarks and the notebooks' code cells."""
    for path in sorted([*(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
                        *(ROOT / COURSE).glob("*.py")]):
        yield str(path.relative_to(ROOT)), ast.parse(path.read_text())
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            if cell["cell_type"] == "code":
                source = "".join(cell["source"])
                source = re.sub(r"^\s*[%!].*$", "", source, flags=re.M)  # magics and shell
                yield f"{path.name} cell {i}", ast.parse(source)


def test_every_import_of_grpo_lab_exists():
    known = set(MODULES)
    missing = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}"
               for m, imports in _graph().items() for t, line in imports if t not in known]
    for label, tree in _outside_sources():
        missing += [f"{label}:{line} imports {t}" for t, line in _imports(tree, None)
                    if t not in known]
    assert not missing, "imports of modules that do not exist:\n" + "\n".join(missing)


def _runs_as_main(module: str) -> bool:
    if module.split(".")[0] == COURSE:
        path = ROOT.joinpath(*module.split("."))
        return (path / "__main__.py").is_file() or (
            path.with_suffix(".py").is_file()
            and '__name__ == "__main__"' in path.with_suffix(".py").read_text())
    if module in PACKAGES:
        return f"{module}.__main__" in MODULES
    return module in MODULES and '__name__ == "__main__"' in MODULES[module].read_text()


def test_every_python_dash_m_command_can_run():
    """`[..., "-m", "grpo_lab.cli", ...]` in code and `-m grpo_lab.x` in text name a runnable
    module."""
    commands = []
    sources = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"),
               *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "docs").glob("*.md"),
               ROOT / "README.md", ROOT / "Makefile", *(ROOT / "notebooks").glob("*.ipynb")]
    for path in sources:
        if path.name != Path(__file__).name:
            found = re.findall(r'-m\\?"?,?\s*\\?"?(grpo_lab[\w.]*)', path.read_text())
            commands += [(path.name, m.rstrip(".")) for m in found]
    assert commands, "the pattern finds no command: fix the test"
    bad = sorted({f"{name}: -m {m}" for name, m in commands if not _runs_as_main(m)})
    assert not bad, "commands that cannot run:\n" + "\n".join(bad)


def test_modules_stay_short():
    long = {name: n for name, path in MODULES.items()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by role): {long}"
