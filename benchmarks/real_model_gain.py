"""Does GRPO make a real pretrained model better, on 2 CPU cores, on every machine and seed?

    python benchmarks/real_model_gain.py                          # native-2t, seeds 0-2
    python benchmarks/real_model_gain.py --variations avx2-1t --seeds 0

SmolLM2-135M-Instruct (`--model smollm2-135m`, made offline from its PyPI wheel) on the
`sum_form` task: "What is 28 + 13?" asked for a reply of exactly `28 + 13 = 41`, after one
worked example. The reward, and the held-out score, is strict: the right sum in the asked form and
nothing else. Each run is `grpo-lab train` in a process of its own (LoRA r 8 on every linear
layer, 8 prompts x G = 8, the settings below), under one of the machine variations of
benchmarks/outcomes_across_machines.py (another kernel level, one thread, a busy core; and
`avx2-2t`) and one training seed; it records held-out greedy correctness on 256 problems before
and after, the curve in between, and the time spent training (evaluations excluded) and in all.
Results are merged into benchmarks/results/real_model_gain.json; the goal is +15 points within 10
minutes of training on 2 threads (a 1-thread or busy-core run is judged on its gain alone), and the
worst margin over the runs is reported.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from outcomes_across_machines import VARIATIONS, machine  # noqa: E402

VARIATIONS = {**VARIATIONS, "avx2-2t": {"level": "avx2", "threads": 2}}
"""The course's machine variations, and another kernel level at the 2 threads the time goal is
for (a 1-thread or no-vector run is slower by design: its gain is judged, not its time)."""

RESULTS = Path(__file__).parent / "results" / "real_model_gain.json"
SETTINGS = dict(model="smollm2-135m", task="sum_form", difficulty=30, steps=30,
                prompts_per_step=8, num_generations=8, max_completion_length=14, temperature=1.0,
                learning_rate=5e-4,
                lora_rank=8, eval_size=256, eval_every=15, log_every=5,
                log_completions_every=0, progress="false")
GOAL_GAIN = 0.15
GOAL_TRAIN_S = 600.0


def run_once(out: Path, seed: int, threads: int) -> dict:
    argv = [sys.executable, "-m", "grpo_lab.cli", "train", "--output-dir", str(out),
            "--seed", str(seed), "--num-threads", str(threads)]
    for key, value in SETTINGS.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    start = time.perf_counter()
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=3600)
    wall = time.perf_counter() - start
    metrics = out / "metrics.jsonl"
    if proc.returncode or not metrics.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr[-800:]}"}
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    curve = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    steps = [r for r in rows if "perf/step_s" in r]
    train_s = sum(r["perf/step_s"] for r in steps)
    before, after = curve[0], curve[max(curve)]
    gain = after - before
    return {"accuracy_before": before, "accuracy_after": after, "gain": round(gain, 4),
            "curve": curve, "train_s": round(train_s, 1), "wall_s": round(wall, 1),
            "reward_first_5": round(sum(r["reward"] for r in steps[:5]) / 5, 3),
            "reward_last_5": round(sum(r["reward"] for r in steps[-5:]) / 5, 3),
            "entropy_last": round(steps[-1]["entropy"], 4),
            # per step, for the run doctor's rules (tests/test_doctor.py reads them)
            "reward_by_step": [round(r["reward"], 4) for r in steps],
            "entropy_by_step": [round(r["entropy"], 4) for r in steps],
            "zero_std_by_step": [round(r.get("frac_reward_zero_std", 0), 4) for r in steps],
            "doctor": [f.get("code") for f in _findings(out)],
            "margin": round((gain - GOAL_GAIN) / GOAL_GAIN, 3),
            # the largest child so far: one run at a time, so this run's peak (or an earlier one's)
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024),
            "met": gain >= GOAL_GAIN and (threads != 2 or train_s <= GOAL_TRAIN_S)}


def _findings(out: Path) -> list[dict]:
    path = out / "findings.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variations", default="native-2t")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="change a setting for this run (e.g. learning_rate=5e-4); the "
                        "results record it under a key of its own")
    args = parser.parse_args()
    changed = dict(item.split("=", 1) for item in args.set)
    unknown = set(changed) - set(SETTINGS)
    if unknown:
        parser.error(f"unknown settings {sorted(unknown)} (choose from {sorted(SETTINGS)})")
    base = dict(SETTINGS)
    SETTINGS.update(changed)
    tag = "".join(f"/{k}={v}" for k, v in sorted(changed.items()))
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    runs = previous.get("runs", {})
    with tempfile.TemporaryDirectory(prefix="grpo_lab_real_gain_") as scratch:
        for name in args.variations.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                print(f"{name} seed {seed}", flush=True)
                with machine(VARIATIONS[name]):
                    row = run_once(Path(scratch) / f"{name}-{seed}", seed,
                                   VARIATIONS[name]["threads"])
                row["settings_changed"] = changed
                runs[f"{name}/seed-{seed}{tag}"] = row
                print(f"    {json.dumps(row)[:400]}", flush=True)
    # the goal is judged at the settings above; runs with a setting changed are comparisons
    judged = {k: r for k, r in runs.items() if not r.get("settings_changed")}
    measured = [r for r in judged.values() if "gain" in r]
    summary = {"settings": base, "goal": f"+{GOAL_GAIN:.0%} strict greedy correctness on "
               f"256 held-out problems within {GOAL_TRAIN_S:.0f} s of training",
               "runs": dict(sorted(runs.items())),
               "worst_gain": min((r["gain"] for r in measured), default=None),
               "worst_margin": min((r["margin"] for r in measured), default=None),
               "all_met": all(r.get("met") for r in judged.values())}
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"worst gain {summary['worst_gain']}, worst margin {summary['worst_margin']}, "
          f"all met: {summary['all_met']}")


if __name__ == "__main__":
    main()
