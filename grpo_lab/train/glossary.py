"""Every metric the trainers write to `metrics.jsonl`, with its meaning (`METRICS`), and which of
TRL's names each one is (`TRL_SYNC_NAMES`, `TRL_ASYNC_NAMES`).

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

from typing import NamedTuple

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
    "clip_ratio/low_mean":
        "fraction of tokens with negative advantage clipped below 1 - epsilon_low",
    "clip_ratio/high_mean":
        "fraction of tokens with positive advantage clipped above 1 + epsilon_high",
    "clip_ratio/region_mean": "fraction of tokens clipped on either side",
    "grad_norm": "gradient norm before clipping",
    "eval/accuracy": "greedy accuracy on the held-out set (only on evaluation steps)",
    "perf/step_s": "wall seconds of the step",
    "perf/fwd_bwd_s": "seconds of the step's forward and backward passes, the reference's "
                      "no-grad one (beta > 0) included; the synchronous trainer counts the "
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


class TRLName(NamedTuple):
    """One row of a mapping from grpo_lab's metric names to TRL's."""

    ours: str | None  # None: grpo_lab does not log it (`*` stands for any name)
    trl: str | None  # None: TRL does not log it
    same: bool  # the same quantity (then the same name; tests/test_metric_names.py checks)
    note: str = ""


ONE_REWARD = "grpo_lab: with several reward functions (with one it is `reward`)"
TRL_SYNC_NAMES: list[TRLName] = [  # grpo_lab's GRPOTrainer and TRL's GRPOTrainer (notebook 03)
    TRLName("reward", "reward", True),
    TRLName("reward_std", "reward_std", True, "the std of the step's rewards"),
    TRLName("frac_reward_zero_std", "frac_reward_zero_std", True),
    TRLName("rewards/<name>/mean", "rewards/<name>/mean", True, ONE_REWARD),
    TRLName("rewards/<name>/std", "rewards/<name>/std", True, ONE_REWARD),
    TRLName("completions/mean_length", "completions/mean_length", True),
    TRLName("completions/min_length", "completions/min_length", True),
    TRLName("completions/max_length", "completions/max_length", True),
    TRLName("completions/clipped_ratio", "completions/clipped_ratio", True),
    TRLName(None, "completions/mean_terminated_length", False, "and `min_`, `max_`: the "
            "completions that ended with EOS"),
    TRLName("entropy", "entropy", True, "from the update's own forward"),
    TRLName("loss", "loss", True, "logged by transformers' Trainer"),
    TRLName("grad_norm", "grad_norm", True, "logged by transformers' Trainer"),
    TRLName("clip_ratio/low_mean", "clip_ratio/low_mean", True),
    TRLName("clip_ratio/high_mean", "clip_ratio/high_mean", True),
    TRLName("clip_ratio/region_mean", "clip_ratio/region_mean", True),
    TRLName(None, "clip_ratio/low_min", False, "and `clip_ratio/high_max`: per-completion "
            "extremes"),
    TRLName("kl", "kl", True, "both only with beta > 0"),
    *(TRLName(name, name, True, "with vllm_importance_sampling_correction") for name in (
        "sampling/sampling_logp_difference/mean", "sampling/sampling_logp_difference/max",
        "sampling/importance_sampling_ratio/min", "sampling/importance_sampling_ratio/mean",
        "sampling/importance_sampling_ratio/max")),
    TRLName("perf/step_s", "step_time", False, "TRL times its `training_step`; grpo_lab the "
            "whole step, sampling included, under TRL AsyncGRPOTrainer's name"),
    TRLName("ratio", None, False, "mean pi_theta / pi_old; TRL logs only the clipped fractions"),
    TRLName("eval/accuracy", None, False, "greedy held-out accuracy; TRL's evaluation loop "
            "reports sampled reward"),
    TRLName(None, "num_tokens", False, "input tokens seen so far"),
    TRLName(None, "learning_rate", False, "logged by transformers' Trainer"),
]

WINDOW = "TRL: the completions generated in the logging window; grpo_lab: the step's"
TRL_ASYNC_NAMES: list[TRLName] = [  # grpo_lab's AsyncGRPOTrainer and TRL's AsyncGRPOTrainer
    TRLName("step", None, False, "transformers' `log_history` carries it"),
    TRLName("reward", "reward", True),
    TRLName("reward_std", "reward_std", True, "the mean within-group std (GRPOTrainer's "
            "`reward_std` is the std over the step)"),
    TRLName("rewards/<name>", "rewards/<name>", True, "GRPOTrainer: `rewards/<name>/mean`"),
    TRLName("rewards/<name>/std", None, False, "GRPOTrainer's name"),
    TRLName("frac_reward_zero_std", None, False, "GRPOTrainer's name"),
    TRLName("completions/mean_length", "completions/mean_length", True, WINDOW),
    TRLName("completions/min_length", "completions/min_length", True, WINDOW),
    TRLName("completions/max_length", "completions/max_length", True, WINDOW),
    TRLName("completions/clipped_ratio", "completions/clipped_ratio", True, WINDOW),
    TRLName("loss", "loss", True, "logged by transformers' Trainer; TRL's is the token mean "
            "(loss_type `dapo`)"),
    TRLName("grad_norm", "grad_norm", True, "logged by transformers' Trainer"),
    TRLName("ratio", "ratio", True),
    TRLName("kl", "kl", True, "k3 of KL(pi_sampler || pi_theta), every step"),
    TRLName("ref_kl", None, False, "beta > 0; TRL's asynchronous trainer has no reference model "
            "(GRPOTrainer logs this as `kl`)"),
    TRLName("entropy", "entropy", True),
    TRLName("clip_ratio/low_mean", "clip_ratio/low_mean", True),
    TRLName("clip_ratio/high_mean", "clip_ratio/high_mean", True),
    TRLName("clip_ratio/region_mean", "clip_ratio/region_mean", True),
    TRLName(None, "clip_ratio/low_min", False, "and `clip_ratio/high_max`: per-completion "
            "extremes"),
    TRLName("sampling/*", None, False, "GRPOTrainer's names (vllm_importance_sampling_correction)"),
    TRLName("eval/accuracy", None, False, "TRL's asynchronous trainer does not evaluate"),
    TRLName("perf/step_s", "perf/step_s", True, "TRL: from one step's end to the next's"),
    TRLName("perf/fwd_bwd_s", "perf/fwd_bwd_s", True, "grpo_lab's also counts the "
            "reference's no-grad pass (beta > 0)"),
    TRLName(None, "perf/fwd_s", False, "the forward part alone"),
    TRLName("perf/optimizer_s", "perf/optimizer_s", True),
    TRLName("perf/generate_s", None, False, "`asynchronous=False` only"),
    TRLName("perf/rollout_wait_s", "perf/rollout_wait_s", True),
    TRLName("perf/weight_sync_s", "perf/weight_sync_s", True, "grpo_lab logs 0 on steps without "
            "a sync, TRL nothing"),
    TRLName(None, "perf/weight_sync_transfer_s", False, "and `_pause_s`, `_barrier_s`: an NCCL "
            "sync's phases"),
    TRLName(None, "perf/mfu_fwd_bwd", False, "model FLOPs utilisation (CUDA)"),
    TRLName("batch/microbatches_per_step", "batch/microbatches_per_step", True),
    TRLName("batch/forwarded_tokens_per_step", "batch/forwarded_tokens_per_step", True,
            "TRL's prefix-tree rows share a group's prompt, grpo_lab's rows count their padding"),
    TRLName(None, "batch/trained_tokens_per_step", False, "completion tokens"),
    TRLName(None, "batch/samples_per_step", False, "prompts_per_step x G here"),
    TRLName(None, "batch/packing_ratio", False, "TRL's prefix-tree packing (`batch/row_*` too)"),
    TRLName("version", None, False, "TRL keeps its `model_version` unlogged"),
    TRLName("time_s", None, False),
    TRLName("rollout/backpressure_total_s", "rollout/backpressure_s", False, "grpo_lab: the "
            "step's blocked seconds, summed; TRL: the mean wait of a blocked put (one per "
            "completion)"),
    TRLName("rollout/version_wait_s", None, False, "grpo_lab's admission rule; TRL drops stale "
            "samples instead"),
    TRLName("rollout/generated_tok_s_busy", "rollout/generated_tok_s", False, "grpo_lab: per "
            "second of the worker's busy time; TRL: per wall second, stalls included"),
    TRLName("rollout/inflight_max", "rollout/inflight", False, "grpo_lab: the most in flight "
            "since the last step; TRL: the mean count as each group is scored"),
    TRLName(None, "rollout/score_s", False, "TRL scores in a stage of its own "
            "(`rollout/score_wait_s`, `rollout/score_block_s` too)"),
    TRLName("sample/rollout_queue_size", "sample/rollout_queue_size", True, "in completions; "
            "grpo_lab reads it once per step, TRL at each pull"),
    TRLName("sample/rollout_queue_maxsize", None, False, "TRL's `queue_maxsize` setting"),
    TRLName("sample/staleness_mean", "sample/staleness_mean", True),
    TRLName("sample/staleness_max", "sample/staleness_max", True),
    TRLName("sample/dropped_stale_total", "sample/dropped_stale_total", True, "in completions; "
            "grpo_lab drops whole groups"),
    TRLName("sample/time_in_queue_s", "sample/time_in_queue_s", True),
]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # `||` in a KL would end the cell


def mapping_markdown(rows: list[TRLName]) -> str:
    """A mapping as a markdown table."""
    def name(n):
        return f"`{n}`" if n else "-"
    return ("| grpo_lab | TRL | same quantity | note |\n|---|---|---|---|\n"
            + "".join(f"| {name(r.ours)} | {name(r.trl)} | {'yes' if r.same else 'no'} | "
                      f"{_cell(r.note)} |\n" for r in rows))


def glossary_markdown() -> str:
    """The table as `docs/metrics.md` (tests/test_trainer.py checks that the file is current:
    `python -c "from grpo_lab.train.glossary import glossary_markdown as g; print(g(), end='')"
    > docs/metrics.md`)."""
    rows = "".join(f"| `{name}` | {_cell(meaning)} |\n" for name, meaning in METRICS.items())
    return ("# The metrics grpo_lab logs\n\n"
            "Every name the trainers write to `metrics.jsonl`, with its meaning. One source: "
            "`grpo_lab.train.glossary.METRICS`. The synchronous trainer's names are those of "
            "TRL's `GRPOTrainer`, the asynchronous trainer's those of TRL's `AsyncGRPOTrainer`, "
            "where TRL logs the same quantity; values are per step.\n\n"
            "| metric | meaning |\n|---|---|\n" + rows
            + "\n## grpo_lab's GRPOTrainer and TRL's GRPOTrainer\n\n"
            "`grpo_lab.train.glossary.TRL_SYNC_NAMES` (notebook 03 checks it against both "
            "trainers' logs, tests/test_metric_names.py against TRL's source): where the "
            "quantity differs, grpo_lab's name is not TRL's.\n\n"
            + mapping_markdown(TRL_SYNC_NAMES)
            + "\n## grpo_lab's AsyncGRPOTrainer and TRL's AsyncGRPOTrainer\n\n"
            "`grpo_lab.train.glossary.TRL_ASYNC_NAMES`, checked the same way against TRL's "
            "source.\n\n"
            + mapping_markdown(TRL_ASYNC_NAMES))

