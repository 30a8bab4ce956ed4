"""Stage 9, cli: the `grpo-lab` command and what only the command runs.

`main` (the entry point), `flags` (flags from config dataclasses), the subcommands `launch`,
`train-async` and `demo` (`demo`: in one process; `multi_job`: as the recipe's jobs, notebook
07), and `notebooks` (running the course's notebooks, the goals each must reach).
`python -m grpo_lab.cli` is the same as `grpo-lab`.
"""
