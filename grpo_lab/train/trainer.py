"""Synchronous GRPO in one process: generate, score, compute advantages, update, repeat.

    Stage 1  sample G completions for each of `prompts_per_step` prompts, keeping their logprobs
    Stage 2  score every completion with the reward function
    Stage 3  turn rewards into group-relative advantages
    Stage 4  `num_iterations` clipped-surrogate updates on that batch

Full fine-tuning or LoRA, any causal LM, one process or several under `accelerate launch`
(docs/internals.md, "The trainer"; DeepSeekMath, Algorithm 1).
"""

from __future__ import annotations

import copy
import json
import random
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..algo.shared_prompt import supports_shared_prompt
from ..bucket.checkpoint import Checkpoints, full_state
from ..data.completions import Completions
from ..data.prompts import render_prompt
from ..data.reward_set import RewardSet
from ..data.tasks import Problem
from ..model.evaluation import greedy_answers
from ..model.models import MADE_MODELS, load_model_and_tokenizer, model_folder, tokenizer_of
from ..rollout.groups import SampledGroups
from ..util.devices import resolve_device, resolve_dtype
from ..watch.doctor import chat_template_finding, make_doctor
from ..watch.flops import peak_flops
from ..watch.metrics import (
    CompletionLog,
    MetricsLogger,
    format_step,
    read_metrics,
    set_aside_earlier_run,
)
from ..watch.reporters import make_reporters
from ..watch.step_metrics import throughput_metrics
from . import grpo_step
from .config import GRPOConfig, config_from_trl_arguments
from .distributed import Processes
from .grpo_step import sample_with_signal
from .rollout_batch import (
    RolloutBatch,
    gather_samples,
    rollout_metrics,
)

CAPPED_WARNING = 0.5
"""The share of a step's completions cut at `max_completion_length` from which the trainer warns."""


# ------------------------------------------------------------ the policy the trainer starts from
# The policy the trainer starts from: which model `config.model` names, and how it is prepared
# for training (LoRA on every linear layer, or full fine-tuning; activation checkpointing).


