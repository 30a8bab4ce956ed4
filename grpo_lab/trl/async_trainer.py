"""TRL's `AsyncGRPOTrainer` fitted to grpo_lab: its settings, the bucket, a CPU.

`trl_config` maps grpo_lab's `AsyncGRPOConfig` onto TRL's (one optimizer step is exactly
`prompts_per_step` x G samples); `BucketAsyncGRPOTrainer` saves each adapter version
`trl-policy-v{N}` into the bucket. The job that runs it is grpo_lab.trl.async_job; what TRL
needs besides grpo_lab: docs/recipe.md, "TRL's AsyncGRPOTrainer as the trainer job" (and
docs/internals.md, "TRL's AsyncGRPOTrainer").
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
from pathlib import Path

from ..data.prompts import as_conversation
from ..data.reward_set import RewardSet, call_reward
from ..train.async_config import AsyncGRPOConfig
from ..util.devices import resolve_dtype
from .cpu import require_trl

LORA_NAME = "trl-policy"
"""TRL's adapter name: versions are `trl-policy-v1`, `trl-policy-v2`, ... on the servers."""


def trl_async_grpo():
    """TRL's (AsyncGRPOConfig, AsyncGRPOTrainer), after `require_trl`: under
    `trl.experimental.async_grpo` in the tested releases. Every import of them in grpo_lab goes
    through here; TRL's internals, through rollout.trl_cpu."""
    require_trl()
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    return AsyncGRPOConfig, AsyncGRPOTrainer


def micro_batch_size(samples: int, sample_tokens: int, token_budget: int | None) -> int:
    """Samples per micro-batch: the whole step's without a budget; with one, the most samples of
    the longest possible length (`sample_tokens`) that fit in `token_budget` (at least one),
    lowered to a divisor of `samples` so that the micro-batches add up to exactly one step."""
    if token_budget is None:
        return samples
    fit = max(1, min(samples, token_budget // sample_tokens))
    return max(n for n in range(1, fit + 1) if samples % n == 0)


def trl_config(config: AsyncGRPOConfig, job, output_dir: Path, device: str,
               max_completion_length: int, prompt_tokens: int = 0):
    """grpo_lab's settings -> TRL's `AsyncGRPOConfig`; one optimizer step = exactly
    prompts_per_step x G samples. `job`: the job's flags (grpo_lab.trl.async_job's
    TrlAsyncJobConfig: server URL, timeouts, in-flight cap, checkpoints).

    TRL's own `token_budget` (its `TokenBudgetBatcher`; None means the server's max_model_len)
    fills each micro-batch with however many samples fit, ignoring per_device_train_batch_size,
    so a step would be one packed row. TRL is given `token_budget=0` (its fixed-count batcher)
    instead: without grpo_lab's token_budget one micro-batch holds the whole step; with it, each
    holds `micro_batch_size` samples (at most `token_budget` tokens even if every sample has the
    longest prompt, `prompt_tokens`, and a full completion) and gradient accumulation adds them
    up to the step. The weights stay float32: `--dtype` (bfloat16 on a GPU) is the autocast's."""
    TRLAsyncGRPOConfig, _ = trl_async_grpo()
    if config.stop or config.stop_token_ids:
        raise ValueError("stop and stop_token_ids: TRL's rollout worker sends neither (use "
                         "train-async)")
    group = config.num_generations
    samples = config.prompts_per_step * group
    micro = micro_batch_size(samples, prompt_tokens + max_completion_length, config.token_budget)
    compute = str(resolve_dtype(config.dtype, device)).removeprefix("torch.")
    checkpoints = ({"save_strategy": "steps", "save_steps": job.checkpoint_every,
                    "save_total_limit": job.keep_checkpoints} if job.checkpoint_every
                   else {"save_strategy": "no"})
    return TRLAsyncGRPOConfig(
        output_dir=str(output_dir), max_steps=config.steps, seed=config.seed,
        per_device_train_batch_size=micro, gradient_accumulation_steps=samples // micro,
        token_budget=0, num_generations=group,
        max_completion_length=max_completion_length, temperature=config.temperature,
        top_p=config.top_p, top_k=config.top_k, min_p=config.min_p,
        repetition_penalty=config.repetition_penalty,
        learning_rate=config.learning_rate, lr_scheduler_type=config.lr_scheduler_type,
        adam_beta2=config.adam_beta2, weight_decay=config.weight_decay,
        max_grad_norm=config.max_grad_norm, epsilon=config.epsilon_low,
        epsilon_high=config.epsilon_high, max_staleness=config.max_staleness,
        weight_sync_steps=config.weight_sync_steps,
        queue_maxsize=config.effective_buffer_size * group,
        max_inflight_tasks=job.max_inflight if job.max_inflight is not None else -1,
        vllm_server_base_url=job.server_url, vllm_server_timeout=job.server_timeout_s,
        request_timeout=job.request_timeout_s,
        gradient_checkpointing=config.gradient_checkpointing,
        dtype="float32", bf16=compute == "bfloat16", fp16=compute == "float16",
        use_cpu=device == "cpu", logging_steps=1, disable_tqdm=True,
        # TRL's own reporting (trackio resumes the run of this name: the curve continues)
        report_to=config.report_to or "none", run_name=config.effective_run_name,
        project=config.project,
        trackio_space_id=config.trackio_space_id,
        **checkpoints)


def vllm_origin() -> str | None:
    """Where `import vllm` finds the package: the real one, or a stand-in (None = neither)."""
    spec = importlib.util.find_spec("vllm")
    return spec.origin if spec else None


def lora_config(config: AsyncGRPOConfig):
    from peft import LoraConfig

    return LoraConfig(r=config.lora_rank, lora_alpha=config.effective_lora_alpha,
                      target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")


def trainer_classes():
    from transformers import TrainerCallback

    _, AsyncGRPOTrainer = trl_async_grpo()

    class BucketAsyncGRPOTrainer(AsyncGRPOTrainer):
        """TRL's trainer, with its adapters saved into `bucket` (the servers' adapter folder),
        numbered after `published` (the newest version a previous run left there) and, off a
        GPU, tree attention computed by grpo_lab.trl.cpu."""

        def __init__(self, *args, bucket: Path, cpu_attention: bool, published: int = 0,
                     **kwargs):
            super().__init__(*args, **kwargs)  # registers TRL's FlashAttention-3 tree attention
            if cpu_attention:
                from .cpu import use_cpu_tree_attention

                use_cpu_tree_attention()
            self._lora_dir = str(bucket.resolve())  # trl-policy-vN/ land in the bucket
            self._published = published

        def _sync_weight(self):
            # A resumed run: TRL restores the checkpoint's version, but a preempted run may have
            # published later ones that the servers still hold; go on after the newest.
            if self._published > self.model_version:
                self.model_version = self._published
            self._published = 0
            super()._sync_weight()

    class LogLines(TrainerCallback):
        """One line per logged step with fixed keys; `metrics.jsonl` rewritten whole each time
        (a file on a bucket mount is written in one piece, never appended to)."""

        def __init__(self, path: Path, steps: int, records: list[dict]):
            self.path, self.steps, self.records = path, steps, records

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not logs or "loss" not in logs:
                return
            record = {"step": state.global_step, **logs}
            self.records.append(record)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records))
            print(f"[step {state.global_step}/{self.steps}] loss={logs['loss']:.4f} "
                  f"reward={logs.get('reward', math.nan):.3f} "
                  f"staleness={logs.get('sample/staleness_mean', math.nan):.2f} "
                  f"sync_s={logs.get('perf/weight_sync_s', math.nan):.2f}", flush=True)

    return BucketAsyncGRPOTrainer, LogLines


# ------------------------------------------------ grpo_lab's prompts and rewards as TRL's
# What TRL's AsyncGRPOTrainer trains on, from grpo_lab's run config: the prompts as a dataset of
# conversations, the rewards as TRL `reward_funcs`, and a way to read a completion back into a
# message (grpo_lab.trl.async_trainer runs the job).


class WeightedReward:
    """One reward of a `RewardSet` times its weight, picklable (TRL scores in a spawned process)
    and named as grpo_lab logs it (TRL logs `rewards/<__name__>`)."""

    def __init__(self, name: str, fn, weight: float):
        self.__name__, self.fn, self.weight = name, fn, weight

    def __call__(self, completions, **kwargs) -> list[float | None]:
        values = call_reward(self.__name__, self.fn, {"completions": completions, **kwargs})
        return [None if v is None else self.weight * float(v) for v in values]


def reward_funcs(config: AsyncGRPOConfig) -> list[WeightedReward]:
    """The config's rewards as TRL `reward_funcs`: TRL sums them (None counts as 0 unless every
    reward is None), which is `RewardSet.score`'s weighted sum."""
    rewards = RewardSet.parse(config.reward, config.reward_weights)
    return [WeightedReward(n, f, w) for n, f, w in zip(rewards.names, rewards.functions,
                                                       rewards.weights)]


CHATML_RESPONSE = {"defaults": {"role": "assistant"}, "start_anchor": "<|im_start|>assistant\n",
                   "fields": {"content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"}}}
