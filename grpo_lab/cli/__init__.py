"""cli: the `grpo-lab` command and what only the command runs.

`main` (the entry point: parses, then calls the command's `run`), `flags` (flags from config
dataclasses), one module per command, each with `add_parser` and `run`: `demo` (`--jobs none`:
in one process; `multi_job`: as the recipe's jobs, notebook 07), `train`, `train_async`,
`train_trl_async`, `build_model`, `serve`, `proxy`, `launch`. `python -m grpo_lab.cli` is the
same as `grpo-lab`. Running the course's notebooks is the repository's `python -m grpo_lab_course`,
not the package's.
"""
