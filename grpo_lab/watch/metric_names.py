"""The metric names, in one place: every metric the trainers write to `metrics.jsonl` with its
meaning (`METRICS`), and which of TRL's names each one is (`TRL_SYNC_NAMES`, the synchronous
trainer against TRL's GRPOTrainer; `TRL_ASYNC_NAMES`, the asynchronous one against TRL's
AsyncGRPOTrainer; tests/test_metric_names.py checks both against TRL's source).

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


class TRLName(NamedTuple):
    """One row of a mapping from grpo_lab's metric names to TRL's."""

    ours: str | None  # None: grpo_lab does not log it (`*` stands for any name)
    trl: str | None  # None: TRL does not log it
    same: bool  # the same quantity (then the same name; tests/test_metric_names.py checks)
    note: str = ""


EXTREME = ("per-completion extreme of the clipped fraction; TRL's GRPOTrainer averages it "
           "over the logging window's micro-batches")
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
    TRLName("clip_ratio/low_min", "clip_ratio/low_min", True, EXTREME),
    TRLName("clip_ratio/high_max", "clip_ratio/high_max", True, EXTREME),
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
    TRLName("perf/mfu_fwd_bwd", None, False, "and the other `perf/*_tok_s_*`, `batch/*` and "
            "`sample/*_tokens_*` names: TRL AsyncGRPOTrainer's (its GRPOTrainer logs none)"),
]

MFU = ("percent; TRL's FLOP count, over grpo_lab's unpadded tokens; on a CPU the peak is "
       "measured (grpo_lab.watch.flops)")
PASSES = "grpo_lab: times num_iterations (TRL makes one pass)"
ROW = "TRL's row is one process's forward pass: grpo_lab's micro-batch"
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
    TRLName("clip_ratio/low_min", "clip_ratio/low_min", True, "over the step's completions"),
    TRLName("clip_ratio/high_max", "clip_ratio/high_max", True, "over the step's completions"),
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
    TRLName("perf/mfu_fwd_bwd", "perf/mfu_fwd_bwd", True, MFU),
    TRLName("perf/mfu_wall_clock", "perf/mfu_wall_clock", True, MFU),
    TRLName("perf/forwarded_tok_s_fwd_bwd", "perf/forwarded_tok_s_fwd_bwd", True, PASSES),
    TRLName("perf/forwarded_tok_s_wall_clock", "perf/forwarded_tok_s_wall_clock", True, PASSES),
    TRLName("perf/trained_tok_s_wall_clock", "perf/trained_tok_s_wall_clock", True, PASSES),
    TRLName("batch/microbatches_per_step", "batch/microbatches_per_step", True),
    TRLName("batch/forwarded_tokens_per_step", "batch/forwarded_tokens_per_step", True,
            "TRL's prefix-tree rows share a group's prompt, grpo_lab's rows count their padding"),
    TRLName("batch/trained_tokens_per_step", "batch/trained_tokens_per_step", True),
    TRLName("batch/samples_per_step", "batch/samples_per_step", True, "prompts_per_step x G"),
    TRLName("batch/groups_per_step", "batch/groups_per_step", True, "prompts_per_step"),
    TRLName("batch/samples_per_row", "batch/samples_per_row", True, ROW),
    TRLName("batch/row_tokens_mean", "batch/row_tokens_mean", True, ROW + ", padding included"),
    TRLName("batch/row_tokens_max", "batch/row_tokens_max", True, ROW + ", padding included"),
    TRLName("batch/row_fill_frac", "batch/row_fill_frac", True, "with token_budget"),
    TRLName("batch/pad_frac", "batch/pad_frac", True, "TRL's is padding between processes' "
            "rows, stripped before the forward; grpo_lab's is forwarded"),
    TRLName("batch/masked_token_frac", "batch/masked_token_frac", True, "the prompt's share"),
    TRLName(None, "batch/packing_ratio", False, "TRL's prefix-tree sharing (grpo_lab's shared "
            "prompt rows show in `batch/forwarded_tokens_per_step`)"),
    TRLName(None, "batch/row_imbalance", False, "attention cost of the busiest process's row "
            "over the mean; grpo_lab's processes split the groups evenly"),
    TRLName(None, "batch/dropped_oversize_total", False, "grpo_lab raises on a sequence over "
            "token_budget instead of dropping it"),
    TRLName("sample/forwarded_tokens_mean", "sample/forwarded_tokens_mean", True),
    TRLName("sample/forwarded_tokens_max", "sample/forwarded_tokens_max", True),
    TRLName("sample/trained_tokens_mean", "sample/trained_tokens_mean", True),
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
    TRLName(None, "rollout/score_s", False, "TRL scores in a stage of its own after a queue "
            "(`rollout/score_block_s` too); grpo_lab's worker scores each batch as it is made"),
    TRLName(None, "rollout/score_wait_s", False, "seconds a group waited in TRL's scoring queue"),
    TRLName(None, "rollout/score_queue_size", False, "groups in TRL's scoring queue"),
    TRLName(None, "rollout/duration_s", False, "seconds of one conversation (multi-turn, tools); "
            "grpo_lab generates a step's prompts in one call"),
    TRLName("rollout/vllm_retry_total", "rollout/vllm_retry_total", True, "TRL retries on "
            "transport errors, grpo_lab on 502/503/504 answers (a replica went down)"),
    TRLName("sample/rollout_queue_size", "sample/rollout_queue_size", True, "in completions; "
            "grpo_lab reads it once per step, TRL at each pull"),
    TRLName("sample/rollout_queue_maxsize", None, False, "TRL's `queue_maxsize` setting"),
    TRLName("sample/staleness_mean", "sample/staleness_mean", True),
    TRLName("sample/staleness_max", "sample/staleness_max", True),
    TRLName("sample/dropped_stale_total", "sample/dropped_stale_total", True, "in completions; "
            "grpo_lab drops whole groups"),
    TRLName("sample/time_in_queue_s", "sample/time_in_queue_s", True),
]

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
    "completions/max_length": "longest completion of the step, in tokens "
                              "(max_completion_length when any was cut)",
    "completions/clipped_ratio": "fraction of completions cut at max_completion_length (no EOS)",
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
    "clip_ratio/low_min": "the smallest, over the step's completions, fraction of a "
                          "completion's tokens clipped below 1 - epsilon_low",
    "clip_ratio/high_max": "the largest, over the step's completions, fraction of a "
                           "completion's tokens clipped above 1 + epsilon_high: one completion "
                           "whose push the clip mostly stopped",
    "grad_norm": "gradient norm before clipping",
    "eval/accuracy": "greedy accuracy on the held-out set (only on evaluation steps)",
    "perf/step_s": "wall seconds of the step",
    "perf/fwd_bwd_s": "seconds of the step's forward and backward passes, the reference's "
                      "no-grad one (beta > 0) included; the synchronous trainer counts the "
                      "optimizer step in it too, the asynchronous one logs it apart",
    "perf/forwarded_tok_s_fwd_bwd": "batch/forwarded_tokens_per_step x num_iterations over "
                                    "perf/fwd_bwd_s: the forward and backward passes' speed",
    "perf/forwarded_tok_s_wall_clock": "the same tokens over perf/step_s: the whole step, "
                                       "waiting for samples included",
    "perf/trained_tok_s_wall_clock": "batch/trained_tokens_per_step x num_iterations over "
                                     "perf/step_s",
    "perf/mfu_fwd_bwd": "model FLOPs utilisation over perf/fwd_bwd_s, in percent (TRL's "
                        "unit): the model FLOPs of the step's passes (TRL's count: 3 x the "
                        "forward's matmuls and attention scores, over the unpadded tokens; the "
                        "reference's forward when beta > 0) over the peak of the processes' "
                        "devices. A GPU's peak is its published dense bf16 one (unknown GPU: "
                        "not logged), a CPU's a float32 matmul measured once at the trainer's "
                        "threads (grpo_lab.watch.flops). TRL's 3 x assumes full fine-tuning: "
                        "LoRA's backward skips the frozen weights' gradients, so with LoRA the "
                        "work done is up to 1.5 x less than counted",
    "perf/mfu_wall_clock": "the same FLOPs over perf/step_s: the share of the machine's peak "
                           "the whole step turned into training",
    "batch/groups_per_step": "prompt groups trained this step (prompts_per_step; with "
                             "dynamic_sampling, those kept)",
    "batch/samples_per_step": "completions trained this step (groups x G)",
    "batch/trained_tokens_per_step": "completion tokens the loss is taken over this step, every "
                                     "process's",
    "batch/forwarded_tokens_per_step": "input tokens of the step's forward passes (one per "
                                       "micro-batch), every process's, padding included (what "
                                       "the forward computes and token_budget bounds)",
    "batch/samples_per_row": "completions per micro-batch (TRL's row: one process's forward "
                             "pass), mean over the step's",
    "batch/row_tokens_mean": "input tokens of a micro-batch, padding included, mean over the "
                             "step's",
    "batch/row_tokens_max": "input tokens of the step's largest micro-batch",
    "batch/row_fill_frac": "with token_budget: the micro-batches' input tokens over "
                           "token_budget x their number (1 = every pass full)",
    "batch/pad_frac": "fraction of the micro-batches' input tokens that are padding (forwarded: "
                      "they cost FLOPs)",
    "batch/masked_token_frac": "fraction of the completions' own tokens (prompt + completion, "
                               "unpadded) that the loss skips: the prompt",
    "sample/forwarded_tokens_mean": "tokens of a completion with its prompt, unpadded, mean "
                                    "over the step's",
    "sample/forwarded_tokens_max": "the longest prompt + completion of the step, in tokens",
    "sample/trained_tokens_mean": "completion tokens (loss terms) per completion, mean over "
                                  "the step's",
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
    "rollout/vllm_retry_total": "generator calls (generation requests, weight syncs) sent "
                                "again since the last step after a 502/503/504 answer "
                                "(generators over HTTP only)",
    "rollout/inflight_max": "most generation requests in flight at once since the last step "
                        "(generators over HTTP only; a request is a prompt's G completions, "
                        "or one completion with request_shape 'single')",
    "rollout/prefix_cache_queries": "prompt tokens the replicas looked up in their prefix cache "
                                    "since the last step (vLLM's prefix_cache_queries; logged "
                                    "by the pipeline simulator)",
    "rollout/prefix_cache_hits": "of those, tokens found cached, whose prefill was skipped: a "
                                 "prompt's later completions, a group routed back to its replica "
                                 "(vLLM's prefix_cache_hits; logged by the pipeline simulator)",
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
    `python -c "from grpo_lab.watch.metric_names import glossary_markdown as g; print(g(), end='')"
    > docs/metrics.md`)."""
    rows = "".join(f"| `{name}` | {_cell(meaning)} |\n" for name, meaning in METRICS.items())
    return ("# The metrics grpo_lab logs\n\n"
            "Every name the trainers write to `metrics.jsonl`, with its meaning. One source: "
            "`grpo_lab.watch.metric_names.METRICS`. The synchronous trainer's names are those of "
            "TRL's `GRPOTrainer`, the asynchronous trainer's those of TRL's `AsyncGRPOTrainer`, "
            "where TRL logs the same quantity; values are per step.\n\n"
            "| metric | meaning |\n|---|---|\n" + rows
            + "\n## grpo_lab's GRPOTrainer and TRL's GRPOTrainer\n\n"
            "`grpo_lab.watch.metric_names.TRL_SYNC_NAMES` (notebook 03 checks it against both "
            "trainers' logs, tests/test_metric_names.py against TRL's source): where the "
            "quantity differs, grpo_lab's name is not TRL's.\n\n"
            + mapping_markdown(TRL_SYNC_NAMES)
            + "\n## grpo_lab's AsyncGRPOTrainer and TRL's AsyncGRPOTrainer\n\n"
            "`grpo_lab.watch.metric_names.TRL_ASYNC_NAMES`, checked the same way against TRL's "
            "source.\n\n"
            + mapping_markdown(TRL_ASYNC_NAMES))
