"""The simulator's step records under the real trainer's names, and a run's summary.

`step_record` writes what grpo_lab.train.async_trainer logs per step (docs/metrics.md; the
pipeline's names as grpo_lab.watch.async_metrics writes them) from a simulation's state, so the
dashboard, the plots and grpo_lab.watch.diagnose read a simulated run as a real one. The
learning metrics (reward, loss, kl, ...) are left out: the simulator knows times, not rewards.
`summarize` reduces a run (simulated or real) to the figures the blog publishes.
"""

from __future__ import annotations

import statistics


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def step_record(sim, sync_seconds: float) -> dict:
    """The record of the step `sim` (a grpo_lab.plan.simulator.Simulation) just ended."""
    s, costs, c, t = sim.s, sim.costs, sim.c, sim.taken
    G = s.num_generations
    step_s = sim.now - sim.step_start
    samples = t["samples"]
    mbs = [mb for layout in t["layouts"] for mb in layout]
    rows, real = [mb["tokens"] for mb in mbs], [mb["real"] for mb in mbs]
    completions = [n for _, n in samples]
    unpadded = sum(p + n for p, n in samples)
    held_back = c["backpressure"] + c["version_wait"]
    record = {
        "step": sim.step, "version": sim.version, "time_s": sim.now,
        "perf/step_s": step_s, "perf/fwd_bwd_s": t["fwd_bwd"],
        "perf/optimizer_s": costs.optimizer_s,
        "perf/rollout_wait_s": c["wait"], "perf/weight_sync_s": sync_seconds,
        "rollout/backpressure_total_s": c["backpressure"],
        "rollout/version_wait_s": c["version_wait"],
        "rollout/generated_tok_s_busy": c["tokens"] / max(step_s - held_back, 1e-9),
        "rollout/inflight_max": c["inflight_max"],
        # the replicas' prefix cache (vLLM's prefix_cache_queries / _hits, in prompt tokens): a
        # prompt's later completions, and a group routed back to its replica, skip its prefill
        "rollout/prefix_cache_queries": c["cache_queries"],
        "rollout/prefix_cache_hits": c["cache_hits"],
        "sample/rollout_queue_size": sim.queue_seen * G,
        "sample/rollout_queue_maxsize": s.buffer_size * G,
        "sample/dropped_stale_total": c["dropped"],
        "sample/time_in_queue_s": _mean(t["in_queue"]),
        "sample/staleness_mean": _mean(t["staleness"]),
        "sample/staleness_max": max(t["staleness"]),
        "batch/microbatches_per_step": max(len(layout) for layout in t["layouts"]),
        "batch/groups_per_step": len(t["groups"]), "batch/samples_per_step": len(samples),
        "batch/samples_per_row": len(samples) / len(mbs),
        "batch/row_tokens_mean": _mean(rows), "batch/row_tokens_max": max(rows),
        "batch/pad_frac": (sum(rows) - sum(real)) / max(sum(rows), 1),
        "batch/forwarded_tokens_per_step": sum(rows),
        "batch/trained_tokens_per_step": sum(completions),
        "batch/masked_token_frac": (unpadded - sum(completions)) / max(unpadded, 1),
        "sample/forwarded_tokens_mean": unpadded / len(samples),
        "sample/forwarded_tokens_max": max(p + n for p, n in samples),
        "sample/trained_tokens_mean": _mean(completions),
        "completions/mean_length": _mean(completions),
        "completions/min_length": min(completions), "completions/max_length": max(completions),
        "completions/clipped_ratio": _mean(n >= s.max_completion_tokens for n in completions),
        "perf/forwarded_tok_s_fwd_bwd": sum(rows) / t["fwd_bwd"],
        "perf/forwarded_tok_s_wall_clock": sum(rows) / step_s,
        "perf/trained_tok_s_wall_clock": sum(completions) / step_s,
    }
    if s.token_budget:
        record["batch/row_fill_frac"] = sum(rows) / (s.token_budget * len(rows))
    if costs.trainer_peak_flops:
        peak = costs.trainer_peak_flops * costs.trainer_gpus
        record["perf/mfu_fwd_bwd"] = 100 * t["flops"] / t["fwd_bwd"] / peak
        record["perf/mfu_wall_clock"] = 100 * t["flops"] / step_s / peak
    return record


def summarize(records: list[dict], setting=None, *, idle: float = 0.05) -> dict:
    """A run's figures: medians (`_p50`) over its steps, means where the blog gives means, and
    its bottleneck over the last 80 % of the steps (the first fill the pipeline): "trainer" when
    the trainer waits at most `idle` of its step time, else "generation", or "client_cap" when
    the client's in-flight cap (`setting.max_inflight`) was reached in most of those steps."""
    if not records:
        raise ValueError("no records to summarize")
    steady = records[len(records) // 5:]

    def p50(key):
        return statistics.median(r.get(key, 0.0) for r in records)

    def mean(key, rows=steady):
        return _mean(r.get(key, 0.0) for r in rows)

    syncs = [r["perf/weight_sync_s"] for r in records if r.get("perf/weight_sync_s")]
    wall = records[-1].get("time_s") or sum(r["perf/step_s"] for r in records)
    generated = sum(r.get("rollout/generated_tok_s_busy", 0.0) * max(
        r["perf/step_s"] - r.get("rollout/backpressure_total_s", 0.0)
        - r.get("rollout/version_wait_s", 0.0), 0.0) for r in records)
    wait_share = (sum(r.get("perf/rollout_wait_s", 0.0) for r in steady)
                  / max(sum(r["perf/step_s"] for r in steady), 1e-9))
    cap = getattr(setting, "max_inflight", None)
    capped = cap is not None and _mean(r.get("rollout/inflight_max", 0) >= cap
                                       for r in steady) > 0.5
    bottleneck = "trainer" if wait_share <= idle else "client_cap" if capped else "generation"
    out = {
        "steps": len(records),
        "step_s_p50": p50("perf/step_s"), "fwd_bwd_s_p50": p50("perf/fwd_bwd_s"),
        "rollout_wait_s_p50": p50("perf/rollout_wait_s"),
        "rollout_wait_s_mean": mean("perf/rollout_wait_s"),
        "weight_sync_s_p50": statistics.median(syncs) if syncs else 0.0,
        "weight_sync_share": sum(syncs) / max(wall, 1e-9),
        "wall_clock_s": wall,
        "staleness_mean": _mean(r.get("sample/staleness_mean", 0.0) for r in records),
        "queue_size_p50": p50("sample/rollout_queue_size"),
        "queue_size_mean": mean("sample/rollout_queue_size"),
        "queue_maxsize": records[-1].get("sample/rollout_queue_maxsize", 0),
        "backpressure_s_mean": mean("rollout/backpressure_total_s"),
        "version_wait_s_mean": mean("rollout/version_wait_s"),
        "generation_tokens_per_s": generated / max(wall, 1e-9),
        "inflight_mean": mean("rollout/inflight_max"),
        "micro_batches": p50("batch/microbatches_per_step"),
        "samples_per_row": p50("batch/samples_per_row"),
        "row_fill_frac": p50("batch/row_fill_frac"),
        "mfu": p50("perf/mfu_fwd_bwd"),
        "prefix_cache_hit_rate": sum(r.get("rollout/prefix_cache_hits", 0) for r in records)
        / max(sum(r.get("rollout/prefix_cache_queries", 0) for r in records), 1),
        "wait_share": wait_share,
        "bottleneck": bottleneck,
    }
    return out
