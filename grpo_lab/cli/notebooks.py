"""Running the course's notebooks: record what a notebook achieved, execute one with papermill.

Each notebook has a `parameters` cell with CPU-sized defaults and a `results_path` parameter;
its last cells assert the outcome and call `record_results(results_path, ...)`, so a test (or
`grpo-lab notebook NAME`) can check values, not just that it ran.

Exercises: a code cell tagged `exercise` whose first line is `# EXERCISE <id>` (`<id>` =
notebook number + "." + k, e.g. `02.1`) holds the learner's stub; the cell after it checks the
answer into `exercises["<id>"]` (True when right, None when not attempted). The solution of each
is `solutions/<notebook stem>/<id>.py`, the whole replacement text of the cell:
`fill_in_solutions` writes a copy of a notebook with them filled in, which the tests (and
`grpo-lab notebook NAME --with-solutions`, for teachers) execute.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK_DIR = REPO_ROOT / "notebooks"
SOLUTIONS_DIR = REPO_ROOT / "solutions"
EXERCISE_TAG = "exercise"
_EXERCISE_LINE = re.compile(r"# EXERCISE (\d\d[a-z]?\.\d+)\s*")

# What each notebook must have recorded: name -> {condition: check on the results dict}.
# Each condition is checked and reported on its own, so a failure names the key that missed.
NOTEBOOK_GOALS = {
    "00_setup_and_tiny_model": {
        "0.15 <= baseline_accuracy <= 0.6": lambda r: 0.15 <= r["baseline_accuracy"] <= 0.6,
        "mixed_groups >= 4": lambda r: r["mixed_groups"] >= 4,
    },
    "01_grpo_from_scratch": {
        "accuracy gain >= 10 points": lambda r: r["accuracy_after"] >= r["accuracy_before"] + 0.10,
        "advantages_match": lambda r: r["advantages_match"],
        "loss_match": lambda r: r["loss_match"],
        "max_ratio_deviation < 1e-3": lambda r: r["max_ratio_deviation"] < 1e-3,
    },
    "01b_grpo_maths": {
        "gradient 0 exactly where the clip binds": lambda r: r["clip_gradient_matches"],
        "k3 unbiased on-policy, biased off-policy (toy, |z| < 4 vs > 4)":
            lambda r: abs(r["toy_on_policy_z"]) < 4 < abs(r["toy_off_policy_z"]),
        "k3 >= 0 on every token (float32 rounding aside)": lambda r: r["k3_min"] > -1e-6,
        "k3 mean = exact KL on the model (|z| < 4)": lambda r: abs(r["k3_vs_exact_z"]) < 4,
        "beta > 0 keeps the policy closer": lambda r: r["kl_with_beta"] < r["kl_without_beta"],
        "aggregation weights = hand derivation": lambda r: r["weights_match"],
        "grpo: short right token weighs 3x, short wrong 2x":
            lambda r: abs(r["grpo_weight_ratio_right"] - 3) < 1e-4
            and abs(r["grpo_weight_ratio_wrong"] - 2) < 1e-4,
        "dapo, dr_grpo: every token alike":
            lambda r: abs(r["dapo_weight_ratio"] - 1) < 1e-5
            and abs(r["dr_grpo_weight_ratio"] - 1) < 1e-5,
        "loss at ratio 1: 0 for grpo, > 0 for dapo":
            lambda r: abs(r["loss_at_ratio_1"]["grpo"]) < 1e-5 < r["loss_at_ratio_1"]["dapo"],
    },
    "02_grpo_with_lora": {
        "LoRA gain >= 10 points":
            lambda r: r["lora_accuracy_after"] >= r["lora_accuracy_before"] + 0.10,
        "LoRA gains at least half of full fine-tuning's gain":
            lambda r: r["lora_accuracy_after"] - r["lora_accuracy_before"]
            >= 0.5 * (r["full_accuracy_after"] - r["lora_accuracy_before"]),
        "adapter < 2 % of the model": lambda r: r["adapter_bytes"] < 0.02 * r["model_bytes"],
        "reloaded adapter scores the same":
            lambda r: r["reloaded_accuracy"] == r["lora_accuracy_after"],
    },
    "03_grpo_with_trl": {
        "grpo_lab gain >= 10 points":
            lambda r: r["grpo_lab_accuracy_after"] >= r["accuracy_before"] + 0.10,
        "TRL gain >= 10 points": lambda r: r["trl_accuracy_after"] >= r["trl_accuracy_before"] + 0.10,
        "same starting accuracy": lambda r: r["trl_accuracy_before"] == r["accuracy_before"],
        "config_mismatches == 0": lambda r: r["config_mismatches"] == 0,
        "metrics_missing == 0": lambda r: r["metrics_missing"] == 0,
        "TRL reward rose": lambda r: r["trl_reward_last"] > r["trl_reward_first"],
        "grpo_lab reward rose": lambda r: r["grpo_lab_reward_last"] > r["grpo_lab_reward_first"],
    },
    "04_rollout_buffer_and_async": {
        "sync_gain > 0": lambda r: r["sync_gain"] > 0,
        "async_gain > 0": lambda r: r["async_gain"] > 0,
        "async gains about as much as sync":
            lambda r: r["async_gain"] >= r["sync_gain"] - r["accuracy_tolerance"],
        "staleness within max_staleness":
            lambda r: r["async_staleness_max"] <= r["max_staleness"],
        "async_staleness_mean > 0": lambda r: r["async_staleness_mean"] > 0,
        # the mean ratio stays near 1 stale or not; TRL's async `kl` (k3 of sampler vs trainer) moves
        "sync: |kl| < 1e-6 (float32, on-policy)": lambda r: r["sync_kl_max"] < 1e-6,
        "async: kl on stale steps > 1e-5 and > 100x sync's, max < 5e-3":
            lambda r: r["async_kl_stale_mean"] > max(1e-5, 100 * r["sync_kl_max"])
            and r["async_kl_max"] < 5e-3,
        "fast producer: trainer-bound": lambda r: r["fast_producer_bottleneck"] == "trainer",
        "drop path: 4 stale groups dropped without admission, none with it":
            lambda r: r["dropped_without_admission"] == 4 and r["dropped_with_admission"] == 0,
        "slow producer: generation-bound":
            lambda r: r["slow_producer_bottleneck"] == "generation",
        "async run: trainer-bound": lambda r: r["async_bottleneck"] == "trainer",
    },
    "05_rollout_server_and_bucket": {
        "adapters_differ": lambda r: r["adapters_differ"],
        "base_ignores_adapters": lambda r: r["base_ignores_adapters"],
        # E_{pi_s}[pi_theta / pi_s] = 1: the mean ratio cannot flag wrong weights; k3 and tails do
        "wrong weights: mean ratio within 0.05 of 1, yet k3 > 1e-3 and a tail off 1 by > 0.1":
            lambda r: abs(r["wrong_weights"]["mean"] - 1) < 0.05
            and r["wrong_weights"]["k3"] > 1e-3 and r["wrong_weights_deviation"] > 0.1,
        "right weights (fp32 stand-in): every token's ratio 1 within 1e-3, |k3| < 1e-6":
            lambda r: r["right_weights_deviation"] < 1e-3 and abs(r["right_weights"]["k3"]) < 1e-6,
        "max_ratio_deviation < 1e-3": lambda r: r["max_ratio_deviation"] < 1e-3,
        "GRPO over HTTP (sync, fp32): logged kl < 1e-6": lambda r: r["max_kl"] < 1e-6,
        "steps >= 1": lambda r: r["steps"] >= 1,
        "a reused adapter name is refused and serves the old weights":
            lambda r: r["reused_name_refused"] and r["reused_name_deviation"] > 0.01,
        "a versioned name serves this version": lambda r: r["versioned_name_deviation"] < 1e-3,
        # Section 4, real vLLM beside the stand-in (met on the stand-in alone where vLLM is missing)
        "real vLLM: the stand-in's API, adapter answers and (fp32) seeded tokens":
            lambda r: r["vllm_missing"] is not None or (
                r["engines_api_match"]
                and r["sampler_mismatch"]["vLLM float32"]["same_tokens"] == 1),
        "real vLLM fp32: max |logp diff| < 1e-3, sequence weights 1 within 1e-3":
            lambda r: r["vllm_missing"] is not None or (
                r["sampler_mismatch"]["vLLM float32"]["max_diff"] < 1e-3
                and r["sampler_mismatch"]["vLLM float32"]["weight_deviation"] < 1e-3),
        "real vLLM bf16: max |logp diff| > 1e-2, sequence weights off 1 by > 1e-2":
            lambda r: r["vllm_missing"] is not None or (
                r["sampler_mismatch"]["vLLM bfloat16"]["max_diff"] > 1e-2
                and r["sampler_mismatch"]["vLLM bfloat16"]["weight_deviation"] > 1e-2),
    },
    "06_proxy_and_kv_routing": {
        "shared_blocks == 1": lambda r: r["shared_blocks"] == 1,
        "walkthrough": lambda r: r["walkthrough"] == ["unmatched", "affinity", "unmatched",
                                                      "affinity", "spill"],
        "replay_unmatched_pct <= 15.5": lambda r: r["replay_unmatched_pct"] <= 15.5,
        "group_affinity == 1": lambda r: r["group_affinity"] == 1.0,
        "batch_in_order": lambda r: r["batch_in_order"],
        "lagged_load_status == 200": lambda r: r["lagged_load_status"] == 200,
        "load_retries >= 1": lambda r: r["load_retries"] >= 1,
        "failed_load_status == 500": lambda r: r["failed_load_status"] == 500,
        "rollbacks == 1": lambda r: r["rollbacks"] == 1,
        "on_part_of_fleet == 0": lambda r: r["on_part_of_fleet"] == 0,
        "affinity hit rate >= round-robin's + 0.05":
            lambda r: r["routing_hit_rate"]["affinity"]
            >= r["routing_hit_rate"]["round-robin"] + 0.05,
        "affinity computes <= 0.75x round-robin's prefill tokens":
            lambda r: r["routing_prefill_tokens"]["affinity"]
            <= 0.75 * r["routing_prefill_tokens"]["round-robin"],
        "base-model replica caught by the ratio, and only it":
            lambda r: r["base_replica_deviation"] > 0.01 and r["right_replica_deviation"] < 1e-3
            and r["suspects"] == ["B"],
    },
    "07_multi_job_async_lora": {
        "accuracy gain >= 10 points": lambda r: r["accuracy_after"] >= r["accuracy_before"] + 0.10,
        "every version published once, no gap (a resume included)":
            lambda r: r["versions_contiguous"] and r["syncs"] == r["version"] + 1
            and r["version"] >= r["steps"],
        "preempted trainer resumed from a checkpoint":
            lambda r: r["killed_at"] is None or (r["resumed_from"] or "").startswith("step-"),
        "every replica routed, and its own /metrics counted prompt tokens":
            lambda r: min(r["routed"]) > 0 and min(r["prompt_tokens"]) > 0,
        "served versions == max_staleness + 1, the same on every replica":
            lambda r: len(r["served"]) == r["max_staleness"] + 1 and r["replicas_hold_served"],
        "bucket versions == max_staleness + 2":
            lambda r: len(r["bucket_versions"]) == r["max_staleness"] + 2,
        # engine-aware: grpo-lab serve's 4-token blocks hold a 7-token prompt, vLLM's 16 do not
        "grpo-lab: affinity share >= 0.5 (the blog's request shape) and prefix-cache hits; "
        "vllm: every request unmatched, no hit":
            lambda r: (r["affinity_share"] >= 0.5 and r["cache_hits"] > 0)
            if r["engine"] == "grpo-lab" else (r["affinity_share"] == 0 and r["cache_hits"] == 0
                                               and r["unmatched"] == sum(r["routed"])),
        "vllm: every version loaded on every replica (their logs), but the sync a kill cut short":
            lambda r: r["engine"] == "grpo-lab" or r["loaded_everywhere"] is True,
        "kl (k3, sampler vs trainer): stale steps > 1e-5, every step < 1e-2":
            lambda r: r["kl_stale_mean"] > 1e-5 and r["kl_max"] < 1e-2,
    },
    "08_reading_the_pipeline": {
        "bottlenecks as expected": lambda r: r["bottlenecks"] == r["expected"] == [
            "trainer", "generation", "generation", "trainer", "trainer"],
        "r2 waits > 20 %": lambda r: r["wait_share"]["r2-token-budget"] > 0.2,
        "r4 held back > 20 %": lambda r: r["held_back_share"]["r4-lift-cap"] > 0.2,
        "r3 in-flight peak == 1": lambda r: r["inflight_peak"]["r3-two-replicas"] == 1,
        "r5 syncs faster than r4":
            lambda r: r["weight_sync_s"]["r5-sync-interval"] < r["weight_sync_s"]["r4-lift-cap"],
        "packing: fewer forward tokens, the same loss and gradient":
            lambda r: r["packing_token_ratio"] < 0.8 and r["packing_loss_diff"] < 1e-5
            and r["packing_grads_equal"],
    },
    "09_your_model_your_data": {
        "accuracy gain >= 5 points": lambda r: r["accuracy_after"] >= r["accuracy_before"] + 0.05,
        "format reward held": lambda r: r["format_late"] >= r["format_early"] - 0.05,
        "sample completions logged": lambda r: r["completions_logged"] >= 1,
        "prompts went through the chat template": lambda r: r["prompt_starts_with_template"],
    },
}


def missed_goals(notebook: str, results: dict) -> list[str]:
    """The goals of NOTEBOOK_GOALS[notebook] that `results` misses (a missing key counts)."""
    missed = []
    for name, check in NOTEBOOK_GOALS[notebook].items():
        try:
            ok = check(results)
        except (KeyError, TypeError):
            ok = False
        if not ok:
            missed.append(name)
    return missed


def record_results(results_path: str | os.PathLike | None, **values) -> dict:
    """Merge `values` into the JSON file at `results_path` (no-op when it is None)."""
    if results_path is None:
        return values
    path = Path(results_path)
    current = json.loads(path.read_text()) if path.exists() else {}
    current.update(values)
    path.write_text(json.dumps(current, indent=2, default=float))
    return current


def notebook_number(path: Path) -> str:
    """`01` of `01_grpo_from_scratch`, `01b` of `01b_grpo_maths` (a letter: a side chapter)."""
    return path.stem.split("_", 1)[0]


def list_notebooks(notebook_dir: Path = NOTEBOOK_DIR) -> list[Path]:
    """The numbered notebooks (`01_...`, `01b_...`), in course order: 01b after 01, before 02."""
    return sorted(p for p in notebook_dir.glob("[0-9][0-9]*_*.ipynb")
                  if re.fullmatch(r"\d\d[a-z]?", notebook_number(p)))


def find_notebook(name: str, notebook_dir: Path = NOTEBOOK_DIR) -> Path:
    """A notebook by number (`"01"`, `"01b"`), stem or file name."""
    for path in list_notebooks(notebook_dir):
        if name in (path.name, path.stem, notebook_number(path)):
            return path
    known = ", ".join(p.stem for p in list_notebooks(notebook_dir)) or "none"
    raise FileNotFoundError(f"no notebook {name!r} in {notebook_dir} (known: {known})")


def exercise_cells(notebook) -> dict[str, int]:
    """`{exercise id: cell index}` of a notebook (an `nbformat` node) in order. Raises ValueError
    for an `exercise` cell whose first line is not `# EXERCISE <id>`, or for a repeated id."""
    found: dict[str, int] = {}
    for index, cell in enumerate(notebook.cells):
        if EXERCISE_TAG not in cell.get("metadata", {}).get("tags", []):
            continue
        first_line = cell.source.split("\n", 1)[0]
        match = _EXERCISE_LINE.fullmatch(first_line)
        if cell.cell_type != "code" or not match:
            raise ValueError(f"cell {index} ({cell.get('id')}) is tagged {EXERCISE_TAG!r} but is "
                             f"not a code cell starting with '# EXERCISE <id>': {first_line!r}")
        if match.group(1) in found:
            raise ValueError(f"exercise {match.group(1)} appears twice (cells "
                             f"{found[match.group(1)]} and {index})")
        found[match.group(1)] = index
    return found


def fill_in_solutions(notebook_path: str | os.PathLike, out_path: str | os.PathLike,
                      solutions_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Write a copy of a notebook whose exercise cells hold their solutions.

    Each `exercise` cell's source becomes `<solutions_dir>/<notebook stem>/<id>.py` (default
    solutions dir: the repository's `solutions/`); ids, tags and cell ids stay. Raises
    FileNotFoundError for an exercise without a solution, ValueError for a solution without an
    exercise (an orphan) or one whose first line does not name its exercise. Returns
    `{id: solution file}`.
    """
    import nbformat

    notebook_path = Path(notebook_path)
    folder = Path(solutions_dir or SOLUTIONS_DIR) / notebook_path.stem
    notebook = nbformat.read(notebook_path, as_version=4)
    cells = exercise_cells(notebook)
    files = {p.stem: p for p in folder.glob("*.py")} if folder.is_dir() else {}
    orphans = sorted(set(files) - set(cells))
    if orphans:
        raise ValueError(f"{folder}: solutions {orphans} match no exercise cell of "
                         f"{notebook_path.name} (its exercises: {sorted(cells) or 'none'})")
    used = {}
    for exercise_id, index in cells.items():
        if exercise_id not in files:
            raise FileNotFoundError(f"exercise {exercise_id} of {notebook_path.name} has no "
                                    f"solution: expected {folder / (exercise_id + '.py')}")
        text = files[exercise_id].read_text()
        if text.split("\n", 1)[0].strip() != f"# EXERCISE {exercise_id}":
            raise ValueError(f"{files[exercise_id]} must start with '# EXERCISE {exercise_id}', "
                             "like the cell it replaces")
        cell = notebook.cells[index]
        cell.source = text.rstrip("\n")
        cell.outputs, cell.execution_count = [], None
        used[exercise_id] = files[exercise_id]
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(notebook, out_path)
    return used


