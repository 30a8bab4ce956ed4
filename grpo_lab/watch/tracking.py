"""`report_to`, as TRL's: where else a trainer sends each record it writes to `metrics.jsonl`.

`none`, `trackio` or `tensorboard`, several at once (`trackio,tensorboard`, or a list). This
module reads the GRPOConfig fields (`report_to`, `run_name`, `project`, `trackio_space_id`);
grpo_lab.watch.reporters sends the records.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPORT_TARGETS = ("trackio", "tensorboard")
"""What `report_to` may name besides `none` (TRL's names for the same tools)."""

TENSORBOARD_DIR = "tensorboard"
"""TensorBoard's event files: `<output_dir>/tensorboard` (`tensorboard --logdir <output_dir>`)."""


def report_targets(value) -> list[str]:
    """`"trackio,tensorboard"`, `"['trackio']"` (as grpo_lab.util.argv writes a list), a list,
    `"none"`, `"all"` or None -> the list of targets (empty for none). Raises ValueError."""
    if value is None:
        return []
    if isinstance(value, str):
        text = value.strip()
        try:
            value = ast.literal_eval(text) if text.startswith("[") else text.split(",")
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"report_to {text!r} is not a list of names") from exc
    names = [str(v).strip().lower() for v in value if str(v).strip()]
    if "all" in names:
        names = list(REPORT_TARGETS)
    names = [n for n in names if n != "none"]
    unknown = sorted(set(names) - set(REPORT_TARGETS))
    if unknown:
        raise ValueError(f"unknown report_to {unknown} (choose none, all or some of "
                         f"{', '.join(REPORT_TARGETS)})")
    return list(dict.fromkeys(names))  # in order, each once


def run_name(config) -> str | None:
    """`run_name`, or the output folder's name (the same on a resume, so that trackio continues
    the curve); None without either (trackio then makes a name up)."""
    if config.run_name or not config.output_dir:
        return config.run_name
    return Path(config.output_dir).name or None


def tracking_problems(config) -> list[str]:
    """What is wrong with a config's tracking settings; makes `report_to` a list."""
    try:
        config.report_to = report_targets(config.report_to)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    if "tensorboard" in config.report_to and not config.output_dir:
        problems.append(f"report_to tensorboard writes into <output_dir>/{TENSORBOARD_DIR}: "
                        "set output_dir")
    if not config.project:
        problems.append("project must be a name (trackio's project)")
    return problems
