"""`python -m grpo_lab_course 01 [--with-solutions]`: execute a course notebook with papermill and
check its goals, as the tests do (with solutions: the teacher's copy)."""

from __future__ import annotations

import argparse
import json
import sys

from .goals import NOTEBOOK_GOALS, missed_goals
from .notebooks import find_notebook, run_notebook


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_lab_course", description=__doc__)
    parser.add_argument("name", help="number or name, e.g. 01 or 01b_grpo_maths")
    parser.add_argument("--output-dir", default=None, help="where the executed copy goes "
                        "(default: a new temporary folder; never the source tree)")
    parser.add_argument("--with-solutions", action="store_true",
                        help="fill every exercise cell with its solution (solutions/) first")
    args = parser.parse_args(argv)
    notebook = find_notebook(args.name)
    results = run_notebook(notebook, args.output_dir, with_solutions=args.with_solutions)
    print(json.dumps(results, indent=2, default=str))
    missed = missed_goals(notebook.stem, results) if notebook.stem in NOTEBOOK_GOALS else []
    for goal in missed:
        print(f"missed: {goal}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
