"""Print pip constraints that hold every core dependency of pyproject.toml at its floor.

`make test-floors` installs grpo_lab with these constraints into a second environment
(.venv-floors) and runs the unit tier there, so each `>=` floor in pyproject.toml is a version
the tests passed on. torch is the exception: it takes the `cpu` extra's pin (the build the course
is measured on), not its floor. Standard library only: it runs before any environment exists.

    python tools/floor_constraints.py > constraints.txt
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
FLOOR = re.compile(r">=\s*([^,;\s]+)")


def requirement_name(req: str) -> str:
    """`transformers>=5.5.3,<6` -> `transformers` (lower case, `_` as `-`)."""
    return NAME.match(req).group(1).lower().replace("_", "-")


def floor(req: str) -> str | None:
    """The `>=` bound of a requirement (None if it has none)."""
    found = FLOOR.search(req.split(";")[0])
    return found.group(1) if found else None


def floor_constraints(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, str]:
    """{name: version} for every core dependency and the `trl` extra: its floor, or the `cpu`
    extra's pin for torch. A dependency without a floor is an error (it could not be tested)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    pins = {requirement_name(r): r.split("==", 1)[1].strip()
            for r in project["optional-dependencies"]["cpu"] if "==" in r}
    versions = {}
    # the core, and the `trl` extra that `make test-floors` installs too (its floor is tested)
    for req in [*project["dependencies"], *project["optional-dependencies"]["trl"]]:
        name = requirement_name(req)
        versions[name] = pins.get(name) or floor(req)
        if versions[name] is None:
            raise ValueError(f"core dependency {req!r} has no >= floor")
    return versions


def main() -> None:
    sys.stdout.write("".join(f"{name}=={version}\n"
                             for name, version in floor_constraints().items()))


if __name__ == "__main__":
    main()
