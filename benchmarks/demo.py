"""Benchmark the main job, `grpo-lab demo`, as a user runs it: three seeds, its three targets.

    python benchmarks/demo.py                 # ~4 minutes on 2 cores (the model is built first)
    python benchmarks/demo.py --seeds 0       # one run

Each run is the command `make demo` runs (`grpo-lab demo`: two replicas, the proxy and the trainer
as local processes), with `--seed` changed only (prompt sampling, generation, LoRA init), one run
at a time. The tiny model is built (or found) before the first run, so start-up is measured the
way the target reads: once the model exists. Recorded per run: greedy accuracy before and after,
start-up seconds (every job healthy), training seconds (the trainer's own clock), wall
seconds and the load average before and after; then the median gain and times against the
demo's targets (grpo_lab.cli.multi_job: +20 points, training <= 60 s, start-up <= 20 s on 2
cores), and issue 26's goal: training <= 45 s at the same gain. The demo runs four processes
on the 2 cores, so other processes' load shows directly in its times: compare runs of similar
load.
Results go to benchmarks/results/demo.json and are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from grpo_lab.cli.multi_job import DEMO_TARGETS  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "demo.json"
MIN_GAIN = 0.20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2")
    args = parser.parse_args()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "grpo_lab.cli", "build-model", "--source", "reference"],
                   check=True, capture_output=True)
    build_s = time.perf_counter() - start
    runs = []
    with tempfile.TemporaryDirectory(prefix="grpo_lab_demo_bench_") as scratch:
        for seed in (int(s) for s in args.seeds.split(",")):
            out = Path(scratch) / f"seed-{seed}"
            load = [round(x, 2) for x in os.getloadavg()]
            begin = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "grpo_lab.cli", "demo",
                                   "--seed", str(seed), "--output-dir", str(out),
                                   "--progress", "false"],
                                  capture_output=True, text=True, timeout=1200)
            if proc.returncode:
                raise SystemExit(f"demo seed {seed} failed:\n"
                                 f"{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
            s = json.loads((out / "summary.json").read_text())
            row = {"seed": seed, **{k: s[k] for k in ("accuracy_before", "accuracy_after",
                                                      "accuracy_gain", "startup_s", "train_s",
                                                      "wall_s", "steps")},
                   "command_s": round(time.perf_counter() - begin, 1), "loadavg_before": load,
                   "loadavg_after": [round(x, 2) for x in os.getloadavg()]}
            print(json.dumps(row), flush=True)
            runs.append(row)
    median = {k: statistics.median(r[k] for r in runs)
              for k in ("accuracy_gain", "startup_s", "train_s", "wall_s")}
    result = {
        "runs": runs, "median": median, "model_build_or_lookup_s": round(build_s, 1),
        "targets": {"accuracy_gain": MIN_GAIN, **DEMO_TARGETS},
        "met": {"accuracy_gain": median["accuracy_gain"] >= MIN_GAIN,
                "train_s": median["train_s"] <= DEMO_TARGETS["train_s"],
                "startup_s": median["startup_s"] <= DEMO_TARGETS["startup_s"]},
        # Issue 26's goal, tighter than the demo's own 60 s: <= 45 s median at the same gain.
        "issue_26_goal": {"train_s <= 45 at accuracy_gain >= 0.20": median["train_s"] <= 45.0
                          and median["accuracy_gain"] >= MIN_GAIN},
        "cores": os.cpu_count(),
    }
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps({"median": median, "met": result["met"],
                      "issue_26_goal": result["issue_26_goal"]}, indent=2))


if __name__ == "__main__":
    main()
