"""Every relative link in the course's markdown leads somewhere: the file exists, and a `#anchor`
into a Markdown file names one of its headings (as GitHub renders them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from grpo_lab_course.notebooks import list_notebooks

LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation other than `-` and `_` dropped, each
    space a hyphen."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: Path) -> set[str]:
    return {github_anchor(m.group(1)) for m in
            re.finditer(r"^#{1,6} (.+)$", markdown.read_text(), flags=re.M)}


def test_github_anchor_matches_githubs_rule():
    assert github_anchor("10_when_training_goes_wrong: When training goes wrong") == \
        "10_when_training_goes_wrong-when-training-goes-wrong"
    assert github_anchor("Three policies (behaviour, proximal, current)") == \
        "three-policies-behaviour-proximal-current"


@pytest.mark.parametrize("notebook", list_notebooks(), ids=lambda p: p.stem)
def test_every_relative_link_of_a_notebook_resolves(notebook):
    cells = json.loads(notebook.read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    broken = []
    for target in LINK.findall(text):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (notebook.parent / path).resolve()
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with that anchor in {path}")
    assert not broken, f"{notebook.name}:\n" + "\n".join(broken)
