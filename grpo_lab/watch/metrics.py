"""Metrics: one JSON object per step in `metrics.jsonl`, the one-line progress print
(`format_step`), and plot functions that read them.

Names follow TRL's GRPOTrainer so that a learner can read either library's logs; every name is
explained once in grpo_lab.watch.metric_names.METRICS.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..util.files import read_jsonl

if TYPE_CHECKING:  # annotations only: reading a run's metrics needs no torch
    import torch

    from ..data.completions import Completions
    from ..data.tasks import Problem

RUN_RECORDS = ("metrics.jsonl", "findings.jsonl", "completions.jsonl", "syncs.jsonl",
               "summary.json", "checkpoints", "tensorboard")
"""What a run writes about itself into its folder (config.json is written anew by each run);
`checkpoints/` too, so that resuming never picks an earlier run's, and TensorBoard's events, so
that its curves are not drawn over each other."""
EARLIER_RUNS = "earlier-runs"


def set_aside_earlier_run(folder: str | Path) -> Path | None:
    """A reused run folder starts a fresh run: an earlier run's records (RUN_RECORDS) move into
    `earlier-runs/<n>/` inside it, so the two are never mixed and nothing is lost. Returns where
    they went, or None when the folder held no earlier run."""
    folder = Path(folder)
    found = [folder / name for name in RUN_RECORDS if (folder / name).exists()]
    if not (folder / "metrics.jsonl").exists():
        return None
    done = sorted(int(p.name) for p in (folder / EARLIER_RUNS).glob("[0-9]*") if p.name.isdigit())
    target = folder / EARLIER_RUNS / str(done[-1] + 1 if done else 1)
    target.mkdir(parents=True)
    for path in found:
        path.rename(target / path.name)
    return target


class MetricsLogger:
    """Appends one JSON line per record; keeps the records in memory too, and sends each to the
    `reporters` (trackio, TensorBoard: grpo_lab.watch.reporters), the one place records go out.

    The reporters start at the first record logged; when the logger already holds records then
    (a resumed run sets `records` to those kept), they continue that run. `close()` ends them;
    a later record starts them again, continuing."""

    def __init__(self, path: str | Path | None = None, reporters: Sequence = (), doctor=None,
                 write=print):
        self.path = Path(path) if path else None
        self.records: list[dict] = []
        self.reporters = list(reporters)
        self._started = False
        # The run doctor (grpo_lab.watch.doctor): each finding is said once, as it appears:
        # printed (`write`), in `findings.jsonl` beside metrics.jsonl, and as a trackio alert.
        self.doctor, self.write = doctor, write
        self.findings: list = []
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def number_run(self, ordinal: int) -> None:
        """This is the `ordinal`-th run in a reused folder (set_aside_earlier_run): a reporter's
        named run (trackio's) becomes `<name>-<ordinal>`, not a second run of the first's name."""
        for reporter in self.reporters:
            if getattr(reporter, "run_name", None):
                reporter.run_name = f"{reporter.run_name}-{ordinal}"

    def log(self, record: dict) -> None:
        if self.reporters and not self._started:
            for reporter in self.reporters:
                reporter.start(record.get("step", 0), resumed=bool(self.records))
            self._started = True
        self.records.append(record)
        if self.path:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
        for reporter in self.reporters:
            reporter.log(record)
        if self.doctor is not None:
            for finding in self.doctor.observe(record):
                self.report_finding(finding)

    def report_finding(self, finding) -> None:
        self.findings.append(finding)
        self.write(finding.text())
        if self.path:
            with self.path.with_name("findings.jsonl").open("a") as f:
                f.write(json.dumps(finding.as_dict()) + "\n")
        for reporter in self.reporters:
            if hasattr(reporter, "alert"):
                reporter.alert(finding)

    def close(self) -> None:
        """End the reporters' runs (flushes trackio's queue); metrics.jsonl needs nothing."""
        if self._started:
            for reporter in self.reporters:
                reporter.close()
            self._started = False


LOG_KEYS = ("reward", "reward_std", "ratio", "loss", "completions/mean_length", "perf/step_s")


def format_step(record: dict, total_steps: int) -> str:
    """`[step 3/200] reward=0.438 reward_std=... ` with the same keys on every line."""
    parts = [f"[step {record['step']}/{total_steps}]"]
    parts += [f"{k.split('/')[-1]}={record[k]:.3f}" for k in LOG_KEYS if k in record]
    if "eval/accuracy" in record:
        parts.append(f"eval_acc={record['eval/accuracy']:.3f}")
    return " ".join(parts)


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a metrics.jsonl file (a run folder's is `<run>/metrics.jsonl`)."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    return read_jsonl(path)


def series(records: Iterable[dict], key: str, x: str = "step") -> tuple[list, list]:
    """(xs, ys) of the records that carry `key`."""
    points = [(r[x], r[key]) for r in records if key in r and x in r]
    return [p[0] for p in points], [p[1] for p in points]


def moving_average(values: Sequence[float], window: int = 10) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_training(records: list[dict], title: str = "GRPO", keys=("reward", "eval/accuracy")):
    """One panel per key against the step; rewards get a moving average. Returns the figure."""
    import matplotlib.pyplot as plt

    columns = len(keys) if len(keys) <= 2 else 2  # more than two panels: a grid, readable
    rows = -(-len(keys) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(5.5 * columns, 3.4 * rows), squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    for ax, key in zip(axes.flat, keys):
        xs, ys = series(records, key)
        marker = "o-" if len(xs) < 30 else "-"
        ax.plot(xs, ys, marker, alpha=0.35 if len(xs) >= 30 else 1.0, label=key)
        if len(xs) >= 30:
            ax.plot(xs, moving_average(ys), label=f"{key} (moving avg)")
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot_runs(runs: dict[str, list[dict]], key: str = "reward", x: str = "step", window: int = 10):
    """Several runs on one axis (e.g. full fine-tuning vs LoRA). Returns the figure."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, records in runs.items():
        xs, ys = series(records, key, x)
        ax.plot(xs, moving_average(ys, window) if len(ys) >= window else ys, label=name)
    ax.set_xlabel(x)
    ax.set_ylabel(key)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


