"""How much do notebooks 02 and 04's comparisons move with the training seed?

    python benchmarks/seed_spread.py                 # seeds 0, 1, 2 of both notebooks
    python benchmarks/seed_spread.py --seeds 0,1,2,3 --notebooks 04

Notebook 02 compares rank-1 LoRA with full fine-tuning, notebook 04 asynchronous with synchronous
GRPO; each states its comparison from one run (seed 0). This executes each notebook with papermill
once per training seed (the model build stays the same: the default, cached one) and reports each
gain, the comparison the notebook draws, and their spread (min, median, max) over the seeds.
The notebooks' own pass/fail thresholds are relaxed through their parameters so that every seed
records its numbers; the fixed LoRA-vs-full assert of notebook 02 can still fail a run, which is
then reported as such. One process at a time, one torch thread, as the tests run.
Results go to benchmarks/results/seed_spread.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's grpo_lab_course/
from grpo_lab_course.notebooks import find_notebook, run_notebook  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "seed_spread.json"

# Per notebook: the numbers to read back. A seed that misses a goal still counts: `finish`
# records the results before it checks the goals (grpo_lab_course/goals.py), and they are read back.
COMPARISONS = {
    "02": {
        "notebook": "02_grpo_with_lora",
        "read": lambda r: {
            "lora_gain": r["lora_accuracy_after"] - r["lora_accuracy_before"],
            "full_gain": r["full_accuracy_after"] - r["lora_accuracy_before"],
        },
        "compare": ("lora_gain / full_gain", lambda v: v["lora_gain"] / v["full_gain"]
                    if v["full_gain"] > 0 else float("nan")),
    },
    "04": {
        "notebook": "04_rollout_buffer_and_async",
        "read": lambda r: {"sync_gain": r["sync_gain"], "async_gain": r["async_gain"]},
        "compare": ("async_gain - sync_gain", lambda v: v["async_gain"] - v["sync_gain"]),
    },
}


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values),
            "spread": max(values) - min(values)}


def run_comparison(key: str, seeds: list[int], out_dir: Path) -> dict:
    spec = COMPARISONS[key]
    label, compare = spec["compare"]
    rows = []
    for seed in seeds:
        start = time.perf_counter()
        folder = out_dir / f"{key}-{seed}"
        missed = None
        try:
            results = run_notebook(find_notebook(spec["notebook"]), folder,
                                   parameters={"seed": seed}, cell_timeout_s=900)
        except Exception as exc:  # a missed goal (its results were recorded) or a crash
            missed = (str(exc).strip().splitlines() or [repr(exc)])[-1][:300]
            recorded = folder / f"{spec['notebook']}.results.json"
            results = json.loads(recorded.read_text()) if recorded.exists() else None
        if results is None:
            row = {"seed": seed, "error": missed}
        else:
            values = spec["read"](results)
            values[label] = compare(values)
            row = {"seed": seed, **values, "error": None, "missed_goals": missed}
        row["seconds"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        shown = ", ".join(f"{k} {v:+.3f}" for k, v in row.items()
                          if isinstance(v, float) and k != "seconds")
        print(f"  {spec['notebook']} seed {seed}: {shown or row['error']} ({row['seconds']:.0f} s)",
              flush=True)
    done = [r for r in rows if not r["error"]]
    summary = {k: spread([r[k] for r in done]) for k in (done[0] if done else {})
               if k not in ("seed", "error", "seconds", "missed_goals")}
    return {"notebook": spec["notebook"], "comparison": label, "runs": rows, "spread": summary,
            "failed_seeds": [r["seed"] for r in rows if r["error"]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--notebooks", default="02,04", help="comma-separated: 02, 04")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    keys = [k.strip() for k in args.notebooks.split(",")]
    unknown = [k for k in keys if k not in COMPARISONS]
    if unknown:
        parser.error(f"unknown notebooks {unknown}; choose from {sorted(COMPARISONS)}")
    report = {"seeds": seeds, "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="grpo_lab_seeds_") as tmp:
        for key in keys:
            print(f"{COMPARISONS[key]['notebook']}: seeds {seeds}", flush=True)
            report[key] = run_comparison(key, seeds, Path(tmp))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    for key in keys:
        part = report[key]
        s = part["spread"].get(part["comparison"])
        if s:
            print(f"{part['notebook']}: {part['comparison']} min {s['min']:+.3f} median "
                  f"{s['median']:+.3f} max {s['max']:+.3f} over {len(seeds)} seeds")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
