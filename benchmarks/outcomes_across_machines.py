"""Do the course's goals hold, with margin, on machines other than this one?

    python benchmarks/outcomes_across_machines.py                  # every variation, seeds 0-2
    python benchmarks/outcomes_across_machines.py --notebooks 01,02 --variations avx2-1t --seeds 0

Every learner starts from the same reference model, but training still diverges in the last bits
across processors, and a slower machine moves every timing-driven number. This runs each
notebook (papermill, its exercises' solutions filled in, as the tests run it) and `grpo-lab demo`
under the variations another machine brings, emulated here:
- the kernel level PyTorch picks (`ATEN_CPU_CAPABILITY=avx2|default`, with MKL capped to match)
  against this machine's own;
- 1 or 2 torch threads;
- a competing busy process on one core (a slower machine);
and at several training seeds (the notebooks' `seed` parameter). For every run it records the
goals missed (grpo_lab_course.goals.NOTEBOOK_GOALS, the tests' checks) and each numeric goal's
relative margin to its threshold (grpo_lab_course.goals.GOAL_MARGINS); then each goal's worst case
over all runs. A worst case under 10 % is flagged: not a lesson yet. Results are merged into
benchmarks/results/outcomes_across_machines.json (a partial run updates just its entries).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's grpo_lab_course/
from grpo_lab_course.goals import goal_margins, missed_goals  # noqa: E402
from grpo_lab_course.notebooks import list_notebooks, notebook_number, run_notebook  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "outcomes_across_machines.json"
VARIATIONS = {
    "native-2t": {"threads": 2},
    "avx2-1t": {"level": "avx2", "threads": 1},
    "default-2t": {"level": "default", "threads": 2},
    "native-1t-busy": {"threads": 1, "busy": True},
}
MKL_LEVEL = {"avx2": "AVX2", "default": "SSE4_2"}
DEMO_MIN_GAIN = 0.20
FLAG_BELOW = 0.10


@contextmanager
def machine(variation: dict):
    """Set the environment the notebooks' kernels and the demo's jobs inherit; start the busy
    process of a slower machine, and stop it afterwards."""
    saved = dict(os.environ)
    os.environ["OMP_NUM_THREADS"] = str(variation["threads"])
    if variation.get("level"):
        os.environ["ATEN_CPU_CAPABILITY"] = variation["level"]
        os.environ["MKL_ENABLE_INSTRUCTIONS"] = MKL_LEVEL[variation["level"]]
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) \
        if variation.get("busy") else None
    try:
        yield
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()
        os.environ.clear()
        os.environ.update(saved)


def run_one_notebook(path: Path, out: Path, seed: int) -> dict:
    start = time.perf_counter()
    try:
        results = run_notebook(path, out, {"seed": seed}, cell_timeout_s=900,
                               with_solutions=True)
        error = None
    except Exception as exc:  # an assert inside the notebook: keep going, record it
        saved = out / f"{path.stem}.results.json"
        results = json.loads(saved.read_text()) if saved.exists() else {}
        error = str(exc).strip().splitlines()[-1][:300] if str(exc).strip() else repr(exc)
    row = {"seconds": round(time.perf_counter() - start, 1),
           "missed": missed_goals(path.stem, results), "error": error,
           "margins": goal_margins(path.stem, results)}
    low = {k: round(v, 3) for k, v in row["margins"].items() if v is not None and v < FLAG_BELOW}
    status = "ok" if not row["missed"] and not error else f"MISSED {row['missed']}"
    print(f"    {path.stem}: {status} ({row['seconds']:.0f} s)"
          f"{' margins under 10 %: ' + str(low) if low else ''}{' ' + error if error else ''}",
          flush=True)
    return row


def run_demo(out: Path, seed: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "grpo_lab.cli", "demo", "--output-dir", str(out),
                           "--seed", str(seed), "--progress", "false"],
                          capture_output=True, text=True, timeout=1800)
    summary = out / "summary.json"
    if proc.returncode or not summary.exists():
        return {"error": f"exit {proc.returncode}: {proc.stderr[-500:]}"}
    s = json.loads(summary.read_text())
    gain = s["accuracy_gain"]
    print(f"    demo: {s['accuracy_before']:.1%} -> {s['accuracy_after']:.1%} ({100 * gain:+.1f})",
          flush=True)
    return {"accuracy_before": s["accuracy_before"], "accuracy_gain": gain,
            "margins": {"demo gain >= 20 points": (gain - DEMO_MIN_GAIN) / DEMO_MIN_GAIN}}


def worst_cases(runs: dict) -> dict:
    """Each goal's worst margin over every run that measured it, and where."""
    worst = {}
    for key, row in runs.items():
        for notebook, margins in row.get("margins", {}).items():
            for goal, margin in margins.items():
                if margin is None:
                    continue
                name = f"{notebook}: {goal}"
                entry = worst.setdefault(name, {"margin": margin, "run": key, "runs": 0})
                entry["runs"] += 1
                if margin <= entry["margin"]:
                    entry.update(margin=margin, run=key)
    for entry in worst.values():
        entry["margin"] = round(entry["margin"], 4)
    return dict(sorted(worst.items(), key=lambda kv: kv[1]["margin"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--variations", default=",".join(VARIATIONS))
    parser.add_argument("--seeds", default="0,1,2", help="training seeds (notebooks, demo)")
    parser.add_argument("--notebooks", default="all", help="e.g. 01,02,07 (default: all)")
    parser.add_argument("--no-demo", action="store_true")
    args = parser.parse_args()
    wanted = None if args.notebooks == "all" else set(args.notebooks.split(","))
    notebooks = [p for p in list_notebooks() if wanted is None or notebook_number(p) in wanted]
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    runs = previous.get("runs", {})
    with tempfile.TemporaryDirectory(prefix="grpo_lab_outcomes_") as scratch:
        os.environ["GRPO_LAB_HOME"] = str(Path(scratch) / "home")  # the reference, copied in
        os.environ["HF_HUB_OFFLINE"] = "1"
        for name in args.variations.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                key = f"{name}/seed-{seed}"
                print(f"{key}:", flush=True)
                row = runs.setdefault(key, {"notebooks": {}, "margins": {}})
                out = Path(scratch) / name / f"seed-{seed}"
                with machine(VARIATIONS[name]):
                    for path in notebooks:
                        nb = run_one_notebook(path, out / "executed", seed)
                        row["notebooks"][path.stem] = {k: nb[k] for k in
                                                       ("seconds", "missed", "error")}
                        row["margins"][path.stem] = nb["margins"]
                    if not args.no_demo:
                        demo = run_demo(out / "demo", seed)
                        row["demo"] = demo
                        row["margins"]["demo"] = demo.get("margins", {})
                row["date"] = time.strftime("%Y-%m-%d")
                RESULTS.write_text(json.dumps({"runs": runs}, indent=2) + "\n")  # as it goes
    worst = worst_cases(runs)
    missed = {k: {nb: r["missed"] or r["error"] for nb, r in row["notebooks"].items()
                  if r["missed"] or r["error"]} for k, row in runs.items()}
    result = {
        "variations": {k: VARIATIONS[k] for k in {key.split("/")[0] for key in runs}},
        "runs_done": sorted(runs),
        "missed": {k: v for k, v in missed.items() if v},
        "worst_margins": worst,
        "under_10_percent": [k for k, v in worst.items() if v["margin"] < FLAG_BELOW],
        "runs": runs,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("runs_done", "missed", "under_10_percent")},
                     indent=2))


if __name__ == "__main__":
    main()
