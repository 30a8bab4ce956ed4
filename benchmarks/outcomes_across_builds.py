"""Do the course's asserted outcomes hold for every model the build can produce?

    python benchmarks/outcomes_across_builds.py        # every notebook + demo, 3 builds
    python benchmarks/outcomes_across_builds.py --notebooks 01,02 --no-demo --seeds 1

The tiny model is built on each learner's machine, and its weights depend on the processor's
floating-point kernels: another machine builds another model under the same recipe. A different
build seed stands in for another machine: for each seed this builds the model into a fresh
GRPO_LAB_HOME under the default recipe's cache key (exactly where a notebook looks for it), then
executes the notebooks with papermill and runs `grpo-lab demo` against it, and records every goal
of course.goals.NOTEBOOK_GOALS that a run misses (the same checks the tests apply).
Everything runs one process at a time, with one torch thread per process, as the tests do.
Results go to benchmarks/results/outcomes_across_builds.json and are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's course/
from course.goals import missed_goals  # noqa: E402
from course.notebooks import list_notebooks, notebook_number, run_notebook  # noqa: E402
from grpo_lab.core.tiny_model import TinyModelRecipe, build_tiny_model  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "outcomes_across_builds.json"


def build_as_default(seed: int, home: Path) -> dict:
    """Build with `seed` into `home`'s cache slot of the default recipe."""
    target = home / "models" / TinyModelRecipe().key()
    target.parent.mkdir(parents=True, exist_ok=True)
    info = build_tiny_model(replace(TinyModelRecipe(), seed=seed), target, progress=False,
                            num_threads=os.cpu_count())
    return {k: info[k] for k in ("warmup_steps", "warmup_val_accuracy", "build_seconds")}


def run_one_notebook(path: Path, out: Path) -> dict:
    start = time.perf_counter()
    try:
        results = run_notebook(path, out, cell_timeout_s=900)
        error = None
    except Exception as exc:  # an assert inside the notebook: keep going, record it
        results = json.loads((out / f"{path.stem}.results.json").read_text()) \
            if (out / f"{path.stem}.results.json").exists() else {}
        error = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc)
    missed = missed_goals(path.stem, results)
    row = {"seconds": round(time.perf_counter() - start, 1), "missed": missed, "error": error,
           "results": {k: v for k, v in results.items() if isinstance(v, int | float | str)}}
    print(f"  {path.stem}: {'ok' if not missed and not error else 'MISSED ' + str(missed)} "
          f"({row['seconds']:.0f} s){' ' + error if error else ''}", flush=True)
    return row


def run_demo(out: Path) -> dict:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "grpo_lab.cli", "demo", "--output-dir", str(out),
                           "--progress", "false"], capture_output=True, text=True, timeout=1200)
    summary_path = out / "summary.json"
    if proc.returncode or not summary_path.exists():
        print(proc.stdout[-2000:], proc.stderr[-2000:])
        return {"error": f"exit {proc.returncode}", "seconds": round(time.perf_counter() - start)}
    s = json.loads(summary_path.read_text())
    row = {k: s[k] for k in ("accuracy_before", "accuracy_after", "accuracy_gain", "startup_s",
                             "train_s", "wall_s")}
    print(f"  demo: {s['accuracy_before']:.1%} -> {s['accuracy_after']:.1%} "
          f"({100 * s['accuracy_gain']:+.1f}) start-up {s['startup_s']} s, "
          f"training {s['train_s']} s", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="build seeds (stand-ins for machines)")
    parser.add_argument("--notebooks", default="all", help="e.g. 01,02,07 (default: all)")
    parser.add_argument("--no-demo", action="store_true")
    args = parser.parse_args()
    wanted = None if args.notebooks == "all" else set(args.notebooks.split(","))
    notebooks = [p for p in list_notebooks() if wanted is None or notebook_number(p) in wanted]
    runs = {}
    with tempfile.TemporaryDirectory(prefix="grpo_lab_outcomes_") as scratch:
        for seed in (int(s) for s in args.seeds.split(",")):
            home = Path(scratch) / f"seed-{seed}"
            os.environ["GRPO_LAB_HOME"] = str(home)  # inherited by kernels and the demo's jobs
            row = {"build": build_as_default(seed, home), "notebooks": {}}
            print(f"build seed {seed}: {row['build']}", flush=True)
            for path in notebooks:
                row["notebooks"][path.stem] = run_one_notebook(path, home / "executed")
            if not args.no_demo:
                row["demo"] = run_demo(home / "demo")
            runs[seed] = row
    # Merge into earlier results: a run of some notebooks or seeds updates just those entries.
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    merged = previous.get("runs") or previous.get("latest", {}).get("runs", {})
    for seed, row in runs.items():
        old = merged.get(str(seed), {})
        old.update({k: v for k, v in row.items() if k != "notebooks"})
        old["notebooks"] = {**old.get("notebooks", {}), **row["notebooks"]}
        merged[str(seed)] = old
    all_met = all(not nb["missed"] and not nb["error"]
                  for r in merged.values() for nb in r["notebooks"].values())
    demos = [r["demo"] for r in merged.values() if "accuracy_gain" in r.get("demo", {})]
    result = {"seeds": sorted(merged), "all_notebook_goals_met": all_met,
              "demo_gains": [round(d["accuracy_gain"], 4) for d in demos], "runs": merged}
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2))
    print(json.dumps({"all_notebook_goals_met": all_met, "demo_gains": result["demo_gains"]},
                     indent=2))

if __name__ == "__main__":
    main()
