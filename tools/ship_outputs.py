"""Run each notebook as a learner first opens it, and ship its outputs in the repository.

    .venv/bin/python tools/ship_outputs.py            # every notebook
    .venv/bin/python tools/ship_outputs.py 01 09b     # some

A notebook is executed in place of a learner: its defaults, its exercises not attempted (their
cells stay `None`), in the learner's mode (a missed goal is a row of the table, not an error),
from `notebooks/` as the working folder, progress bars off. Its outputs are written back into
the source notebook with the SHA-256 of its code cells (`metadata.grpo_lab.code_sha256`), so a
page on GitHub shows the figures under their captions, and `tests/test_notebook_outputs.py` can
tell when a code cell changed after the outputs were made: rerun this for that notebook.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from grpo_lab_course.notebooks import find_notebook, list_notebooks  # noqa: E402


def code_sha256(notebook) -> str:
    """The hash of a notebook's code cells, in order: what its outputs were made from."""
    code = "\n\x00\n".join(c.source for c in notebook.cells if c.cell_type == "code")
    return hashlib.sha256(code.encode()).hexdigest()


def ship(path: Path, timeout_s: int) -> float:
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    os.environ.pop("GRPO_LAB_STRICT_GOALS", None)  # a learner's kernel: goals are a table
    os.environ["TQDM_DISABLE"] = "1"  # no progress widgets in a static page
    client = NotebookClient(notebook, timeout=timeout_s, kernel_name="python3",
                            record_timing=False,  # no timestamps: a diff shows what changed
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    seconds = time.perf_counter() - start
    notebook.metadata["grpo_lab"] = {
        "code_sha256": code_sha256(notebook),
        "reference_run": f"{platform.machine()}, {os.cpu_count()} CPU cores, no GPU; "
                         f"{seconds:.0f} s; {time.strftime('%Y-%m-%d')}",
    }
    notebook.metadata.pop("widgets", None)
    nbformat.write(notebook, path)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("notebooks", nargs="*", help="numbers or names (default: all)")
    parser.add_argument("--timeout-s", type=int, default=900, help="per cell")
    args = parser.parse_args()
    paths = [find_notebook(n) for n in args.notebooks] or list_notebooks()
    for k, path in enumerate(paths, 1):
        print(f"[{k}/{len(paths)}] {path.name} ...", flush=True)
        print(f"    {ship(path, args.timeout_s):.0f} s", flush=True)


if __name__ == "__main__":
    main()
