"""The README is a front door: short, the two commands on its first screen, its code runs."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
MAX_WORDS = 1500
FIRST_SCREEN_LINES = 40


def test_the_readme_is_short():
    words = len(README.split())
    assert words <= MAX_WORDS, (f"README.md has {words} words (at most {MAX_WORDS}): move the "
                                "detail into docs/ and link it")


def test_the_two_commands_are_on_the_first_screen():
    first = "\n".join(README.splitlines()[:FIRST_SCREEN_LINES])
    assert re.search(r"^make demo\b", first, flags=re.M), "`make demo` is not on the first screen"
    assert re.search(r"^make test\b", first, flags=re.M), "`make test` is not on the first screen"


def test_every_linked_file_exists():
    links = re.findall(r"\]\(([^)#]+)\)", README)
    assert links, "the README links nothing: fix the pattern"
    missing = [link for link in links if not link.startswith("http") and not (ROOT / link).exists()]
    assert not missing, f"README.md links files that do not exist: {missing}"


def test_the_python_example_runs(tmp_path, monkeypatch):
    block = re.search(r"```python\n(.*?)```", README, flags=re.S).group(1)
    assert "gl.GRPOTrainer" in block
    # the same code, two steps long and writing into a temporary folder
    short = block.replace("steps=30", "steps=2, eval_size=16").replace("runs/mine",
                                                                        str(tmp_path / "mine"))
    assert short != block, "the example's settings moved: update this test"
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(short, "README.md's example", "exec"), scope)
    history = scope["history"]
    steps = [row for row in history if "reward" in row]  # beside them, the evaluations' rows
    assert len(steps) == 2, history
    assert (tmp_path / "mine" / "metrics.jsonl").is_file()
