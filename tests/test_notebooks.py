"""Every course notebook, executed with papermill at its CPU defaults; then its recorded values."""

import pytest

from grpo_lab.notebooks import list_notebooks, run_notebook

# What each notebook must have recorded: name -> check on the results dict.
CHECKS = {
    "00_setup_and_tiny_model": lambda r: 0.15 <= r["baseline_accuracy"] <= 0.6
    and r["mixed_groups"] >= 4,
    "01_grpo_from_scratch": lambda r: r["accuracy_after"] >= r["accuracy_before"] + 0.10
    and r["advantages_match"] and r["loss_match"] and r["max_ratio_deviation"] < 1e-3,
    "02_grpo_with_lora": lambda r: r["lora_accuracy_after"] >= r["lora_accuracy_before"] + 0.10
    and r["adapter_bytes"] < 0.02 * r["model_bytes"]
    and r["reloaded_accuracy"] == r["lora_accuracy_after"],
    "03_grpo_with_trl": lambda r: r["grpo_lab_accuracy_after"] >= r["accuracy_before"] + 0.10
    and r["trl_accuracy_after"] >= r["trl_accuracy_before"] + 0.10
    and r["trl_accuracy_before"] == r["accuracy_before"]
    and r["config_mismatches"] == 0 and r["metrics_missing"] == 0
    and r["trl_reward_last"] > r["trl_reward_first"]
    and r["grpo_lab_reward_last"] > r["grpo_lab_reward_first"],
    "04_rollout_buffer_and_async": lambda r: r["sync_gain"] > 0 and r["async_gain"] > 0
    and r["async_gain"] >= r["sync_gain"] - r["accuracy_tolerance"]
    and r["async_staleness_max"] <= r["max_staleness"] and r["async_staleness_mean"] > 0
    and r["fast_producer_bottleneck"] == "trainer"
    and r["slow_producer_bottleneck"] == "generation" and r["async_bottleneck"] == "trainer",
    "05_rollout_server_and_bucket": lambda r: r["adapters_differ"] and r["base_ignores_adapters"]
    and r["wrong_weights_deviation"] > 0.01 and r["right_weights_deviation"] < 1e-3
    and r["max_ratio_deviation"] < 1e-3 and r["steps"] >= 1,
    "06_proxy_and_kv_routing": lambda r: r["shared_blocks"] == 1
    and r["walkthrough"] == ["unmatched", "affinity", "unmatched", "affinity"]
    and r["replay_unmatched_pct"] <= 15.5 and r["group_affinity"] == 1.0 and r["batch_in_order"]
    and r["lagged_load_status"] == 200 and r["load_retries"] >= 1
    and r["failed_load_status"] == 500 and r["rollbacks"] == 1 and r["on_part_of_fleet"] == 0,
    "07_multi_job_async_lora": lambda r: r["accuracy_after"] >= r["accuracy_before"] + 0.10
    and r["syncs"] == r["steps"] + 1 and min(r["routed"]) > 0
    and len(r["served"]) == r["max_staleness"] + 1
    and len(r["bucket_versions"]) == r["max_staleness"] + 2,
    "08_reading_the_pipeline": lambda r: r["bottlenecks"] == r["expected"]
    == ["trainer", "generation", "generation", "trainer", "trainer"]
    and r["wait_share"]["r2-token-budget"] > 0.2 and r["held_back_share"]["r4-lift-cap"] > 0.2
    and r["inflight_peak"]["r3-two-replicas"] == 1
    and r["weight_sync_s"]["r5-sync-interval"] < r["weight_sync_s"]["r4-lift-cap"],
}


def test_every_notebook_has_a_check():
    names = {p.stem for p in list_notebooks()}
    assert names, "no notebooks found"
    assert names <= set(CHECKS), f"notebooks without a results check: {names - set(CHECKS)}"


@pytest.mark.notebook
@pytest.mark.parametrize("notebook", list_notebooks(), ids=lambda p: p.stem)
def test_notebook_runs_and_achieves_its_goal(notebook, tmp_path, tiny_model_dir):
    results = run_notebook(notebook, tmp_path, cell_timeout_s=600)
    assert results, "the notebook recorded no results"
    assert CHECKS[notebook.stem](results), results
