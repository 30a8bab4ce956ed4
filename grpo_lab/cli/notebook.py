"""`grpo-lab notebook 01`: execute a course notebook with papermill (grpo_lab.cli.notebooks)."""

from __future__ import annotations

from .flags import BOOL_FLAG


def add_parser(sub) -> None:
    nb = sub.add_parser("notebook", help="execute a course notebook with papermill")
    nb.add_argument("name", help="number or name, e.g. 01")
    nb.add_argument("--output-dir", default=None, help="where the executed copy goes")
    nb.add_argument("--with-solutions", default=False, **BOOL_FLAG,
                    help="fill every exercise cell with its solution (solutions/) first: the "
                    "teacher's copy, as the tests run it")
    nb.set_defaults(func=run)


def run(args) -> int:
    from .notebooks import run_notebook

    print(run_notebook(args.name, args.output_dir, with_solutions=args.with_solutions))
    return 0