"""How an assistant turn of a ChatML template without tools is read back into a message
(transformers' `response_template`): its text up to <|im_end|>."""


def with_response_parser(tokenizer):
    """TRL's rollout worker reads each completion back into a message (`parse_response`) and
    knows the templates of well-known models only; a ChatML template it does not know (the
    offline chat model's) gets `CHATML_RESPONSE`. Others must bring their own."""
    from .cpu import require_trl

    require_trl()
    from trl.chat_template_utils import add_response_schema

    if getattr(tokenizer, "response_template", None) or getattr(tokenizer, "response_schema", None):
        return tokenizer
    try:
        return add_response_schema(tokenizer)
    except ValueError:
        if "<|im_start|>" not in (tokenizer.chat_template or ""):
            raise ValueError("TRL's AsyncGRPOTrainer cannot read this model's completions back "
                             "into messages: its chat template is neither one TRL knows nor "
                             "ChatML; set tokenizer.response_template") from None
    tokenizer.response_template = CHATML_RESPONSE
    return tokenizer


def trl_dataset(config: AsyncGRPOConfig, task=None):
    """One row per prompt of the run (`steps * prompts_per_step`), drawn as grpo_lab's trainer
    draws them (seeded, never a held-out prompt): `prompt` as a conversation (TRL's async trainer
    renders every prompt with the chat template), `answer` for the rewards."""
    from datasets import Dataset

    task = task or config.make_task()
    problems = task.sample_batch(random.Random(config.seed), config.steps * config.prompts_per_step)
    return Dataset.from_list([{"prompt": as_conversation(p.prompt, config.system_prompt),
                               "answer": p.answer} for p in problems])


def max_prompt_tokens(dataset, tokenizer) -> int:
    """The longest prompt of the run in tokens, rendered as TRL's rollout worker renders it."""
    return max(len(tokenizer.apply_chat_template(row["prompt"], return_dict=False,
                                                 add_generation_prompt=True))
               for row in dataset)
