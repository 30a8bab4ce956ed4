"""The README's course map is honest: a notebook that leans on an earlier one lists it (or a
notebook that builds on it) in its "builds on" column.

A lesson leans on notebook NN where its prose says so outside parentheses ("The only thing that
changes from notebook 02", "09's model"); a parenthesised "(notebook 01b derives both)" is a
pointer for the curious, and a later notebook is a preview.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from grpo_lab_course.notebooks import list_notebooks, notebook_number

ROOT = Path(__file__).resolve().parent.parent
ORDER = [notebook_number(p) for p in list_notebooks()]


def _map() -> dict[str, set[str]]:
    """{notebook: the notebooks it builds on} from the README's course table."""
    found = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and (m := re.fullmatch(r"`(\d\d[a-z]?)_\w+`", cells[0])):
            found[m.group(1)] = set(re.findall(r"\d\d[a-z]?", cells[2]))
    return found


def _closure(builds_on: dict[str, set[str]], notebook: str) -> set[str]:
    seen, todo = set(), list(builds_on.get(notebook, ()))
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo += builds_on.get(n, ())
    return seen


def _leans_on(path: Path) -> set[str]:
    """Earlier notebooks named outside parentheses in the markdown cells."""
    cells = json.loads(path.read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    while (stripped := re.sub(r"\([^()]*\)", "", text)) != text:  # nested parentheses too
        text = stripped
    named = set(re.findall(r"[Nn]otebook (\d\d[a-z]?)\b(?!-)", text))
    named |= set(re.findall(r"\b(\d\d[a-z]?)'s\b", text))
    me = notebook_number(path)
    return {n for n in named if n in ORDER and ORDER.index(n) < ORDER.index(me)}


def test_the_map_lists_every_notebook():
    assert set(_map()) == set(ORDER), f"README course table {sorted(_map())} vs {ORDER}"


def test_every_notebook_a_lesson_leans_on_is_on_its_path():
    builds_on = _map()
    missing = []
    for path in list_notebooks():
        me = notebook_number(path)
        lacking = _leans_on(path) - _closure(builds_on, me)
        if lacking:
            missing.append(f"{me} leans on {sorted(lacking)}, not on its path "
                           f"{sorted(_closure(builds_on, me))}")
    assert not missing, "README's 'builds on' column:\n" + "\n".join(missing)


def _read_minutes(path: Path, columns: int, column: int) -> dict[str, int]:
    """{notebook: minutes} from a Markdown table whose first column is the notebook's file name
    and whose `column` starts with its reading minutes."""
    found = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = [m.group(1) for c in cells if (m := re.fullmatch(r"`(\d\d[a-z]?)_\w+`", c))]
        if len(cells) == columns and names:
            found[names[0]] = int(re.match(r"\d+", cells[column]).group())
    return found


def test_the_maps_reading_minutes_are_the_notebooks():
    """The README's and docs/course.md's reading minutes are what the notebooks hold now, read at
    `PROSE_WORDS_PER_MINUTE` and `CODE_LINES_PER_MINUTE` (within a minute): a lesson that
    grows or shrinks changes its map."""
    from grpo_lab_course.notebooks import reading_minutes

    actual = {notebook_number(p): reading_minutes(p) for p in list_notebooks()}
    for path, columns, column in ((ROOT / "README.md", 4, 3),
                                  (ROOT / "docs" / "course.md", 5, 2)):
        stated = _read_minutes(path, columns, column)
        assert set(stated) == set(actual), (path.name, sorted(stated))
        off = {n: (stated[n], actual[n]) for n in actual if abs(stated[n] - actual[n]) > 1}
        assert not off, f"{path.name}: (stated, actual) reading minutes {off}"


def test_every_notebook_says_where_it_stands_on_the_map():
    """The "you are here" line under each title matches the README's map (tools/roadmap.py
    writes it), and every notebook is on exactly one track."""
    from grpo_lab_course.notebooks import TRACKS
    from tools.roadmap import main

    on_tracks = [n for order in TRACKS.values() for n in order]
    assert sorted(on_tracks) == sorted(ORDER), (on_tracks, ORDER)
    assert main(["--check"]) == 0, "run .venv/bin/python tools/roadmap.py"