def enable_activation_checkpointing(model) -> None:
    """Recompute each layer's activations in the backward pass (transformers' "gradient
    checkpointing", renamed activation checkpointing in transformers 5); non-reentrant, so it
    works with a frozen base under a LoRA adapter."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:  # transformers 4
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def resolve_model_path(config: GRPOConfig):
    """A model as transformers loads it: grpo_lab's own by folder (grpo_lab.model.models), made
    first if needed; others as given."""
    folder = model_folder(config.model, task=config.task, difficulty=config.difficulty,
                          progress=config.progress)
    return Path(folder) if config.model in MADE_MODELS else config.model


def prepare_policy(model, config: GRPOConfig):
    """The model as the trainer trains it: in train mode, with activation checkpointing if asked,
    and wrapped in a rank-`lora_rank` LoRA adapter on every linear layer unless full fine-tuning."""
    if config.gradient_checkpointing:
        enable_activation_checkpointing(model)
    if not config.use_lora:
        return model.train()
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.lora_rank,
        lora_alpha=config.effective_lora_alpha,
        target_modules="all-linear",
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft 0.21's PeftModel reads transformers' deprecated `is_gradient_checkpointing`
        # (peft/peft_model.py), which prints a FutureWarning in every run; grpo_lab itself
        # calls the new activation_checkpointing API. Only that message is hidden.
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return get_peft_model(model, lora).train()


class GRPOTrainer:
    """Synchronous GRPO. `train()` runs `config.steps` steps and returns the metric records.

    `GRPOTrainer(config)`, or with a loaded `model` (and its `tokenizer`). TRL's form works too:
    `GRPOTrainer(model, reward_funcs, args=GRPOConfig(...), train_dataset=..., eval_dataset=...,
    peft_config=..., processing_class=tokenizer)` (grpo_lab.train.config.
    config_from_trl_arguments)."""

    def __init__(self, config: GRPOConfig | None = None, model=None, tokenizer=None, *,
                 reward_funcs=None, args: GRPOConfig | None = None, train_dataset=None,
                 eval_dataset=None, peft_config=None, processing_class=None):
        if not isinstance(config, GRPOConfig):  # TRL's order: (model, reward_funcs, args=...)
            if config is not None and reward_funcs is None:  # positional: (model, reward_funcs)
                model, reward_funcs = config, model
            elif config is not None:
                model = config
            config, model = config_from_trl_arguments(model, reward_funcs, args, train_dataset,
                                                      eval_dataset, peft_config,
                                                      self.config_class)
            tokenizer = processing_class if processing_class is not None else tokenizer
        self.config = config
        if config.num_threads:  # only when asked: torch's default otherwise, CPU or GPU
            torch.set_num_threads(config.num_threads)
        self.task = config.make_task()
        self.rewards = RewardSet.parse(config.reward, config.reward_weights, config.eval_reward)
        # Each reward takes a step's keywords (a problem drawn aside: the run's rng is untouched).
        self.rewards.check_problem(self.task.sample_batch(random.Random(0), 1)[0])
        self.max_completion_length = (config.max_completion_length
                                      or self.task.default_max_completion_length)
        self._warned_cap = False  # `warn_if_capped` speaks once
        self.eval_answers: dict[int, list[str]] = {}
        """step -> the greedy completions of that evaluation (this process's share of the
        held-out set, in its order): the same problems before and after, side by side."""
        self.rng = random.Random(config.seed)  # prompt sampling
        torch.manual_seed(config.seed)  # LoRA init and sampling
        self.processes = Processes(config.device)  # one, or several under `accelerate launch`
        self.device = self.processes.device or resolve_device(config.device)
        if config.prompts_per_step < self.processes.num_processes:
            raise ValueError(f"prompts_per_step ({config.prompts_per_step}) must be at least the "
                             f"number of processes ({self.processes.num_processes})")
        if config.dynamic_sampling and self.processes.distributed:
            raise ValueError("dynamic_sampling runs in one process (each would sample apart)")

        # Full fine-tuning in bfloat16 keeps float32 master weights and runs under bfloat16
        # autocast, as TRL does (bf16=True): AdamW's updates are far below a bfloat16 weight's
        # resolution. LoRA trains float32 adapters on bfloat16 weights (peft upcasts them).
        dtype = resolve_dtype(config.dtype, self.device)
        self.autocast_dtype = dtype if dtype == torch.bfloat16 and not config.use_lora else None
        if model is None:
            path = self.resolve_model_path(config)
            model, tokenizer = load_model_and_tokenizer(
                path, device=self.device,
                dtype=torch.float32 if self.autocast_dtype else dtype)
        if tokenizer is None:  # a loaded model alone: its tokenizer from where it came, as TRL
            tokenizer = tokenizer_of(model)
        self.tokenizer = tokenizer
        # How prompts become ids, in training and evaluation alike (grpo_lab.data.prompts).
        self.prompt_format = {"system_prompt": config.system_prompt,
                              "chat_template": config.chat_template}
        self.model = prepare_policy(model.to(self.device), config)  # LoRA, checkpointing
        self.share_prompts = config.shared_prompt and supports_shared_prompt(self.model)
        params = [p for p in self.model.parameters() if p.requires_grad]
        # torch's fused AdamW (TRL's default, `adamw_torch_fused`): one pass over each weight,
        # without the foreach implementation's temporary copies of all of them; one process.
        fused = not self.processes.distributed and all(
            p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=config.learning_rate,
                                           betas=(0.9, config.adam_beta2),
                                           weight_decay=config.weight_decay, fused=fused or None)
        self.num_trainable = sum(p.numel() for p in params)
        # A frozen copy is the KL reference for full fine-tuning; LoRA uses the disabled adapter.
        self.ref_model = None
        if config.beta > 0 and not config.use_lora:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        # Under `accelerate launch`: `train_model` is the DDP/FSDP2-wrapped model the loss goes
        # through; `model` stays the plain module (generation, evaluation, adapters). One
        # process: both are the same model.
        self.train_model, self.model, self.optimizer = self.processes.prepare(self.model,
                                                                             self.optimizer)

        self.step_count = 0
        out = Path(config.output_dir) if config.output_dir and self.processes.is_main else None
        if out:
            out.mkdir(parents=True, exist_ok=True)
            config.save(out / "config.json")
        # Each record goes to metrics.jsonl and to `report_to`'s trackio/TensorBoard (main only).
        self.logger = MetricsLogger(out / "metrics.jsonl" if out else None,
                                    make_reporters(config) if self.processes.is_main else (),
                                    doctor=make_doctor(config) if self.processes.is_main else None,
                                    write=tqdm.write)
        self.completion_log = CompletionLog(
            config.log_completions_every, config.num_completions_to_print, out,
            prompt_text=lambda prompt: render_prompt(self.tokenizer, prompt, **self.prompt_format),
            write=tqdm.write)

    config_class = GRPOConfig
    """The config TRL's form builds when `args` is left out (and the one `args` must be)."""
    resolve_model_path = staticmethod(resolve_model_path)

    # ------------------------------------------------------------------ the algorithm

    def make_batch(self, problems: list[Problem], sampled: SampledGroups | None = None
                   ) -> tuple[RolloutBatch, Completions, dict]:
        """Stages 1-3 for a list of problems (`sampled`: theirs, already sampled and scored);
        returns the batch, the completions and each reward function's scores."""
        sampled = self.sample(problems) if sampled is None else sampled
        return grpo_step.to_batch(self, sampled), sampled.out, sampled.parts

    # The steps of grpo_lab.train.grpo_step, as methods a subclass (or a notebook) may replace.

    def sample(self, problems: list[Problem]) -> SampledGroups:
        """Stages 1-2 (grpo_step.sample)."""
        return grpo_step.sample(self, problems)

    def score(self, problems: list[Problem], out: Completions
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Stage 2 (grpo_step.score)."""
        return grpo_step.score(self, problems, out)

    def optimize(self, batch: RolloutBatch) -> dict[str, float]:
        """Stage 4 (grpo_step.update): `num_iterations` clipped-surrogate updates on one batch
        over micro-batches of at most `token_budget` forward tokens.

        With `vllm_importance_sampling_correction` the ratio is taken against the trainer's own
        logprobs before the first update (TRL's old_per_token_logps) and each token's loss is
        weighted by pi_old / pi_sampler. Here the sampler is this very model, so the weights are
        1 up to float rounding: the `sampling/*` metrics show that gap."""
        return grpo_step.update(self, batch)

    def micro_batches(self, batch: RolloutBatch, token_budget: int | None = None, **packing):
        return grpo_step.micro_batches(self, batch, token_budget, **packing)

    def apply_gradients(self) -> float:
        """Clip, set the learning rate, step the optimizer; the gradient norm before clipping."""
        return grpo_step.apply_gradients(self)

    def sampler_weights(self, old_logps: torch.Tensor, sampler_logps: torch.Tensor,
                        mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """pi_old / pi_sampler of the configured mode and cap, and TRL's `sampling/*` metrics."""
        return grpo_step.sampler_weights(self.config, old_logps, sampler_logps, mask)

    def sampler_metrics(self, batch: RolloutBatch, pi_old: torch.Tensor) -> dict[str, float]:
        """With `vllm_importance_sampling_correction`, TRL's `sampling/*` over the whole batch
        (`pi_old`: the trainer's logprobs before the update, (B, T)); none otherwise."""
        if not self.config.vllm_importance_sampling_correction:
            return {}
        return self.sampler_weights(pi_old, batch.old_logps, batch.completion_mask)[1]

    def peak_flops(self) -> float | None:
        """One process's peak FLOP/s (grpo_lab.watch.flops): a GPU's published one, or the CPU's
        measured once at the trainer's threads. None when unknown (no MFU is logged)."""
        if not hasattr(self, "_peak_flops"):
            dtype = self.autocast_dtype or next(self.model.parameters()).dtype
            threads = getattr(self.config, "trainer_threads", None) or torch.get_num_threads()
            self._peak_flops = peak_flops(self.device, dtype, threads)
        return self._peak_flops

    def throughput(self, metrics: dict, fwd_bwd_s: float, step_s: float) -> dict[str, float]:
        """Tokens per second and MFU of the step whose update went into `metrics`; none when the
        update made no layout metrics (a subclass's own `optimize`, as notebook 01's)."""
        if "batch/forwarded_tokens_per_step" not in metrics:
            return {}
        return throughput_metrics(metrics, self.config.num_iterations, fwd_bwd_s, step_s,
                                  getattr(self, "_step_flops", None), self.peak_flops(),
                                  self.processes.num_processes)

    def step(self) -> dict[str, float]:
        """One GRPO step on fresh prompts; returns its metrics."""
        start = time.perf_counter()
        problems = self.task.sample_batch(self.rng, self.config.prompts_per_step)
        problems = self.processes.share(problems)  # every process samples all, keeps its share
        sampled, sampling = None, {}
        if self.config.dynamic_sampling:  # DAPO: only groups whose rewards differ
            sampled, sampling = sample_with_signal(
                self.sample, lambda n: self.task.sample_batch(self.rng, n), problems,
                self.config.num_generations, self.config.dynamic_sampling_max_rounds)
            problems = sampled.problems
        batch, out, parts = self.make_batch(problems, sampled)
        generated = time.perf_counter()
        metrics = self.optimize(batch)
        done = time.perf_counter()
        self.step_count += 1
        rewards = batch.rewards
        if self.processes.distributed:  # the step's samples, from every process, for its metrics
            problems, out, rewards, parts = gather_samples(
                self.processes, problems, out, rewards.cpu(), parts)
        if not self.processes.is_main:
            metrics.update(step=self.step_count)
            return metrics
        self.completion_log.log(self.step_count, problems, out, rewards.cpu(), parts)
        metrics.update(step=self.step_count, **rollout_metrics(rewards, out,
                                                               self.config.num_generations, parts))
        metrics.update(sampling)
        metrics.update({"perf/generate_s": generated - start,
                        "perf/fwd_bwd_s": done - generated,
                        "perf/step_s": done - start,
                        "batch/groups_per_step": len(problems)})
        metrics.update(self.throughput(metrics, done - generated, done - start))
        return metrics

    def evaluate(self) -> float:
        """Greedy accuracy on the task's fixed held-out set (each process evaluates its share)."""
        problems = self.task.eval_set()
        mine = self.processes.share(list(problems))
        # the evaluation's reward is called as in training: every keyword, every column
        texts, scores = greedy_answers(self.model, self.tokenizer, mine,
                                       max_new_tokens=self.max_completion_length,
                                       score=self.rewards.correctness_scores,
                                       **self.prompt_format)
        self.eval_answers[self.step_count] = texts
        accuracy = sum(r >= 1.0 for r in scores) / max(len(mine), 1)  # NaN: not correct
        if not self.processes.distributed:
            return accuracy
        correct = self.processes.sum([round(accuracy * len(mine))])[0]
        return correct / max(len(problems), 1)

    def train(self, steps: int | None = None, callback=None,
              resume_from_checkpoint: bool | str | Path | None = None) -> list[dict]:
        """Run `steps` (default config.steps) steps, evaluating before, every eval_every, after.
        `resume_from_checkpoint` (TRL's argument): True = the newest checkpoint under
        `<output_dir>/checkpoints` (written every `save_steps`), or a checkpoint's folder; the run
        then goes on to config.steps in all."""
        cfg = self.config
        if resume_from_checkpoint:
            self.resume(resume_from_checkpoint)
            if steps is None and self.step_count >= cfg.steps:
                return self.logger.records  # that run had finished
        steps = steps or cfg.steps - self.step_count
        evaluating = cfg.eval_size > 0  # 0: no held-out evaluation at all
        if self.step_count == 0:
            if self.logger.path and not self.logger.records:  # a fresh run, never mixed
                if earlier := set_aside_earlier_run(self.logger.path.parent):
                    self.logger.number_run(int(earlier.name) + 1)  # trackio: <name>-2, -3, ...
                    tqdm.write(f"{self.logger.path.parent} held an earlier run: its records "
                               f"moved to {earlier}")
            self.check_prompt_format()
            if evaluating and cfg.eval_reward is None and len(self.rewards.names) > 1 \
                    and self.processes.is_main:  # which reward is "accuracy", said once
                tqdm.write(f"held-out accuracy counts reward {self.rewards.correctness_name!r}, "
                           f"the first of {len(self.rewards.names)}: name the correctness "
                           "reward with eval_reward= if it is another")
            if evaluating:
                self.logger.log({"step": 0, "eval/accuracy": self.evaluate()})
        last = self.step_count + steps
        bar = tqdm(total=steps, desc="GRPO", disable=not cfg.progress or not self.processes.is_main)
        self.start_steps()
        try:
            for _ in range(steps):
                record = self.step()
                self.warn_if_capped(record)
                due = cfg.eval_every and record["step"] % cfg.eval_every == 0
                if evaluating and (due or record["step"] == last):
                    record["eval/accuracy"] = self.evaluate()
                self.logger.log(record)
                if cfg.save_steps and record["step"] % cfg.save_steps == 0:
                    self.save_checkpoint()
                bar.update(1)
                if not self.processes.is_main:  # the main process logs and prints
                    if callback is not None:
                        callback(record)
                    continue
                shown = {"reward": f"{record['reward']:.2f}"}
                if self.logger.findings:  # the run doctor's findings so far (printed once each)
                    shown["doctor"] = ",".join(f.code for f in self.logger.findings)
                if "eval/accuracy" in record:  # evaluation steps only: no `acc=nan` between
                    shown["acc"] = f"{record['eval/accuracy']:.2f}"
                bar.set_postfix(shown)
                if record["step"] % cfg.log_every == 0:
                    bar.write(format_step(record, last))
                if callback is not None:
                    callback(record)
        finally:
            self.stop_steps()
            self.logger.close()  # trackio's run ends (a later `train()` continues it)
            bar.close()
        if cfg.output_dir:
            self.save(Path(cfg.output_dir) / ("adapter" if cfg.use_lora else "model"))
        return self.logger.records

    def warn_if_capped(self, record: dict) -> None:
        """Say once when most of a step's completions stop at `max_completion_length` (`length`):
        cut completions score no answer and bias the length (notebook 10)."""
        clipped = record.get("completions/clipped_ratio", 0.0)
        if self._warned_cap or clipped < CAPPED_WARNING or not self.processes.is_main:
            return
        self._warned_cap = True
        tqdm.write(f"warning: {clipped:.0%} of step {record['step']}'s completions reached "
                   f"max_completion_length={self.max_completion_length} and were cut; if they "
                   "are reasoning, raise max_completion_length", file=sys.stderr)

    def check_prompt_format(self) -> None:
        """The run doctor's look at a prompt as the model reads it: a chat model's prompts must
        go through its chat template."""
        if self.logger.doctor is None:
            return
        text = render_prompt(self.tokenizer, self.task.eval_set()[0].prompt, **self.prompt_format)
        finding = chat_template_finding(self.tokenizer, text)
        if finding is not None:
            self.logger.report_finding(finding)

    def start_steps(self) -> None:
        """Called by `train()` after the initial evaluation, before the first step (no-op here)."""

    def stop_steps(self) -> None:
        """Called by `train()` after the last step, even on error (no-op here)."""

    @property
    def accuracy_history(self) -> list[tuple[int, float]]:
        return [(r["step"], r["eval/accuracy"]) for r in self.logger.records
                if "eval/accuracy" in r]

    # ------------------------------------------------------------------ checkpoints

    @property
    def checkpoints(self) -> Checkpoints | None:
        """`<output_dir>/checkpoints` (grpo_lab.bucket.checkpoint), or None without output_dir."""
        out = self.config.output_dir
        return Checkpoints(Path(out) / "checkpoints", keep=self.config.save_total_limit) \
            if out else None

    def save_checkpoint(self) -> Path | None:
        """Weights, optimizer, step, version and RNGs at this step (every process calls this:
        FSDP2 gathers; the main process writes)."""
        if not self.processes.is_main:
            full_state(self)
            return None
        return self.checkpoints.save(self, {})

    def resume(self, checkpoint: bool | str | Path) -> Path:
        """Load a checkpoint (True: the newest under `<output_dir>/checkpoints`) into this
        trainer, and keep the run's metrics up to its step (later ones are logged again)."""
        if checkpoint is True:
            found = self.checkpoints.latest() if self.checkpoints else None
            if found is None:
                where = (f"under {Path(self.config.output_dir) / 'checkpoints'}"
                         if self.config.output_dir else "without output_dir")
                raise ValueError(f"resume_from_checkpoint=True: no checkpoint {where}; "
                                 "save_steps=N writes one every N steps")
            checkpoint = found
        checkpoint = Path(checkpoint)
        if not (checkpoint / "state.json").is_file():
            raise ValueError(f"resume_from_checkpoint={str(checkpoint)!r}: not a checkpoint "
                             "(a folder with state.json, e.g. <output_dir>/checkpoints/step-N)")
        state = Checkpoints.load(checkpoint, self)
        if self.logger.path and self.logger.path.exists():  # this run's records so far
            kept = [r for r in read_metrics(self.logger.path) if r.get("step", 0) <= state["step"]]
            self.logger.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self.logger.records = kept
        if self.processes.is_main:
            tqdm.write(f"resuming from {checkpoint} at step {self.step_count}")
        return checkpoint

    def save(self, path: str | Path) -> Path:
        """The adapter (adapter_config.json + adapter_model.safetensors) or the full model,
        written by the main process (every process calls this: FSDP2 gathers the weights)."""
        path = Path(path)
        model = self.processes.full_model(self.train_model, self.model)
        if self.processes.is_main:
            model.save_pretrained(path)
            if not self.config.use_lora:
                self.tokenizer.save_pretrained(path)
        self.processes.wait()
        return path
