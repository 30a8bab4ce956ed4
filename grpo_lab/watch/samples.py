"""Read what the model writes: a few prompts with their completions and rewards, every N steps.

Numbers say whether training works; the completions say what it learns (and what it games: a
format reward climbing while correctness stays flat shows in the text at once). Every
`log_completions_every` steps the trainers print `num_completions_to_print` prompts of the
step, each with the reference answer and its best and worst completion, and append every one
of those prompts' G completions to `<output_dir>/completions.jsonl`:

    {"step": 50, "prompt": "...", "answer": "...",
     "completions": [{"text": "...", "reward": 1.2, "rewards": {"math_answer": 1.0, ...}}, ...]}
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..data.completions import Completions
from ..data.tasks import Problem


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
