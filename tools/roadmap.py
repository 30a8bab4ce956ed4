"""Write (or check) each notebook's "you are here" line: its track, its place on it, what it
builds on and its minutes, all read from the README's course map.

    .venv/bin/python tools/roadmap.py           # write the line into every notebook
    .venv/bin/python tools/roadmap.py --check   # exit 1 naming each notebook whose line is stale

The line sits right under the notebook's title, in its first (markdown) cell; only that cell's
text changes, so the shipped outputs stay valid.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from grpo_lab_course.notebooks import (  # noqa: E402
    ROADMAP_PREFIX,
    TRACKS,
    list_notebooks,
    notebook_number,
)


def course_map(readme: Path = ROOT / "README.md") -> dict[str, dict]:
    """{notebook: {"builds_on": [...], "read": minutes, "run": minutes}} from the README table."""
    found = {}
    for line in readme.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and (m := re.fullmatch(r"`(\d\d[a-z]?)_\w+`", cells[0])):
            read, run = cells[3].split(" / ")
            found[m.group(1)] = {"builds_on": re.findall(r"\d\d[a-z]?", cells[2]),
                                 "read": read, "run": run}
    return found


def roadmap_line(number: str, entry: dict) -> str:
    track, order = next((t, o) for t, o in TRACKS.items() if number in o)
    steps = " · ".join(f"**{n}**" if n == number else n for n in order)
    after = " (after 00-02)" if track == "systems" else ""
    builds = f"builds on {', '.join(entry['builds_on'])}" if entry["builds_on"] else \
        "builds on nothing before it"
    return (f"{ROADMAP_PREFIX} the {track} track{after}, {order.index(number) + 1} of "
            f"{len(order)}: {steps}. It {builds} ([the map](../README.md#the-course)); about "
            f"{entry['read']} min to read, {entry['run']} to run.")


def with_roadmap(source: str, line: str) -> str:
    """The first cell's text with `line` under its title (replacing an earlier one)."""
    lines = [x for x in source.split("\n") if not x.startswith(ROADMAP_PREFIX)]
    title, rest = lines[0], lines[1:]
    while rest and not rest[0].strip():
        rest = rest[1:]
    return "\n".join([title, "", line, "", *rest])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    args = parser.parse_args(argv)
    entries, stale = course_map(), []
    for path in list_notebooks():
        nb = json.loads(path.read_text())
        first = nb["cells"][0]
        assert first["cell_type"] == "markdown" and "".join(first["source"]).startswith("# ")
        old = "".join(first["source"])
        new = with_roadmap(old, roadmap_line(notebook_number(path), entries[notebook_number(path)]))
        if new != old:
            stale.append(path.name)
            if not args.check:
                first["source"] = new.splitlines(keepends=True)
                path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
    if stale:
        print(("stale: " if args.check else "wrote: ") + ", ".join(stale))
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
