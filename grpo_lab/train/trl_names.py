"""Which of TRL's metric names each of grpo_lab's is: `TRL_SYNC_NAMES` (the synchronous trainer
and TRL's GRPOTrainer), `TRL_ASYNC_NAMES` (the asynchronous trainer and TRL's
AsyncGRPOTrainer). Where the quantity is the same, the name is TRL's (tests/test_metric_names.py
checks both against TRL's source); the meanings are grpo_lab.train.glossary.METRICS.
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
       "measured (grpo_lab.core.flops)")
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
