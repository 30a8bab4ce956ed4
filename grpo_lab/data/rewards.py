"""Reward functions with TRL's signature: `reward(completions, **kwargs) -> list[float]`.

They are module-level (so they pickle into other processes), read the reference answers from the
`answer` column that TRL passes as a keyword, and never raise on model output: a malformed
completion scores 0.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction


def completion_text(completion) -> str:
    """A completion as text: TRL passes strings, or message lists for conversational data."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return ""


def exact_match_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion, stripped of surrounding space, equals the answer; else 0.0."""
    return [
        float(completion_text(c).strip() == str(a).strip()) for c, a in zip(completions, answer)
    ]


_NUMBER = r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?"


def _boxed_contents(text: str) -> list[str]:
    """Contents of every `\\boxed{...}`, with nested braces balanced."""
    found = []
    for start in [m.end() for m in re.finditer(r"\\boxed\s*\{", text)]:
        depth, i = 1, start
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found.append(text[start : i - 1])
    return found


def extract_final_answer(text: str) -> str | None:
    """The final answer of a worked solution: `#### x`, else the last `\\boxed{x}`, else the last
    number."""
    if not isinstance(text, str):
        return None
    hashes = re.findall(r"####\s*(.+)", text)
    if hashes:
        return hashes[-1].strip()
    boxed = _boxed_contents(text)
    if boxed:
        return boxed[-1].strip()
    numbers = re.findall(_NUMBER, text)
    return numbers[-1] if numbers else None


def parse_number(text: str | None) -> Fraction | None:
    """`"1,234"`, `"-3.5"`, `"7/2"`, `"\\frac{7}{2}"`, `"$12"` as an exact Fraction, else None."""
    if text is None:
        return None
    s = text.strip().rstrip(".").replace("$", "").replace(",", "").replace(" ", "")
    frac = re.fullmatch(r"(-?)\\d?frac\{(-?\d+)\}\{(\d+)\}", s)
    if frac:
        s = f"{frac.group(1)}{frac.group(2)}/{frac.group(3)}"
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def math_answer_reward(completions, answer, **kwargs) -> list[float]:
    """1.0 when the completion's final answer equals the reference numerically (or as text)."""
    rewards = []
    for completion, reference in zip(completions, answer):
        predicted = extract_final_answer(completion_text(completion))
        expected = extract_final_answer(str(reference)) or str(reference).strip()
        p, e = parse_number(predicted), parse_number(expected)
        if p is not None and e is not None:
            ok = math.isclose(float(p), float(e), rel_tol=1e-9, abs_tol=1e-9)
        else:
            ok = predicted is not None and predicted.strip() == expected.strip()
        rewards.append(float(ok))
    return rewards


def partial_match_reward(completions, answer, **kwargs) -> list[float]:
    """Partial credit: the share of the answer's characters the completion has right, position
    by position (`"053"` for `"052"` scores 2/3); 0.0 when the lengths differ. Beside
    `exact_match` it tells a group's near misses from its wild guesses, so fewer groups have
    all-equal rewards (no learning signal) while the model is still mostly wrong."""
    rewards = []
    for completion, reference in zip(completions, answer):
        got, want = completion_text(completion).strip(), str(reference).strip()
        same = sum(a == b for a, b in zip(got, want))
        rewards.append(same / len(want) if want and len(got) == len(want) else 0.0)
    return rewards


def format_reward(completions, **kwargs) -> list[float]:
    """1.0 when the completion states a final answer in a checkable form, `#### x` (GSM8K) or
    `\\boxed{x}` (MATH), right or wrong; else 0.0. Beside a correctness reward it rewards the
    habit of answering in the form the grader reads, which a small model learns first."""
    rewards = []
    for completion in completions:
        text = completion_text(completion)
        rewards.append(float(bool(re.search(r"####\s*\S", text) or _boxed_contents(text))))
    return rewards


REWARDS = {"exact_match": exact_match_reward, "partial_match": partial_match_reward,
           "math_answer": math_answer_reward, "format": format_reward}
"""The built-in rewards by name; `grpo_lab.data.reward_set` adds `module:function` from your
code."""
