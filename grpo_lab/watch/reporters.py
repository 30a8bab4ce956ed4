"""Reporters: the records MetricsLogger writes to `metrics.jsonl`, sent to trackio or TensorBoard
as well (GRPOConfig's `report_to`, TRL's option of that name).

Each reporter starts at the first record and is told whether that record continues a run (a
resumed job: the logger already holds the run's earlier records). trackio then resumes the run
of the same name, so that its curve continues; TensorBoard hides what a killed attempt logged
after the checkpoint (`purge_step`). trackio and tensorboard are optional
(`pip install grpo_lab[tracking]`): imported by the reporter that needs them.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path

INSTALL_HINT = "pip install 'grpo_lab[tracking]'"


class TrackioReporter:
    """One trackio run: local under TRACKIO_DIR, or in a Space when `space_id` names one."""

    def __init__(self, project: str, run_name: str | None, space_id: str | None = None,
                 config: dict | None = None):
        self.project, self.run_name, self.space_id = project, run_name, space_id
        self.config = config
        self.run = None

    def start(self, first_step: int, resumed: bool) -> None:
        try:
            import trackio
        except ImportError as exc:
            raise ImportError(f"report_to trackio needs trackio: {INSTALL_HINT}") from exc
        # Only the records: no CPU/GPU sampling threads beside the trainer, no dashboard opened
        # from a notebook (`trackio show` serves it). resume="allow" continues the named run.
        self.run = trackio.init(project=self.project, name=self.run_name,
                                space_id=self.space_id, config=self.config,
                                resume="allow" if resumed and self.run_name else "never",
                                embed=False, auto_log_cpu=False, auto_log_gpu=False)
        self.run_name = self.run.name

    def log(self, record: dict) -> None:
        self.run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def alert(self, finding) -> None:
        """A run doctor's finding (grpo_lab.watch.doctor) as a trackio alert on this run."""
        import trackio

        trackio.alert(title=finding.title, text=finding.text(), level=trackio.AlertLevel.WARN)

    def close(self) -> None:
        if self.run is None:
            return
        import trackio

        # Flushes the queued records into the SQLite file (or the Space); trackio.finish() also
        # forgets the run, so that its exit hook does not finish it a second time.
        if trackio.context_vars.current_run.get() is self.run:
            trackio.finish()
        else:
            self.run.finish()
        self.run = None


class TensorBoardReporter:
    """Scalars into `<output_dir>/tensorboard`, one tag per metric name, x = the step."""

    def __init__(self, output_dir: str | Path):
        self.log_dir = Path(output_dir) / TENSORBOARD_DIR
        self.writer = None

    def start(self, first_step: int, resumed: bool) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(f"report_to tensorboard needs tensorboard: {INSTALL_HINT}") from exc
        # A resumed run logs again from the checkpoint: TensorBoard drops the events a killed
        # attempt wrote from that step on (metrics.jsonl was cut at the same step).
        self.writer = SummaryWriter(str(self.log_dir),
                                    purge_step=first_step if resumed else None)

    def log(self, record: dict) -> None:
        for key, value in record.items():
            if key != "step" and is_scalar(value):
                self.writer.add_scalar(key, value, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def is_scalar(value) -> bool:
    """A number TensorBoard plots (bools count; NaN and infinities do not)."""
    return isinstance(value, bool | int | float) and math.isfinite(value)


def make_reporters(config) -> list:
    """The reporters a GRPOConfig's `report_to` names (a list by construction)."""
    reporters = []
    for target in config.report_to:
        if target == "trackio":
            reporters.append(TrackioReporter(config.project, config.effective_run_name,
                                             config.trackio_space_id, config.to_dict()))
        elif target == "tensorboard":
            reporters.append(TensorBoardReporter(config.output_dir))
    return reporters


# ------------------------------------------------------------ which trackers (report_to)
# `report_to`, as TRL's: where else a trainer sends each record it writes to `metrics.jsonl`.
#
# `none`, `trackio` or `tensorboard`, several at once (`trackio,tensorboard`, or a list). This
# module reads the GRPOConfig fields (`report_to`, `run_name`, `project`, `trackio_space_id`);
# the reporters above send the records.


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
