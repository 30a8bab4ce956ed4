"""What prefilling a batch's shared prefix once saves: SmolLM2-135M-Instruct's held-out evaluation
and its GRPO sampling, with and without it, side by side in one process.

    python benchmarks/shared_prefix.py            # 256 held-out problems, 3 rounds
    python benchmarks/shared_prefix.py --rounds 1

Every `sum_form` prompt starts with the same chat-template turns (SmolLM2's system message, the
instruction), so `sample_from_ids` prefills those tokens once for the whole batch
(`common_prefix_length`, `shared_prompt_cache`). "Without" sets the shared length to 0, the code
path before it: each prompt prefilled in full. The rounds alternate (with, without, with, ...) so
that a machine growing slower or faster reaches both alike. Reported: seconds of one evaluation
(256 greedy completions) and of one step's sampling (8 prompts x 8 completions), the speedup of
each, and the accuracy of both, which must agree (greedy decoding, float rounding aside). Two
torch threads, as the course runs. Goal: the evaluation at least 1.5x faster at the same
accuracy. Results: benchmarks/results/shared_prefix.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from grpo_lab.model import generation
from grpo_lab.train.config import GRPOConfig
from grpo_lab.train.trainer import GRPOTrainer

RESULTS = Path(__file__).parent / "results" / "shared_prefix.json"


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--eval-size", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(2)
    config = GRPOConfig(model="smollm2-135m", task="sum_form", difficulty=30, lora_rank=8,
                        prompts_per_step=8, num_generations=8, max_completion_length=14,
                        eval_size=args.eval_size, seed=0, progress=False,
                        output_dir=tempfile.mkdtemp(prefix="shared-prefix-"))
    trainer = GRPOTrainer(config)
    problems = trainer.task.sample_batch(random.Random(0), config.prompts_per_step)
    shared = generation.common_prefix_length
    prompt_ids = generation.encode_prompts(trainer.tokenizer, [p.prompt for p in problems],
                                           **trainer.prompt_format)
    seconds = {"with": {"eval": [], "sample": []}, "without": {"eval": [], "sample": []}}
    accuracy = {}
    for _ in range(args.rounds):
        for mode in ("with", "without"):
            generation.common_prefix_length = shared if mode == "with" else (lambda ids: 0)
            try:
                eval_s, acc = timed(trainer.evaluate)
                torch.manual_seed(0)
                sample_s, _ = timed(lambda: trainer.sample(problems))
            finally:
                generation.common_prefix_length = shared
            seconds[mode]["eval"].append(eval_s)
            seconds[mode]["sample"].append(sample_s)
            accuracy[mode] = acc
            print(f"{mode:>7}: evaluation {eval_s:.1f} s (accuracy {acc:.4f}), "
                  f"sampling {sample_s:.2f} s", flush=True)
    median = {m: {k: statistics.median(v) for k, v in d.items()} for m, d in seconds.items()}
    results = {
        "model": "smollm2-135m", "task": "sum_form", "eval_size": args.eval_size,
        "rounds": args.rounds, "torch_threads": 2,
        "shared_prefix_tokens": shared(prompt_ids),
        "prompt_tokens_mean": statistics.mean(map(len, prompt_ids)),
        "seconds_median": median, "seconds_all": seconds,
        "eval_speedup": median["without"]["eval"] / median["with"]["eval"],
        "sample_speedup": median["without"]["sample"] / median["with"]["sample"],
        "accuracy": accuracy,
        "goal": "evaluation >= 1.5x faster, the same accuracy",
    }
    results["goal_met"] = (results["eval_speedup"] >= 1.5
                           and abs(accuracy["with"] - accuracy["without"]) < 1e-9)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: results[k] for k in ("shared_prefix_tokens", "prompt_tokens_mean",
                                              "seconds_median", "eval_speedup",
                                              "sample_speedup", "accuracy", "goal_met")},
                     indent=1))


if __name__ == "__main__":
    main()
