"""Every metric the trainers write to `metrics.jsonl`, with its meaning: one table, one meaning
per name. Names follow TRL's GRPOTrainer and AsyncGRPOTrainer where TRL logs the same thing.

Values are per step unless the meaning says "cumulative". Other counters have tables of their
own where they are served: the buffer's `stats()` (grpo_lab.rollout.buffer, cumulative totals
such as `rollout/backpressure_total_s`), the router's and the proxy's `/proxy/stats`
(grpo_lab.proxy.router, grpo_lab.proxy.app).
"""

from __future__ import annotations

METRICS: dict[str, str] = {
    # --- both trainers ---
    "step": "optimizer steps done so far (1 after the first step)",
    "reward": "mean reward of the step's completions",
    "reward_std": "standard deviation of those rewards",
    "frac_reward_zero_std": "fraction of groups whose G rewards are all equal (no learning signal)",
    "rewards/<name>/mean": "mean score of one reward function (its name in `reward`) before "
                           "weighting",
    "rewards/<name>/std": "standard deviation of that reward function's scores",
    "completions/mean_length": "mean completion length in tokens",
    "completions/clipped_ratio": "fraction of completions cut at max_new_tokens (no EOS)",
    "loss": "the GRPO objective of the last update; not a progress signal (watch `reward`). At "
            "ratio 1 it is 0 only for loss_type `grpo` with beta = 0 (the advantages sum to 0); "
            "`dapo` and `dr_grpo` give minus the within-group covariance of length and advantage "
            "(scaled), and beta > 0 adds beta x the reference KL",
    "ratio": "mean pi_theta / pi_old over completion tokens (1 at the first update of a batch). "
             "Not an alarm: when pi_old is the sampler's, E_sampler[pi_theta / pi_sampler] = 1 "
             "whatever the sampler, so a stale or wrong-weights sampler leaves the mean near 1; "
             "watch `kl` and the per-token tails instead",
    "kl": "with beta > 0: mean k3 estimate of KL(pi_theta || pi_ref) over tokens; in the "
          "asynchronous trainer with beta = 0, as TRL's AsyncGRPOTrainer logs it: the k3 estimate "
          "of KL(pi_sampler || pi_theta) on the sampled tokens, what a wrong or stale sampler "
          "moves while the mean `ratio` stays near 1 (about 1e-9 on-policy in float32, 1e-4 at "
          "staleness 1 in notebook 04, 2e-4 from a bf16 sampler alone)",
    "sampling/sampling_logp_difference/mean": "mean |log pi_old - log pi_sampler| over completion "
          "tokens: how far the sampler's logprobs are from the trainer's (TRL's name)",
    "sampling/sampling_logp_difference/max": "the largest such difference",
    "sampling/importance_sampling_ratio/min": "smallest importance weight pi_old / pi_sampler "
          "after truncation or masking (vllm_importance_sampling_mode), per token or sequence",
    "sampling/importance_sampling_ratio/mean": "mean of those weights",
    "sampling/importance_sampling_ratio/max": "largest of those weights",
    "clip_ratio/low_mean": "fraction of tokens with negative advantage clipped below 1 - epsilon_low",
    "clip_ratio/high_mean": "fraction of tokens with positive advantage clipped above 1 + epsilon_high",
    "clip_ratio/region_mean": "fraction of tokens clipped on either side",
    "grad_norm": "gradient norm before clipping",
    "eval/accuracy": "greedy accuracy on the held-out set (only on evaluation steps)",
    "perf/step_s": "wall seconds of the step",
    "perf/fwd_bwd_s": "seconds of the forward, backward and optimizer part of the step",
    # --- synchronous trainer only ---
    "perf/generate_s": "seconds spent sampling the step's completions (sync trainer)",
    # --- asynchronous trainer (and `grpo-lab train-async`) only ---
    "version": "the trainer's policy version after the step",
    "time_s": "seconds since training started (after the initial evaluation)",
    "perf/micro_batches": "forward passes the step took (token-budget micro-batches)",
    "perf/fwd_tokens": "input tokens of those forward passes (prompt + completion, no padding)",
    "perf/rollout_wait_s": "seconds the trainer waited for samples this step (sync mode: "
                           "the generation time)",
    "perf/weight_sync_s": "seconds to publish the weights this step (0 on steps without a sync)",
    "rollout/backpressure_s": "seconds the worker was blocked on a full buffer since the last step",
    "rollout/version_wait_s": "seconds the worker waited for a newer policy since the last step "
                              "(the staleness admission rule)",
    "rollout/generated_tok_s": "completion tokens per second of the worker's generation time",
    "rollout/inflight": "most generation requests in flight at once since the last step "
                        "(generators over HTTP only; a request is a prompt's G completions, "
                        "or one completion with request_shape 'single')",
    "sample/rollout_queue_size": "groups in the buffer when the trainer came for its batch",
    "sample/rollout_queue_maxsize": "the buffer's bound",
    "sample/staleness_mean": "mean version lag of this step's samples",
    "sample/staleness_max": "largest version lag of this step's samples",
    "sample/dropped_stale": "groups dropped for staleness, cumulative",
}


def glossary_name(name: str) -> str:
    """`rewards/math_answer/mean` -> `rewards/<name>/mean`: the glossary's row for a metric."""
    parts = name.split("/")
    if len(parts) == 3 and parts[0] == "rewards":
        return f"rewards/<name>/{parts[2]}"
    return name


def unknown_metrics(record: dict) -> list[str]:
    """Names in a metrics record that the glossary does not explain."""
    return sorted(name for name in record if glossary_name(name) not in METRICS)


def glossary_markdown() -> str:
    """The table as `docs/metrics.md` (tests/test_trainer.py checks that the file is current:
    `python -c "from grpo_lab.train.glossary import glossary_markdown as g; print(g(), end='')"
    > docs/metrics.md`)."""
    rows = "".join(f"| `{name}` | {meaning} |\n" for name, meaning in METRICS.items())
    return ("# The metrics grpo_lab logs\n\n"
            "Every name the trainers write to `metrics.jsonl`, with its meaning. One source: "
            "`grpo_lab.train.glossary.METRICS`. Names follow TRL's `GRPOTrainer` and "
            "`AsyncGRPOTrainer` where TRL logs the same thing; values are per step unless the "
            "meaning says cumulative.\n\n| metric | meaning |\n|---|---|\n" + rows)

