"""One model for everyone: the shipped reference models against a build on each processor.

    python benchmarks/reference_models.py                 # native, avx2, default; 1 and 2 threads
    python benchmarks/reference_models.py --no-builds     # only the reference's greedy accuracy

A build of the same recipe on another processor is another model: float32 sums in another order
change the warm-up's last bits, its stopping rule fires at another step, and the accuracy the
course starts from moves (29.3 %, 35.2 % and 25.4 % were seen on three machines). PyTorch's kernel
level stands in for the processor (ATEN_CPU_CAPABILITY, with MKL_ENABLE_INSTRUCTIONS), with 1 or
2 threads. For each variation, in a process of its own, this measures
- the reference tiny model's greedy accuracy on the 512 held-out problems (what notebook 00 and
  `grpo-lab demo` print before training);
- with builds: the tiny model built from the default recipe there, its warm-up steps and accuracy.
Results go to benchmarks/results/reference_models.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "reference_models.json"
VARIATIONS = [("native", 2), ("native", 1), ("avx2", 2), ("avx2", 1), ("default", 2),
              ("default", 1)]
MKL_LEVEL = {"avx2": "AVX2", "default": "SSE4_2"}

MEASURE = r"""
import json, sys, tempfile, torch
from grpo_lab.model.evaluation import greedy_accuracy
from grpo_lab.model.models import load_model_and_tokenizer
from grpo_lab.data.tasks import make_task
from grpo_lab.model.tiny_model import TinyModelRecipe, build_tiny_model, tiny_model_path
build = sys.argv[1] == "build"
task = make_task("addition", eval_size=512)
model, tokenizer = load_model_and_tokenizer(tiny_model_path(progress=False))
row = {"cpu_capability": torch.backends.cpu.get_cpu_capability(),
       "threads": torch.get_num_threads(),
       "reference_tiny_accuracy": greedy_accuracy(model, tokenizer, task.eval_set(),
                                                  max_new_tokens=task.max_answer_chars + 2)}
if build:
    with tempfile.TemporaryDirectory() as out:
        info = build_tiny_model(TinyModelRecipe(), out, progress=False)
        built, _ = load_model_and_tokenizer(out)
        row["built_tiny_accuracy"] = greedy_accuracy(built, tokenizer, task.eval_set(),
                                                     max_new_tokens=task.max_answer_chars + 2)
        row["built_warmup_steps"] = info["warmup_steps"]
        row["built_seconds"] = info["build_seconds"]
print("RESULT " + json.dumps(row))
"""


def measure(level: str, threads: int, build: bool) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    if level != "native":
        env.update(ATEN_CPU_CAPABILITY=level, MKL_ENABLE_INSTRUCTIONS=MKL_LEVEL[level])
    with tempfile.TemporaryDirectory(prefix="grpo_lab_reference_") as home:
        env["GRPO_LAB_HOME"] = home  # an empty cache: the reference is copied in, as for a learner
        out = subprocess.run([sys.executable, "-c", MEASURE, "build" if build else "load"],
                             env=env, capture_output=True, text=True, timeout=1800)
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{level}/{threads}: {out.stderr[-2000:]}")
    return {"level": level, **json.loads(lines[-1][len("RESULT "):])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-builds", action="store_true")
    args = parser.parse_args()
    rows = []
    for level, threads in VARIATIONS:
        row = measure(level, threads, build=not args.no_builds)
        rows.append(row)
        print(json.dumps(row), flush=True)
    reference = {r["reference_tiny_accuracy"] for r in rows}
    built = [r["built_tiny_accuracy"] for r in rows if "built_tiny_accuracy" in r]
    result = {
        "variations": rows,
        "reference_accuracy_same_everywhere": len(reference) == 1,
        "reference_tiny_accuracy": sorted(reference),
        "built_tiny_accuracy_range": [min(built), max(built)] if built else None,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "variations"}, indent=2))


if __name__ == "__main__":
    main()