# ------------------------------------------------------------ the completion log
# Read what the model writes: a few prompts with their completions and rewards, every N steps.
#
# Numbers say whether training works; the completions say what it learns (and what it games: a
# format reward climbing while correctness stays flat shows in the text at once). Every
# `log_completions_every` steps the trainers print `num_completions_to_print` prompts of the
# step, each with the reference answer and its best and worst completion, and append every one
# of those prompts' G completions to `<output_dir>/completions.jsonl`:
#
#     {"step": 50, "prompt": "...", "answer": "...",
#      "completions": [{"text": "...", "reward": 1.2, "rewards": {"math_answer": 1.0, ...}}, ...]}


def completion_records(step: int, problems: Sequence[Problem], out: Completions,
                       rewards: torch.Tensor, parts: dict[str, torch.Tensor], count: int,
                       prompt_text: Callable = str) -> list[dict]:
    """The first `count` prompts of a step (G completions each, prompt-major), best first."""
    G = len(out) // max(len(problems), 1)
    records = []
    for k, problem in enumerate(problems[:count]):
        rows = range(k * G, (k + 1) * G)
        completions = [{"text": out.texts[i], "reward": round(float(rewards[i]), 4),
                         "rewards": {name: round(float(v[i]), 4) for name, v in parts.items()}}
                       for i in rows]
        completions.sort(key=lambda c: -c["reward"])
        records.append({"step": step, "prompt": prompt_text(problem.prompt),
                        "answer": problem.answer, "completions": completions})
    return records


def format_records(records: list[dict], width: int = 100) -> str:
    """The records as a few readable lines: prompt, answer, best and worst completion."""

    def short(text: str, keep_end: bool = False) -> str:
        text = " ".join(str(text).split())  # one line: newlines become spaces
        if len(text) <= width:
            return text
        # A templated prompt starts with the same system turn every time: show its end.
        return "..." + text[3 - width:] if keep_end else text[: width - 3] + "..."

    lines = []
    for r in records:
        best, worst = r["completions"][0], r["completions"][-1]
        rewards = [c["reward"] for c in r["completions"]]
        lines.append(f"--- step {r['step']} | prompt: {short(r['prompt'], keep_end=True)}")
        lines.append(f"    answer: {short(r['answer'])} | rewards of the group: {rewards}")
        lines.append(f"    best  ({best['reward']:+.2f}): {short(best['text'])}")
        if len(r["completions"]) > 1:
            lines.append(f"    worst ({worst['reward']:+.2f}): {short(worst['text'])}")
    return "\n".join(lines)


class CompletionLog:
    """Prints sample completions and appends them to `completions.jsonl` (if a folder is set)."""

    def __init__(self, every: int, count: int, output_dir: str | Path | None = None,
                 prompt_text: Callable = str, write: Callable[[str], None] = print):
        self.every, self.count = every, count
        self.path = Path(output_dir) / "completions.jsonl" if output_dir else None
        self.prompt_text, self.write = prompt_text, write

    def due(self, step: int) -> bool:
        return bool(self.every and self.count and step % self.every == 0)

    def log(self, step: int, problems, out: Completions, rewards, parts) -> list[dict]:
        if not self.due(step):
            return []
        records = completion_records(step, problems, out, rewards, parts, self.count,
                                     self.prompt_text)
        self.write(format_records(records))
        if self.path:
            with self.path.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)
        return records
