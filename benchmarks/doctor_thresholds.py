"""The run doctor's thresholds against the course's own runs: healthy ones (the demo's LoRA
settings and notebook 01's full fine-tuning, synchronous; notebook 04's asynchronous trainer) at
three seeds, and runs broken on purpose, one knob each. For every run: what each metric the
doctor reads did (min, median, max over the steps) and what the doctor found.

    .venv/bin/python benchmarks/doctor_thresholds.py      # ~10 minutes on 2 cores

Writes benchmarks/results/doctor_thresholds.json. The healthy runs must find nothing; each broken
run must find its finding (the goal is printed and recorded per run).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from grpo_lab.train.async_config import AsyncGRPOConfig  # noqa: E402
from grpo_lab.train.async_trainer import AsyncGRPOTrainer  # noqa: E402
from grpo_lab.train.config import GRPOConfig  # noqa: E402
from grpo_lab.train.trainer import GRPOTrainer  # noqa: E402
from grpo_lab_course.tails_trainer import FrozenReplica  # noqa: E402

OUT = Path(__file__).parent / "results" / "doctor_thresholds.json"
READ = ("reward", "entropy", "frac_reward_zero_std", "completions/clipped_ratio",
        "clip_ratio/region_mean", "kl", "sample/staleness_mean", "grad_norm")
COMMON = dict(eval_every=0, log_every=10_000, progress=False, eval_size=32,
              log_completions_every=0)


RUNS = {  # name: (trainer, settings, the finding it must raise or None for a healthy run)
    **{f"healthy sync LoRA (demo), seed {s}": ("sync", dict(steps=150, seed=s), None)
       for s in range(3)},
    **{f"healthy sync full (01), seed {s}": ("sync", dict(steps=150, seed=s, use_lora=False,
                                                          learning_rate=1e-4), None)
       for s in range(3)},
    **{f"healthy async LoRA (04), seed {s}": ("async", dict(steps=60, seed=s), None)
       for s in range(3)},
    "cap of 1 token": ("sync", dict(steps=15, max_completion_length=1), "completions_cut"),
    "temperature 1e-3": ("sync", dict(steps=15, temperature=1e-3), "no_learning_signal"),
    "learning rate 1e-12": ("sync", dict(steps=90, learning_rate=1e-12), "reward_flat"),
    "full fine-tuning at 1e-2": ("sync", dict(steps=15, use_lora=False, learning_rate=1e-2),
                                 "entropy_exploded"),
    "2 updates per batch at 1e-3": ("sync", dict(steps=5, use_lora=False, learning_rate=1e-3,
                                                 num_iterations=2), "learning_rate_too_high"),
    "a replica that never loads the adapter": ("frozen", dict(steps=40), "not_from_policy"),
}


def run(kind: str, settings: dict) -> tuple[list[dict], list[str]]:
    if kind == "sync":
        trainer = GRPOTrainer(GRPOConfig(**COMMON, **settings))
    else:
        trainer = AsyncGRPOTrainer(AsyncGRPOConfig(**COMMON, **settings))
        if kind == "frozen":
            trainer.generator = FrozenReplica(trainer.model, trainer.tokenizer)
    records = [r for r in trainer.train() if r.get("step", 0) > 0]
    return records, [f.code for f in trainer.logger.findings]


def main() -> int:
    results, failed = {}, []
    for name, (kind, settings, expected) in RUNS.items():
        start = time.perf_counter()
        records, codes = run(kind, settings)
        spread = {}
        for key in READ:
            values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
            if values:
                spread[key] = {"min": min(values), "median": statistics.median(values),
                               "max": max(values)}
        ok = codes == [] if expected is None else expected in codes
        results[name] = {"settings": settings, "expected": expected, "found": codes, "ok": ok,
                         "metrics": spread, "seconds": round(time.perf_counter() - start, 1)}
        print(f"{'ok  ' if ok else 'MISS'} {name}: found {codes or 'nothing'}"
              f" (expected {expected or 'nothing'})", flush=True)
        if not ok:
            failed.append(name)
    OUT.write_text(json.dumps({"runs": results, "failed": failed}, indent=1))
    print(f"wrote {OUT}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