def run_notebook(
    notebook: str | Path,
    output_dir: str | Path | None = None,
    parameters: dict | None = None,
    cell_timeout_s: int = 600,
    with_solutions: bool = False,
) -> dict:
    """Execute a notebook with papermill into `output_dir` (never the source tree).

    `with_solutions`: execute a copy with every exercise's solution filled in
    (`fill_in_solutions`), written to `output_dir` first. Returns the values the notebook
    recorded with `record_results`. Raises papermill's `PapermillExecutionError` (naming the
    failing cell) when a cell or an assert fails.
    """
    import papermill

    source = Path(notebook) if Path(notebook).suffix == ".ipynb" else find_notebook(str(notebook))
    output_dir = Path(output_dir or tempfile.mkdtemp(prefix="grpo_lab_nb_"))
    output_dir.mkdir(parents=True, exist_ok=True)
    results_path = output_dir / f"{source.stem}.results.json"
    results_path.unlink(missing_ok=True)
    executed = source
    if with_solutions:
        executed = output_dir / f"{source.stem}.with-solutions.ipynb"
        fill_in_solutions(source, executed)
    papermill.execute_notebook(
        str(executed),
        str(output_dir / source.name),
        parameters={**(parameters or {}), "results_path": str(results_path)},
        cwd=str(source.parent),
        execution_timeout=cell_timeout_s,
        kernel_name="python3",
        progress_bar=False,
    )
    return json.loads(results_path.read_text()) if results_path.exists() else {}
