"""Which way of asking gives GRPO something to learn from on SmolLM2-135M-Instruct?

    python benchmarks/real_model_prompts.py

GRPO learns only from groups whose G rewards differ. Before choosing the real model's task, this
measures, for several ways of asking the same sums (a, b in 1..30, 64 problems), what the model
does before any training: greedy strict correctness (the right answer in the asked form and
nothing else), the right number anywhere in the reply, and at temperature 1 (8 samples for each
of 16 problems) the strict rate and how many groups have a spread of rewards. One process, two
threads. Results: benchmarks/results/real_model_prompts.json.
"""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import torch

from grpo_lab.model.models import load_model_and_tokenizer

RESULTS = Path(__file__).parent / "results" / "real_model_prompts.json"
ANSWER_TAG = "End your reply with 'Answer: ' and the number."


def conversation(design: str, a: int, b: int) -> list[dict]:
    """The ways of asking, each a conversation (a system message replaces SmolLM2's default)."""
    question = {"role": "user", "content": f"What is {a} + {b}?"}
    example = {"role": "user", "content": "What is 3 + 5?"}
    return {
        "number, asked": [{"role": "system", "content": "Reply with only the number."},
                          question],
        "number, one example": [{"role": "system", "content": "Reply with only the number."},
                                example, {"role": "assistant", "content": "8"}, question],
        "Answer: tag, asked": [{"role": "user", "content": f"What is {a} + {b}? {ANSWER_TAG}"}],
        "Answer: tag, one bare example": [{"role": "system", "content": ANSWER_TAG}, example,
                                          {"role": "assistant", "content": "Answer: 8"},
                                          question],
        "Answer: tag, one worked example": [
            {"role": "system", "content": ANSWER_TAG}, example,
            {"role": "assistant", "content": "3 + 5 = 8. Answer: 8"}, question],
        "a + b = c, asked": [{"role": "system",
                              "content": "Reply with the sum in the form 'a + b = c'."},
                             question],
        "a + b = c, one example (sum_form)": [
            {"role": "system", "content": "Reply in the form 'a + b = c'."}, example,
            {"role": "assistant", "content": "3 + 5 = 8"}, question],
    }[design]


def strict(design: str, reply: str, a: int, b: int) -> bool:
    reply = reply.strip()
    if design.startswith("number"):
        return reply == str(a + b)
    if design.startswith("Answer"):
        found = re.search(r"Answer:\s*(-?\d+)$", reply)
        return bool(found) and int(found.group(1)) == a + b
    return reply == f"{a} + {b} = {a + b}"  # sum_form's exact match


DESIGNS = ["number, asked", "number, one example", "Answer: tag, asked",
           "Answer: tag, one bare example", "Answer: tag, one worked example",
           "a + b = c, asked", "a + b = c, one example (sum_form)"]


def main() -> None:
    torch.set_num_threads(2)
    model, tokenizer = load_model_and_tokenizer("smollm2-135m")
    model.eval()
    rng = random.Random(0)
    problems = [(rng.randint(1, 30), rng.randint(1, 30)) for _ in range(64)]
    rows = {}
    for design in DESIGNS:
        start = time.perf_counter()
        texts = [tokenizer.apply_chat_template(conversation(design, a, b), tokenize=False,
                                               add_generation_prompt=True) for a, b in problems]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        width = batch["input_ids"].shape[1]
        with torch.no_grad():
            greedy = model.generate(**batch, max_new_tokens=20, do_sample=False)
            few = tokenizer(texts[:16], return_tensors="pt", padding=True)
            torch.manual_seed(0)
            sampled = model.generate(**few, max_new_tokens=20, do_sample=True, temperature=1.0,
                                     top_k=0, num_return_sequences=8)
        replies = tokenizer.batch_decode(greedy[:, width:], skip_special_tokens=True)
        samples = tokenizer.batch_decode(sampled[:, few["input_ids"].shape[1]:],
                                         skip_special_tokens=True)
        right = [strict(design, r, a, b) for r, (a, b) in zip(replies, problems)]
        anywhere = [str(a + b) in re.findall(r"\d+", r) for r, (a, b) in zip(replies, problems)]
        sample_right = [strict(design, s, *problems[i // 8]) for i, s in enumerate(samples)]
        spread = sum(0 < sum(sample_right[g * 8:(g + 1) * 8]) < 8 for g in range(16))
        rows[design] = {"prompt_tokens": int(batch["attention_mask"].sum(1).float().mean()),
                        "greedy_strict": sum(right) / 64, "greedy_answer_anywhere":
                        sum(anywhere) / 64, "t1_strict": sum(sample_right) / 128,
                        "t1_groups_with_spread": f"{spread}/16",
                        "greedy_examples": replies[:3], "seconds":
                        round(time.perf_counter() - start, 1)}
        print(design, json.dumps(rows[design]), flush=True)
    RESULTS.write_text(json.dumps({"model": "smollm2-135m", "problems": "64 sums, a, b in 1..30",
                                   "designs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
