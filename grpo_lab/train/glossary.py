"""Every metric the trainers write to `metrics.jsonl`, with its meaning (`METRICS`), and which of
TRL's names each one is (`TRL_ASYNC_NAMES`).

Names follow TRL: the synchronous trainer's those of TRL's GRPOTrainer, the asynchronous
trainer's those of TRL's AsyncGRPOTrainer, where TRL logs the same quantity; a quantity TRL
does not log, or logs differently, has a name TRL does not use. One meaning per name, except
where TRL's two trainers give one name two meanings (`kl`, `reward_std`): there each of
grpo_lab's trainers means what its TRL counterpart means, and the entry says which is which.

Values are per step. Other counters have tables of their own where they are served: the
buffer's `stats()` (grpo_lab.rollout.buffer, cumulative since the buffer was made, such as
`rollout/backpressure_cumulative_s`), the router's and the proxy's `/proxy/stats`
(grpo_lab.proxy.router, grpo_lab.proxy.app).
"""

from __future__ import annotations

METRICS: dict[str, str] = {
    # --- both trainers ---
    "step": "optimizer steps done so far (1 after the first step)",
    "reward": "mean reward of the step's completions",
    "reward_std": "synchronous trainer (TRL GRPOTrainer's): standard deviation of the step's "
                  "rewards; asynchronous trainer (TRL AsyncGRPOTrainer's): the mean over the "
                  "step's completions of their group's reward standard deviation (population "
                  "std), 0 for a group with no learning signal",
    "frac_reward_zero_std": "fraction of groups whose G rewards are all equal (no learning signal)",
    "rewards/<name>/mean": "synchronous trainer: mean score of one reward function (its name in "
                           "`reward`) before weighting",
    "rewards/<name>": "asynchronous trainer: the same mean, under TRL AsyncGRPOTrainer's name",
    "rewards/<name>/std": "standard deviation of that reward function's scores",
    "completions/mean_length": "mean completion length in tokens",
    "completions/min_length": "shortest completion of the step, in tokens",
    "completions/max_length": "longest completion of the step, in tokens (max_new_tokens when "
                              "any was cut)",
    "completions/clipped_ratio": "fraction of completions cut at max_new_tokens (no EOS)",
    "loss": "the GRPO objective of the last update; not a progress signal (watch `reward`). At "
            "ratio 1 it is 0 only for loss_type `grpo` with beta = 0 (the advantages sum to 0); "
            "`dapo` and `dr_grpo` give minus the within-group covariance of length and advantage "
            "(scaled), and beta > 0 adds beta x the reference KL",
    "ratio": "mean pi_theta / pi_old over completion tokens (1 at the first update of a batch). "
             "Not an alarm: when pi_old is the sampler's, E_sampler[pi_theta / pi_sampler] = 1 "
             "whatever the sampler, so a stale or wrong-weights sampler leaves the mean near 1; "
             "watch `kl` and the per-token tails instead",
    "kl": "synchronous trainer (TRL GRPOTrainer's), only with beta > 0: mean k3 estimate of "
          "KL(pi_theta || pi_ref) over completion tokens. Asynchronous trainer (TRL "
          "AsyncGRPOTrainer's), every step: the k3 estimate of KL(pi_sampler || pi_theta) on the "
          "sampled tokens, what a wrong or stale sampler moves while the mean `ratio` stays near "
          "1 (about 1e-9 on-policy in float32, 1e-4 at staleness 1 in notebook 04, 2e-4 from a "
          "bf16 sampler alone)",
    "ref_kl": "asynchronous trainer with beta > 0: mean k3 estimate of KL(pi_theta || pi_ref) "
              "over completion tokens (what the synchronous trainer logs as `kl`)",
    "sampling/sampling_logp_difference/mean": "mean |log pi_old - log pi_sampler| over completion "
          "tokens: how far the sampler's logprobs are from the trainer's (TRL's name)",
    "sampling/sampling_logp_difference/max": "the largest such difference",
    "sampling/importance_sampling_ratio/min": "smallest importance weight pi_old / pi_sampler "
          "after truncation or masking (vllm_importance_sampling_mode), per token or sequence",
    "sampling/importance_sampling_ratio/mean": "mean of those weights",
    "sampling/importance_sampling_ratio/max": "largest of those weights",
    "entropy": "mean entropy (nats) of the policy's next-token distribution at the sampling "
               "temperature over completion tokens, from the update's forward pass (TRL's). "
               "Falling towards 0 is entropy collapse: the G completions of a group become the "
               "same and stop teaching anything",
    "clip_ratio/low_mean": "fraction of tokens with negative advantage clipped below 1 - epsilon_low",
    "clip_ratio/high_mean": "fraction of tokens with positive advantage clipped above 1 + epsilon_high",
    "clip_ratio/region_mean": "fraction of tokens clipped on either side",
    "grad_norm": "gradient norm before clipping",
    "eval/accuracy": "greedy accuracy on the held-out set (only on evaluation steps)",
    "perf/step_s": "wall seconds of the step",
    "perf/fwd_bwd_s": "seconds of the step's forward and backward passes, the no-grad ones "
                      "(pi_old, the reference) included; the synchronous trainer counts the "
                      "optimizer step in it too, the asynchronous one logs it apart",
    # --- synchronous trainer only ---
    "perf/generate_s": "seconds spent sampling the step's completions (sync trainer)",
    "dynamic_sampling/rounds": "with dynamic_sampling: rounds of generation this step (1 = no "
                               "extra prompts were needed)",
    "dynamic_sampling/generated_groups": "with dynamic_sampling: groups sampled this step, every "
                                         "round; more than prompts_per_step is its extra cost",
    "dynamic_sampling/zero_std_groups": "with dynamic_sampling: of those, groups whose G rewards "
                                        "were all equal",
    "dynamic_sampling/dropped_groups": "with dynamic_sampling: zero-signal groups left out of the "
                                       "batch (the rest filled a batch the round cap left short)",
    # --- asynchronous trainer (and `grpo-lab train-async`) only ---
    "version": "the trainer's policy version after the step",
    "time_s": "seconds since training started (after the initial evaluation)",
    "perf/optimizer_s": "seconds of the optimizer step(s): gradient clipping and AdamW",
    "batch/microbatches_per_step": "forward-backward passes (token-budget micro-batches) each "
                                   "trainer process made per optimizer step",
    "batch/forwarded_tokens_per_step": "input tokens of those passes, every process's, padding "
                                       "included (what the forward computes and token_budget "
                                       "bounds)",
    "perf/rollout_wait_s": "seconds the trainer waited for samples this step (sync mode: "
                           "the generation time)",
    "perf/weight_sync_s": "seconds to publish the weights this step (0 on steps without a sync)",
    "rollout/backpressure_total_s": "seconds the worker was blocked on a full buffer since the "
                                    "last step, summed",
    "rollout/version_wait_s": "seconds the worker waited for a newer policy since the last step "
                              "(the staleness admission rule)",
    "rollout/generated_tok_s_busy": "completion tokens per second of the worker's busy time "
                                    "(generating and scoring) since the last step; the last "
                                    "value when it finished nothing since",
    "rollout/inflight_max": "most generation requests in flight at once since the last step "
                        "(generators over HTTP only; a request is a prompt's G completions, "
                        "or one completion with request_shape 'single')",
    "sample/rollout_queue_size": "completions in the buffer (G per group) when the trainer came "
                                 "for its batch",
    "sample/rollout_queue_maxsize": "the buffer's bound in completions (buffer_size x G)",
    "sample/time_in_queue_s": "mean seconds this step's groups waited in the buffer",
    "sample/staleness_mean": "mean version lag of this step's samples",
    "sample/staleness_max": "largest version lag of this step's samples",
    "sample/dropped_stale_total": "completions dropped for staleness since the last step "
                                  "(whole groups of G)",
}


def glossary_name(name: str) -> str:
    """`rewards/math_answer/mean` -> `rewards/<name>/mean`, `rewards/math_answer` ->
    `rewards/<name>`: the glossary's row for a metric."""
    parts = name.split("/")
    if len(parts) in (2, 3) and parts[0] == "rewards":
        return "/".join(["rewards", "<name>", *parts[2:]])
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

