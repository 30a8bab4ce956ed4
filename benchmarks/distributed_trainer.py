"""Benchmark `grpo-lab train` on 1 process against 2 processes (DDP over gloo) on this CPU.

    python benchmarks/distributed_trainer.py              # 20 steps, twice each, alternating
    python benchmarks/distributed_trainer.py --steps 10 --repeats 1

The same GRPO run (tiny model, LoRA rank 4, 16 prompts x G = 8 per step) as one process, then
under `accelerate launch --multi_gpu --num_processes 2` (torchrun; the trainer asks accelerate for
CPU processes, grpo_lab.train.distributed). Each process has one torch thread. Reported per
setup: wall clock of the whole command (start-up included), and the median per step of
`perf/step_s`, `perf/generate_s` (sampling) and `perf/fwd_bwd_s` (the update), as the main process
logs them; the machine's load average before and after, since other work shares the cores.

What it shows: on 2 cores, 2 processes split the sampling and the update of a step between the
cores, but pay for process start-up, a gradient all-reduce per step and the gathers of each
step's samples and metrics; with a model this small the fixed costs dominate. On GPUs, the
reason to use several is memory (FSDP2 shards weights, gradients and AdamW moments) and
throughput on a large model, where those fixed costs are small beside a step.
Results go to benchmarks/results/distributed_trainer.json and are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results" / "distributed_trainer.json"

RUN = ["--prompts-per-step", "16", "--num-generations", "8", "--eval-size", "64",
       "--eval-every", "0", "--progress", "false", "--log-every", "1000", "--lora-rank", "4",
       "--learning-rate", "2e-3", "--temperature", "0.7", "--log-completions-every", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(processes: int, steps: int, out: Path) -> list[str]:
    train = ["-m", "grpo_lab.cli", "train", "--steps", str(steps), *RUN, "--output-dir", str(out)]
    if processes == 1:
        return [sys.executable, *train]
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(free_port()), *train]


def measure(processes: int, steps: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        load_before = os.getloadavg()[0]
        start = time.perf_counter()
        result = subprocess.run(command(processes, steps, out), capture_output=True, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1",
                                     "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""})
        wall = time.perf_counter() - start
        if result.returncode != 0:
            raise RuntimeError(result.stderr[-3000:])
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps_logged = [r for r in records if r["step"] > 0]
    accuracy = [r["eval/accuracy"] for r in records if "eval/accuracy" in r]

    def median(key: str) -> float:
        return round(statistics.median(r[key] for r in steps_logged), 4)

    return {"processes": processes, "steps": steps, "wall_s": round(wall, 1),
            "step_s_p50": median("perf/step_s"), "generate_s_p50": median("perf/generate_s"),
            "fwd_bwd_s_p50": median("perf/fwd_bwd_s"),
            "accuracy_before": accuracy[0], "accuracy_after": accuracy[-1],
            "load_avg_before": round(load_before, 2),
            "load_avg_after": round(os.getloadavg()[0], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each, alternating 1, 2, 1, 2 (the load of other work drifts)")
    args = parser.parse_args()
    runs = [measure(n, args.steps) for _ in range(args.repeats) for n in (1, 2)]

    def p50(processes: int, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["processes"] == processes)

    result = {
        "machine": f"{os.cpu_count()} CPU cores, one torch thread per process",
        "runs": runs,
        "step_s_p50": {n: p50(n, "step_s_p50") for n in (1, 2)},
        "wall_s_p50": {n: p50(n, "wall_s") for n in (1, 2)},
        "step_time_ratio_2_over_1": round(p50(2, "step_s_p50") / p50(1, "step_s_p50"), 2),
        "wall_ratio_2_over_1": round(p50(2, "wall_s") / p50(1, "wall_s"), 2),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
